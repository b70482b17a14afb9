"""Reports: what one run measured (run.json + report.md + PNG plots), and side-by-side summaries
of several runs or plans (``autopar report PATH...``). Only measured figures are reported as
measured; predictions are labelled as such."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping

from ..artifacts import Plan, RunFileError, RunResult, TournamentRun, write_run
from ..io import atomic_write_text, read_json
from ..errors import AutoparError


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.2f} ms"


def plot_run(run: RunResult, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    pl = run.measured.per_layer
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(pl) + 2), 4))
    xs = list(range(len(pl)))
    ax.bar([x - 0.2 for x in xs], [p.predicted_s * 1e3 for p in pl], width=0.4, label="predicted")
    ax.bar([x + 0.2 for x in xs], [p.measured_s * 1e3 for p in pl], width=0.4, label="measured")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{p.layer}:{p.module[-14:]}" for p in pl], rotation=80, fontsize=6)
    ax.set_ylabel("forward + backward time per layer (ms)")
    ax.set_title(f"{run.model} at world {run.world_size}: per-layer predicted vs measured")
    ax.legend()
    fig.tight_layout()
    p = out / "per_layer.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    names = ["predicted (plan)", "measured (plan)"]
    vals = [run.predicted.step_time_s * 1e3, run.measured.step_time_s * 1e3]
    if run.baseline:
        names.append("measured (torch DDP)")
        vals.append(run.baseline.ddp_step_time_s * 1e3)
    ax.bar(names, vals, color=["#8fb3de", "#1f77b4", "#ff7f0e"][: len(vals)])
    ax.set_ylabel("step time (ms)")
    ax.set_title("plan vs DDP")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    p = out / "plan_vs_ddp.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def _at_run_speed(run: RunResult, sp: dict) -> str:
    """The prediction scaled by the probe's ratio, against the measured step: a diagnostic of
    how much of a miss is the machine's speed since calibration rather than the cost model
    (across the prediction benchmark's runs the signed miss follows the ratio, though less than
    one for one: ``reports/benchmarks/speed_drift_across_runs.txt`` (removed; git 172578b^); so it explains most, not all)."""
    m, p = run.measured.step_time_s, run.predicted.step_time_s
    if not m or not p:
        return ""
    at = p * sp.get("slowdown_vs_pricing", sp["slowdown_vs_calibration"])
    return (f"; stated at the speed the probe read, the prediction would be {_ms(at)}, "
            f"error {_pct((at - m) / m)} (a diagnostic, not the prediction)")


def run_markdown(run: RunResult, plots: list[Path]) -> str:
    v = run.validation
    m = run.measured
    b = run.baseline
    lines = [f"# autopar run: {run.model} at world size {run.world_size} ({run.backend})", "",
             f"- plan: `{run.plan}`; decompositions used: {', '.join(run.decompositions)}",
             f"- validation: **{'PASSED' if v.passed else 'FAILED'}** ({v.checked} tensors: output, loss, "
             f"input gradients, every parameter gradient, parameters after one SGD step, replicated buffers; "
             f"rule {v.rule}, rtol {v.rtol:g}, atol {v.atol:g})",
             f"- step time: measured {_ms(m.step_time_s)} (median of {len(m.step_times_s)} steps, "
             f"slowest rank), predicted {_ms(run.predicted.step_time_s)}, "
             f"prediction error {_pct(run.prediction_error)} (predicted - measured) / measured",
             ]
    sp = (run.extra or {}).get("speed_probe")
    if sp:
        lines.append(f"- machine speed: the calibration's probe took {_ms(sp['execute_s'])} after timing, "
                     f"{_ms(sp['profile_nominal_s'])} when the profile's kernels were measured "
                     f"({sp['slowdown_vs_calibration']:.2f}x; above 1 this machine ran slower than then"
                     + (f"; the plan priced its compute at {_ms(sp['priced_at_s'])} (between that and this "
                        f"machine's usual reading, its speed history), {sp['slowdown_vs_pricing']:.2f}x that"
                        if sp.get("priced_at_s", sp["profile_nominal_s"]) != sp["profile_nominal_s"] else "")
                     + ", which the prediction does not know)" + _at_run_speed(run, sp))
    if b:
        lines.append(f"- torch DDP on the same model and batch: {_ms(b.ddp_step_time_s)}; plan / DDP = "
                     f"{run.ratio_to_ddp:.3f}x ({b.note})")
    gb = m.grad_sync_bytes_per_step
    line = f"- gradient bytes all-reduced per step per rank: {gb / 2**20:.2f} MiB"
    if b and b.ddp_allreduce_bytes_per_step:
        db = b.ddp_allreduce_bytes_per_step
        line += (f" (pure sample parallelism / DDP: {db / 2**20:.2f} MiB; "
                 f"{db / gb if gb else float('inf'):.2f}x less allreduce volume)")
    lines.append(line)
    ph = m.phases
    lines.append(f"- instrumented step: forward {_ms(ph['fwd_s'])}, backward {_ms(ph['bwd_s'])}, waiting for "
                 f"gradient sync {_ms(ph['grad_sync_wait_s'])}, optimizer {_ms(ph['optimizer_s'])}")
    lines += ["", "## Per layer (forward + backward, instrumented step)", "",
              "| # | module | decomposition | predicted | measured | error | priced by |", "|---|---|---|---|---|---|---|"]
    for p in m.per_layer:
        err = (p.predicted_s - p.measured_s) / p.measured_s if p.measured_s > 0 else None
        lines.append(f"| {p.layer} | {p.module} | {p.choice} | {_ms(p.predicted_s)} | "
                     f"{_ms(p.measured_s)} | {_pct(err)} | {p.source} |")
    if not v.passed:
        lines += ["", "## Validation failures", ""]
        for c in v.failures:
            lines.append(f"- `{c.tensor}`: max |diff| {c.max_abs_diff:.3g}, max |ref| {c.max_abs_ref:.3g}")
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_run_report(run: RunResult, out: Path) -> RunResult:
    """Plots, run.json (atomically) and report.md into ``out``; returns the run as written
    (with a note if the plots failed)."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        plots = plot_run(run, out)
    except Exception as e:  # plots are a convenience; the figures are in run.json
        plots = []
        run = dataclasses.replace(run, notes=tuple(run.notes) + (f"plots failed: {e}",))
    write_run(run, out / "run.json")
    atomic_write_text(out / "report.md", run_markdown(run, plots))
    return run


