"""The prediction benchmark's kept runs priced again with this machine's speed history as it
stood when each run planned (``autopar.calibrate.history``), against the same runs priced with
the history off (each profile's kernels at the speed they were measured at).

Replay: the history of a run is every speed-probe reading taken before it planned, on the
machine the runs were made on: the calibration nominal of each kept run (``fresh-quick.json``,
at its ``provenance.date``) and the probe each execution read after its timed steps (the
``speed_probe.execute_s`` of every ``round*/run.json``, at its ``created`` time). Only readings
older than the run's first plan count, so no reading of the steps being predicted enters their
prediction. Their times are shifted so that the run's planning moment is now, and the history's
own window (``WINDOW_HOURS``) applies as it would have. Each run's kept plans are then priced by
its own fresh profile (``cross_reprice.errors``: native plans as the planner prices them), once
with the history and once without. Nothing is executed.

The folders must come from one machine instance (one boot of one VM: the history is kept per
instance); pass them in the order they were made.

``--usual-weight W`` prices with that weight of the usual reading against the profile's own
(``calibrate.history.USUAL_WEIGHT``, 0.5; 1 prices at the usual reading itself).
``--no-reducer`` prices every run without the gradient reducer (as before it was measured);
``--reducer-from PROFILE`` is a what-if for runs whose profiles predate the measurement of torch
DDP's reducer (``calibrate.overhead.measure_grad_reducer``): PROFILE's ``samples.grad_reducer``
is put into a temporary copy of every run's profile (a profile that measured its own keeps it),
so every plan that syncs gradients is charged it (``cost.table.price_grad_reducer``).
``--optimizer-from PROFILE`` puts PROFILE's optimizer fit (``kernels.optimizer_step``: timed cold
with a fixed share since 2026-12-03, ``calibrate.optimizer``) into every run's profile;
``--hot-optimizer`` refits every run's own optimizer rows to their hot medians without a fixed
share, as the fit was stored before (only profiles whose rows kept ``hot_median_s``), so the
same measured steps compare the two fits.

    python benchmarks/reprice_with_speed_history.py DIR [DIR ...] [--out FILE] [--usual-weight W]
        [--reducer-from PROFILE | --no-reducer] [--optimizer-from PROFILE | --hot-optimizer]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _when(s: str) -> dt.datetime:
    t = dt.datetime.fromisoformat(s)
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def readings(d: Path) -> list[tuple[dt.datetime, float, str]]:
    """(time, probe seconds, source) of every reading one kept run took."""
    prof = json.loads((d / "fresh-quick.json").read_text())
    out = []
    nominal = ((prof.get("samples") or {}).get("speed_probe") or {}).get("nominal_s")
    if nominal:
        out.append((_when(prof["provenance"]["date"]), float(nominal), "calibrate"))
    for r in sorted(d.glob("*-run*/round*/run.json")):
        run = json.loads(r.read_text())
        sp = run.get("speed_probe") or {}
        if sp.get("execute_s"):
            out.append((_when(run["created"]), float(sp["execute_s"]), "execute"))
    return out


def planned_at(d: Path) -> dt.datetime:
    """When the run planned: its earliest kept plan."""
    return min(_when(json.loads(p.read_text())["created"]) for p in d.glob("*-plan*/plan.json")
               if "-reprice-" not in p.parent.name)


def history_file(events: list[tuple[dt.datetime, float, str]], at: dt.datetime, path: Path) -> int:
    """Write the readings older than ``at`` as this machine's history, shifted so ``at`` is now."""
    from autopar.calibrate.history import SCHEMA, event
    shift = dt.datetime.now(dt.timezone.utc) - at
    kept = [event(p, src, when=t + shift) for t, p, src in events if t < at]
    path.write_text(json.dumps({"schema": SCHEMA, "events": kept}))
    return len(kept)


