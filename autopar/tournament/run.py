"""``autopar execute`` of a plan with a trainer level: run the T trainers, check them against
the single-process simulation, and write ``run.json`` (schema ``autopar.tournament-run/1``),
``report.md`` and ``metric.png``.

run.json::

    schema, created, plan, model, trainers, ranks_per_trainer, world_size, interval_steps,
    rounds, exchange, metric, dtype, options, wall_s
    rounds_log   [{round, step, alive, pairs, results: [{trainer, partner, metric_own,
                   metric_partner, winner, kept, notes, exchange_s, eval_s}]}]
    trainers     [{trainer, ranks, status: finished|stopped, stopped: {round, step, reason,
                   seen_by, after_s} | null, metric_over_time: [[step, metric]], step_s}]
    measured     {step_s, exchange_s, eval_s, tournament_s, samples_per_s}  (medians; the
                 slowest rank of a trainer per round), exchange_bytes (every tensor every rank
                 sent over the run: parameter shards, buffers, momentum when exchanged; per
                 round and trainer in rounds_log), exchange_bytes_per_rank (one exchange)
    predicted    the plan's trainer-level prediction (``autopar.tournament.pricing``), its
                 exchange figures in the run's dtype (``priced_dtype``)
    validation   {passed, checked, max_rel_diff, winners_equal, alive_equal, survivors, rule} or
                 {skipped: why}: against the simulation of the same run (an injected
                 ``--kill-trainer`` included: the survivors are compared)
"""

from __future__ import annotations

import dataclasses
import math
import datetime as _dt
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from ..artifacts import TrainerPrediction, load_plan
from ..errors import AutoparError, ValidationFailed
from ..io import atomic_write_json, atomic_write_text
from .runtime import Board, TournamentRunOptions, trainer_rank_main
from ..execute.files import check_plan_files
from ..execute.validate import DEFAULT_TOL
from .launch import run_trainers
from .simulate import simulate

TOURNAMENT_RUN_SCHEMA = "autopar.tournament-run/1"