def summarize(paths: list[str | Path]) -> str:
    """A side-by-side table of runs (run.json or a folder holding one) and plans (plan.json),
    each read and checked by ``autopar.artifacts``."""
    rows = ["| artifact | model | world | placement | kind | predicted | measured | error | validation | plan/DDP |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for p in paths:
        p = Path(p)
        f = p / "run.json" if (p / "run.json").is_file() else (p / "plan.json" if (p / "plan.json").is_file() else p)
        if not f.is_file():
            raise AutoparError(f"no run.json or plan.json at {p}", "give run folders, run.json or plan.json files")
        d = read_json(f, AutoparError, "artifact")
        schema = str(d.get("schema", "")) if isinstance(d, dict) else ""
        if schema.startswith("autopar.run/"):
            r = RunResult.from_json(d, str(f))
            ratio = r.ratio_to_ddp
            rows.append(f"| {f} | {r.model} | {r.world_size} | {_placement(r.placement)} | run | "
                        f"{_ms(r.predicted.step_time_s)} | {_ms(r.measured.step_time_s)} | "
                        f"{_pct(r.prediction_error)} | {'passed' if r.validation.passed else 'FAILED'} | "
                        f"{'n/a' if ratio is None else f'{ratio:.3f}x'} |")
        elif schema.startswith("autopar.plan/"):
            pl = Plan.from_json(d, str(f))
            rows.append(f"| {f} | {pl.model.name} | {pl.world_size} | {pl.placement()} | plan | "
                        f"{_ms(pl.predicted.step_time_s)} | n/a | n/a | not run | n/a |")
        elif schema.startswith("autopar.tournament-run/"):   # tournament training (autopar.tournament)
            t = TournamentRun.from_json(d, str(f))
            m, step_s = t.measured, (t.predicted.step_s if t.predicted is not None else None)
            err = ((step_s - m.step_s) / m.step_s) if (m and m.step_s and step_s) else None
            rows.append(f"| {f} | {t.model} | {t.world_size} | {t.trainers} trainers | tournament | "
                        f"{_ms(step_s)} | {_ms(m.step_s if m else None)} | {_pct(err)} | "
                        f"{'skipped' if t.passed is None else ('passed' if t.passed else 'FAILED')} | n/a |")
        else:
            raise RunFileError(f"{f} is neither an autopar run nor a plan", "give run.json or plan.json files")
    return "\n".join(rows)


def _placement(obj) -> str:
    """"block" or "stride(s)" (``decomp.rankmap``); runs without one are block."""
    if not isinstance(obj, Mapping) or int(obj.get("local_stride", 1)) == 1:
        return "block"
    return f"stride({int(obj['local_stride'])})"