def hot_optimizer_fit(fit: dict) -> dict:
    """``fit`` (a cold ``kernels.optimizer_step``) refitted to its rows' hot medians without a
    fixed share: what ``calibrate.optimizer`` stored before it timed the step cold."""
    from bench_optimizer_in_situ import _hot_fit
    rows = fit.get("samples") or []
    if not rows or any("hot_median_s" not in r for r in rows):
        raise SystemExit("--hot-optimizer: a profile's optimizer rows kept no hot medians (made before 2026-12-03)")
    t0, sb = _hot_fit(rows)
    return {k: v for k, v in fit.items() if k not in ("fixed_s", "cache")} | {"t0_s": t0, "s_per_byte": sb}


def with_edits(profile: Path, reducer: dict | None, optimizer, out: Path) -> Path:
    """``profile`` as it is (no edit), or a copy at ``out``: without its gradient reducer
    (``reducer`` empty, ``--no-reducer``), or holding ``reducer`` when it measured none
    (``--reducer-from``); with ``optimizer`` as its optimizer fit (a dict, ``--optimizer-from``)
    or its own refitted hot (``"hot"``, ``--hot-optimizer``)."""
    if reducer is None and optimizer is None:
        return profile
    p = json.loads(profile.read_text())
    samples = p.setdefault("samples", {})
    if reducer is not None and not reducer:
        samples.pop("grad_reducer", None)
    elif reducer and not samples.get("grad_reducer"):
        samples["grad_reducer"] = reducer
    if optimizer == "hot":
        p["kernels"]["optimizer_step"] = hot_optimizer_fit(p["kernels"]["optimizer_step"])
    elif optimizer is not None:
        p["kernels"]["optimizer_step"] = optimizer
    out.write_text(json.dumps(p))
    return out