def _json_num(x):
    """JSON has no NaN or infinity: a non-finite metric is written as the string "nan"/"inf"."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def execute_tournament(plan_path: str | Path, opts: TournamentRunOptions, out_dir: str | Path | None = None,
                       progress=print, validate: bool = True, rtol: float | None = None) -> tuple[dict[str, Any], Path]:
    """Run a tournament plan and validate it against its simulation, every tensor within
    ``rtol`` (None: the run dtype's, ``execute.validate.DEFAULT_TOL``) of its scale."""

    plan_path = Path(plan_path)
    plan = load_plan(plan_path)
    level = plan.trainers
    if level is None:
        raise AutoparError(f"{plan_path} has no trainer level", "plan it with autopar plan --trainers T")
    module_path = check_plan_files(plan_path, plan)
    world = level.world_size
    progress(f"tournament: {level.trainers} trainers x {level.ranks_per_trainer} ranks ({world} processes), "
             f"{opts.rounds} rounds of {level.interval_steps} steps, exchange {level.exchange}, metric {level.metric}")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(out_dir) if out_dir is not None else Path("reports") / f"{plan.model.name}-ltfb-t{level.trainers}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    # the trainers' coordination files: read back below (who stopped, in which round), then
    # removed with the directory, whatever happens
    with tempfile.TemporaryDirectory(prefix="autopar-ltfb-board-", ignore_cleanup_errors=True) as board_dir:
        return _run_and_report(plan_path, plan, level, module_path, opts, out, board_dir, progress,
                               validate, rtol)


def _run_and_report(plan_path: Path, plan, level, module_path, opts: TournamentRunOptions, out: Path,
                    board_dir: str, progress, validate: bool, rtol: float) -> tuple[dict[str, Any], Path]:
    """``execute_tournament`` past its checks: run the trainers on ``board_dir``, then write
    the run, its report and its plot to ``out``."""
    world = level.world_size
    board = Board(board_dir)
    t0 = time.perf_counter()
    results, stopped = run_trainers(trainer_rank_main, world, level.ranks_per_trainer,
                                    (str(plan_path), str(module_path), board_dir, opts), board, opts.timeout_s,
                                    max_wall_s=opts.timeout_s * (opts.rounds + 2))
    wall = time.perf_counter() - t0
    n = level.ranks_per_trainer
    # ---- per round, per trainer: the slowest rank's times
    rounds_log = []
    for k in range(opts.rounds):
        recs = {}
        for r, res in results.items():
            for rec in res["records"]:
                if rec["round"] != k:
                    continue
                cur = recs.get(rec["trainer"])
                if cur is None:
                    recs[rec["trainer"]] = dict(rec)
                else:
                    for key in ("exchange_s", "eval_s", "wait_s"):
                        cur[key] = max(cur[key], rec[key])
                    cur["exchange_bytes"] = cur.get("exchange_bytes", 0) + rec.get("exchange_bytes", 0)
        if not recs:
            continue
        any_rec = next(iter(recs.values()))
        rounds_log.append({"round": k, "step": any_rec["step"], "alive": any_rec["alive"],
                           "pairs": [list(p) for p in any_rec["pairs"]],
                           "results": [{key: _json_num(rec.get(key)) for key in ("trainer", "partner", "metric_own", "metric_partner",
                                                                        "winner", "kept", "notes", "exchange_s", "eval_s",
                                                                        "wait_s", "exchange_bytes", "exchange_error")}
                                       for _, rec in sorted(recs.items())]})
    trainers = []
    for t in range(level.trainers):
        ranks = list(level.trainer_ranks(t))
        st = stopped.get(t)
        info = board.dead(t) if st is not None else None
        if st is not None and (info or {}).get("round") is None:
            # a silent death: the board still says which rounds it reached
            ready = [k for k in range(opts.rounds) if board._read(f"round-{k}-{t}") == "ready"]
            k = (max(ready) + 1) if ready else 0
            info = dict(info or {}, round=k, step=k * level.interval_steps,
                        reason=(info or {}).get("reason") or st["reason"])
        mine = [results[r] for r in ranks if r in results]
        trainers.append({
            "trainer": t, "ranks": ranks, "status": "stopped" if st else "finished",
            "stopped": None if st is None else {
                "round": (info or {}).get("round"), "step": (info or {}).get("step"),
                "reason": (info or {}).get("reason") or st["reason"].splitlines()[0],
                "seen_by": (info or {}).get("seen_by", "the launcher"), "after_s": st["after_s"],
                "launcher_saw": st["reason"].splitlines()[0][:300]},
            "metric_over_time": [[lg["step"], res["metric_own"]] for lg in rounds_log for res in lg["results"]
                                 if res["trainer"] == t and not isinstance(res["metric_own"], str)],
            "step_s": _median([max(x["step_s"][i] for x in mine) for i in range(len(mine[0]["step_s"]))]) if mine else None})
    fin = [res for res in results.values()]
    samples = sum(res["samples"] for res in fin if res["mesh_rank"] == 0)
    span = (max(res["t_end"] for res in fin) - min(res["t_start"] for res in fin)) if fin else 0.0
    exch = [x["exchange_s"] for lg in rounds_log for x in lg["results"] if x["partner"] != x["trainer"]]
    evs = [x["eval_s"] for lg in rounds_log for x in lg["results"]]
    # bytes: every tensor each rank sent (parameter shards, buffers, momentum), summed
    per_rank_bytes = [rec["exchange_bytes"] for res in fin for rec in res["records"] if rec.get("exchange_bytes")]
    measured = {"step_s": _median([tr["step_s"] for tr in trainers]), "exchange_s": _median(exch),
                "exchange_bytes": sum(x["exchange_bytes"] or 0 for lg in rounds_log for x in lg["results"]),
                "exchange_bytes_per_rank": max(per_rank_bytes) if per_rank_bytes else 0,
                "eval_s": _median(evs),
                "tournament_s": (_median(exch) or 0.0) + (_median(evs) or 0.0),
                "samples_per_s": samples / span if span > 0 else None, "samples": samples, "span_s": span,
                "note": "exchange/eval: per round, the slowest rank of each trainer; samples/s over the "
                        "trainers' common span (first start to last end)"}
    # ---- validation against the single-process simulation
    if not validate:
        validation = {"skipped": "not asked (--no-validate)"}
    elif set(stopped) != set(_injected_stops(level.trainers, opts)):
        validation = {"skipped": f"trainer(s) {sorted(stopped)} stopped, not (only) the one --kill-trainer "
                                 f"stopped: the simulation knows only injected stops"}
    else:
        validation = _validate(plan, plan_path, opts, results, rounds_log, rtol)
    run = {
        "schema": TOURNAMENT_RUN_SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "plan": str(plan_path), "model": plan.model.name, "trainers": level.trainers,
        "ranks_per_trainer": n, "world_size": world, "interval_steps": level.interval_steps,
        "rounds": opts.rounds, "exchange": level.exchange, "metric": level.metric, "dtype": opts.dtype,
        "batch_per_trainer": plan.model.batch_size,
        "options": dataclasses.asdict(opts),
        "wall_s": wall, "rounds_log": rounds_log, "trainers_detail": trainers,
        "stopped": [tr["trainer"] for tr in trainers if tr["status"] == "stopped"],
        "measured": measured, "predicted": predicted_for_dtype(level.predicted, opts.dtype),
        "validation": validation}
    atomic_write_json(out / "run.json", run)
    atomic_write_text(out / "report.md", report_md(run))
    try:
        plot_metric(run, out / "metric.png")
    except Exception as e:  # a plot never fails a run
        progress(f"(no plot: {e})")
    if validation.get("passed") is False:
        raise ValidationFailed(f"the tournament differs from its single-process simulation: {validation['worst']}; "
                               f"details in {out / 'run.json'}", "report it with the plan file")
    return run, out


#: the figures ``tournament.pricing`` prices per run dtype (``<figure>_<dtype>``)
_BY_DTYPE = ("exchange_bytes_per_rank", "exchange_s", "tournament_s", "round_s", "samples_per_s")


def predicted_for_dtype(predicted: "TrainerPrediction | Mapping[str, Any]", dtype: str) -> dict[str, Any]:
    """The plan's trainer-level prediction with the exchange and the figures after it taken in
    the run's ``dtype`` (``priced_dtype`` says which; a plan priced before per-dtype figures
    existed keeps its own, said as "the plan's")."""
    figures = predicted.to_json() if isinstance(predicted, TrainerPrediction) else dict(predicted)
    out = dict(figures)
    if all(f"{k}_{dtype}" in figures for k in _BY_DTYPE):
        for k in _BY_DTYPE:
            out[k] = figures[f"{k}_{dtype}"]
        out["priced_dtype"] = dtype
    else:
        out["priced_dtype"] = "the plan's"
    return out


def _injected_stops(trainers: int, opts) -> list[int]:
    """The trainers ``opts.kill`` stops during the run (none when its round is past the end)."""
    if opts.kill is None:
        return []
    t, k = opts.kill
    return [t] if 0 <= t < trainers and 0 <= k < opts.rounds else []


def _validate(plan, plan_path, opts, results, rounds_log, rtol) -> dict[str, Any]:
    """Every surviving trainer's final parameters and buffers, every round's living set and
    every winner against the single-process simulation of the same run (``simulate``: the
    surviving set when a trainer was killed)."""
    import torch

    rtol_d, atol = DEFAULT_TOL.get(opts.dtype, DEFAULT_TOL["float64"])
    rtol = rtol_d if rtol is None else rtol
    ref = simulate(plan, plan_path, opts)
    n = plan.trainers.ranks_per_trainer
    worst, checked, bad = 0.0, 0, []
    for t in ref["survivors"]:
        got = results[t * n]
        for kind, pref in (("", ref["params"][t]), ("buffer ", ref["buffers"][t])):
            have = got["params"] if not kind else got.get("buffers", {})
            for q, r in pref.items():
                if q not in have:
                    bad.append(f"trainer {t} {kind}{q}: missing from the run")
                    continue
                g = torch.from_numpy(have[q])
                diff = float((g - r).abs().max()) if r.numel() else 0.0
                scale = float(r.abs().max()) if r.numel() else 0.0
                rel = diff / scale if scale > 0 else diff
                checked += 1
                worst = max(worst, rel)
                if not diff <= rtol * scale + atol:
                    bad.append(f"trainer {t} {kind}{q}: rel {rel:.3g}")
    run_alive = [lg["alive"] for lg in rounds_log]
    alive_equal = run_alive == ref["alive"]
    # a stopped trainer's records died with its processes: every round of the survivors
    live = set(ref["survivors"])
    run_w = {(x["trainer"], lg["round"]): x["winner"] for lg in rounds_log for x in lg["results"]
             if x["trainer"] in live}
    ref_w = {(x["trainer"], x["round"]): x["winner"] for x in ref["records"] if x["trainer"] in live}
    winners_equal = run_w == ref_w
    worst_text = (bad[0] if bad else "living trainers differ" if not alive_equal
                  else "winners differ" if not winners_equal else "")
    return {"passed": (not bad) and winners_equal and alive_equal, "checked": checked, "max_rel_diff": worst,
            "winners_equal": winners_equal, "alive_equal": alive_equal, "survivors": list(ref["survivors"]),
            "worst": worst_text,
            "rule": f"every surviving trainer's final parameters and buffers within rtol {rtol:g} of max|ref| "
                    f"(+{atol:g}) of the single-process simulation ({opts.dtype}) of the same run (an injected "
                    f"stop included), the same living trainers and every survivor's winner in every round"}


def _f(x, scale=1.0, fmt="{:.3f}"):
    return "n/a" if x is None else fmt.format(x * scale)


def _g(x):
    return x if isinstance(x, str) else f"{x:.6g}"


def report_md(run: dict[str, Any]) -> str:
    m, p = run["measured"], run["predicted"]
    lines = [f"# Tournament run: {run['model']}, {run['trainers']} trainers x {run['ranks_per_trainer']} ranks",
             "", f"{run['rounds']} rounds of {run['interval_steps']} steps, exchange {run['exchange']}, "
             f"metric {run['metric']}, {run['dtype']}; wall {run['wall_s']:.1f} s.", ""]
    v = run["validation"]
    lines.append("Validation: " + (f"skipped ({v['skipped']})" if "skipped" in v else
                 f"{'PASSED' if v['passed'] else 'FAILED'}: {v['checked']} tensors, max rel diff "
                 f"{v['max_rel_diff']:.2g}, winners equal: {v['winners_equal']} ({v['rule']})"))
    lines += ["", "## Measured against predicted", "",
              f"(the exchange priced in {p.get('priced_dtype', 'the plan' + chr(39) + 's')} dtype)", "",
              "| | measured | predicted |", "|---|---|---|",
              f"| step (ms) | {_f(m['step_s'], 1e3)} | {_f(p.get('step_s'), 1e3)} |",
              f"| exchange (ms) | {_f(m['exchange_s'], 1e3)} | {_f(p.get('exchange_s'), 1e3)} |",
              f"| exchange per rank (bytes) | {_f(m.get('exchange_bytes_per_rank'), 1, '{:.0f}')} | "
              f"{_f(p.get('exchange_bytes_per_rank'), 1, '{:.0f}')} |",
              f"| evaluation (ms) | {_f(m['eval_s'], 1e3)} | {_f(p.get('eval_s'), 1e3)} |",
              f"| samples/s (job) | {_f(m['samples_per_s'], 1, '{:.1f}')} | {_f(p.get('samples_per_s'), 1, '{:.1f}')} |",
              "", "## Rounds", "", "| round | step | alive | pairs | trainer | partner | own | partner's | kept | notes |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for lg in run["rounds_log"]:
        for x in lg["results"]:
            mp = x["metric_partner"]
            lines.append(f"| {lg['round']} | {lg['step']} | {lg['alive']} | {lg['pairs']} | {x['trainer']} | "
                         f"{x['partner']} | {_g(x['metric_own'])} | {'-' if mp is None else _g(mp)} | "
                         f"{x['kept']} | {'; '.join(x['notes'] or [])} |")
    lines += ["", "## Trainers", ""]
    for tr in run["trainers_detail"]:
        s = tr["stopped"]
        lines.append(f"* trainer {tr['trainer']} (ranks {tr['ranks']}): {tr['status']}" + (
            f" at round {s['round']}, step {s['step']}, {s['after_s']:.1f} s into the run: {s['reason']} "
            f"(seen by {s['seen_by']})" if s else f", median step {_f(tr['step_s'], 1e3)} ms"))
    lines += ["", "![metric over time](metric.png)", ""]
    return "\n".join(lines)


def plot_metric(run: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for tr in run["trainers_detail"]:
        pts = tr["metric_over_time"]
        if pts:
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o",
                    label=f"trainer {tr['trainer']}" + (" (stopped)" if tr["status"] == "stopped" else ""))
    ax.set_xlabel("step")
    ax.set_ylabel(f"metric ({run['metric']}), own model")
    if ax.get_legend_handles_labels()[0]:
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.set_title(f"{run['model']}: {run['trainers']} trainers")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