def main(argv=None) -> int:
    from cross_reprice import errors, kept_plans

    from autopar.calibrate.history import HISTORY_ENV, usual_speed
    from autopar.calibrate.profile import load_profile
    from autopar.io import atomic_write_text
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", help="--keep folders of bench_prediction.py runs, oldest first")
    ap.add_argument("--out", help="write the table here too (and the figures as .json beside it)")
    ap.add_argument("--reducer-from", metavar="PROFILE",
                    help="what-if: price every run's plans with PROFILE's measured gradient reducer where "
                         "the run's own profile has none")
    ap.add_argument("--usual-weight", type=float, metavar="W",
                    help="what-if: the weight of the usual reading against the profile's own "
                         "(calibrate.history.USUAL_WEIGHT; 1 prices at the usual reading)")
    ap.add_argument("--no-reducer", action="store_true",
                    help="what-if: price every run's plans without the gradient reducer, even where its profile "
                         "measured one (as the code before 2026-12-02 priced them)")
    ap.add_argument("--optimizer-from", metavar="PROFILE",
                    help="what-if: price every run's plans with PROFILE's optimizer fit (kernels.optimizer_step)")
    ap.add_argument("--hot-optimizer", action="store_true",
                    help="what-if: every run's optimizer rows refitted hot without a fixed share (the fit before 2026-12-03)")
    args = ap.parse_args(argv)
    dirs = [Path(d) for d in args.dirs]
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    if args.usual_weight is not None:
        import autopar.calibrate.history as history
        history.USUAL_WEIGHT = args.usual_weight
        say(f"what-if: the usual reading weighted {args.usual_weight:g} against the profile's own")
    reducer = None
    if args.no_reducer and args.reducer_from:
        raise SystemExit("--no-reducer and --reducer-from exclude each other")
    if args.no_reducer:
        reducer = {}
        say("what-if: every profile priced without a gradient reducer (samples.grad_reducer removed)")
    elif args.reducer_from:
        reducer = (json.loads(Path(args.reducer_from).read_text()).get("samples") or {}).get("grad_reducer")
        if not reducer:
            raise SystemExit(f"{args.reducer_from} measured no DDP reducer (samples.grad_reducer)")
        say(f"what-if: profiles without a measured DDP reducer priced with {args.reducer_from}'s: "
            f"{reducer['fixed_s'] * 1e6:.0f} us a step + {reducer['per_tensor_s'] * 1e6:.2f} us per tensor + "
            f"{reducer['per_byte_s'] * 1e12:.0f} us per MB")

    optimizer = None
    if args.optimizer_from and args.hot_optimizer:
        raise SystemExit("--optimizer-from and --hot-optimizer exclude each other")
    if args.hot_optimizer:
        optimizer = "hot"
        say("what-if: every profile's optimizer rows refitted to their hot medians without a fixed share")
    elif args.optimizer_from:
        optimizer = json.loads(Path(args.optimizer_from).read_text())["kernels"]["optimizer_step"]
        say(f"what-if: every profile priced with {args.optimizer_from}'s optimizer fit: "
            f"{optimizer.get('fixed_s', 0.0) * 1e6:.0f} us a step + {optimizer['t0_s'] * 1e6:.1f} us per tensor + "
            f"{optimizer['s_per_byte'] * 1e12:.0f} ps per byte ({optimizer.get('cache', 'timed hot')})")

    every = sorted((e for d in dirs for e in readings(d)), key=lambda e: e[0])
    say(f"{len(every)} speed-probe readings in {len(dirs)} kept runs "
        f"({min(p for _, p, _ in every) * 1e3:.2f}-{max(p for _, p, _ in every) * 1e3:.2f} ms)")
    say("run          readings  usual    nominal  factor | in-sample off / history   | held-out off / history")
    rows = []
    env0 = os.environ.get(HISTORY_ENV)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for d in dirs:
                at = planned_at(d)
                hist = Path(tmp) / f"{d.name}.json"
                n = history_file(every, at, hist)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    prof = load_profile(d / "fresh-quick.json", check_machine=False)
                ms, why = usual_speed(prof, hist)
                plans = kept_plans(d)
                priced_by = with_edits(d / "fresh-quick.json", reducer, optimizer, Path(tmp) / f"{d.name}-profile.json")
                res = {}
                for mode, env in (("off", "off"), ("history", str(hist))):
                    os.environ[HISTORY_ENV] = env
                    e = errors(plans, priced_by)
                    res[mode] = {k: {"median_abs_error": statistics.median(abs(x) for x in v),
                                     "median_signed_error": statistics.median(v), "plans": len(v)}
                                 for k, v in e.items() if v}
                row = {"run": d.name, "planned_at": at.isoformat(), "readings_before": n,
                       "machine_speed": ms.to_json() if ms else {"not_applied": why}, **res}
                rows.append(row)

                def cell(s):
                    return (f"{100 * res['off'][s]['median_abs_error']:5.1f} % / "
                            f"{100 * res['history'][s]['median_abs_error']:5.1f} %"
                            f" ({100 * res['history'][s]['median_signed_error']:+.1f})")
                say(f"{d.name:12s} {n:8d}  " + (f"{ms.usual_probe_s * 1e3:5.2f} ms {ms.profile_nominal_s * 1e3:5.2f} ms "
                                               f"x{ms.factor:.3f}" if ms else f"{'(none: ' + why[:30] + ')':>32s}")
                    + f" | {cell('in-sample')} | {cell('held-out')}")
    finally:
        if env0 is None:
            os.environ.pop(HISTORY_ENV, None)
        else:
            os.environ[HISTORY_ENV] = env0
    used = [r for r in rows if "usual_probe_s" in r["machine_speed"]]
    for s in ("in-sample", "held-out"):
        off = statistics.median(r["off"][s]["median_abs_error"] for r in used) if used else None
        on = statistics.median(r["history"][s]["median_abs_error"] for r in used) if used else None
        if used:
            say(f"{s}: over the {len(used)} runs priced with a history, the median of the runs' median |error| "
                f"{100 * off:.1f} % with the history off, {100 * on:.1f} % with it; better in "
                f"{sum(r['history'][s]['median_abs_error'] < r['off'][s]['median_abs_error'] for r in used)}, "
                f"worse in {sum(r['history'][s]['median_abs_error'] > r['off'][s]['median_abs_error'] for r in used)}")
    if args.out:
        atomic_write_text(args.out, "\n".join(lines) + "\n")
        atomic_write_text(str(Path(args.out).with_suffix(".json")), json.dumps({"runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
