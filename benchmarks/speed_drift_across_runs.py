"""How much of the prediction benchmark's miss is the machine's speed drifting between the
calibration and the runs? Read from the committed runs, nothing measured here.

Each run of ``bench_prediction.py`` (``reports/benchmarks/prediction_in_sample_and_held_out_<n>_run.json``)
records, per set (in-sample, held-out): the median signed prediction error at each world size,
the calibration's speed probe read after each plan's timing against the profile's nominal
reading (``speed_probe_vs_profile``, > 1: the machine ran slower than when the kernels were
measured), and the machine reference step right after the calibration and before each round.

Printed:

1. per run and set: the probe ratio, the reference step ratio and the set's signed error
   (the mean of its per-world medians);
2. the correlation of the signed error with the probe ratio over all runs and sets, and the
   least-squares line;
3. the median |signed error| as predicted, and with the prediction stated at the speed the
   probe read during the runs (``(1 + e) * probe - 1``: a diagnostic, since no prediction made
   before a run can know it);
4. a speed history (the lead "state prices at the machine's typical speed"): each run's
   calibration rescaled to the median reference step after the calibrations of the runs
   before it (at least three), ``(1 + e) * typical / after_calibration - 1``; if the machine's
   typical speed predicted a run's speed better than its own calibration did, this would
   lower the miss;
5. world 4's median signed error minus world 2's, per run and set;
6. for runs that kept their plans (``plans_in_sample`` / ``plans_held_out``, from the
   twenty-ninth on): the per-plan median |error| as predicted and at the profile's speed
   (``bench_prediction.at_profile_speed``).

    python benchmarks/speed_drift_across_runs.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
RUNS = ROOT / "reports/benchmarks"
PATTERN = re.compile(r"prediction_in_sample_and_held_out_(?P<n>[a-z-]+)_run\.json$")

_UNITS = {"first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7,
          "eighth": 8, "ninth": 9, "tenth": 10, "eleventh": 11, "twelfth": 12, "thirteenth": 13,
          "fourteenth": 14, "fifteenth": 15, "sixteenth": 16, "seventeenth": 17, "eighteenth": 18,
          "nineteenth": 19, "twentieth": 20, "thirtieth": 30, "fortieth": 40}
_TENS = {"twenty": 20, "thirty": 30, "forty": 40}


def ordinal(word: str) -> int | None:
    """'twenty-eighth' -> 28, 'third' -> 3; None for anything else."""
    if word in _UNITS:
        return _UNITS[word]
    head, _, tail = word.partition("-")
    if head in _TENS and tail in _UNITS and _UNITS[tail] < 10:
        return _TENS[head] + _UNITS[tail]
    return None


def load_runs(folder: Path = RUNS) -> list[tuple[int, str, dict]]:
    """(ordinal, name, json) of every numbered run, in the order they were made."""
    runs = []
    for f in folder.glob("prediction_in_sample_and_held_out_*_run.json"):
        m = PATTERN.search(f.name)
        n = ordinal(m.group("n")) if m else None
        if n is not None:
            runs.append((n, m.group("n"), json.loads(f.read_text())))
    return sorted(runs, key=lambda r: r[0])


def set_signed(s: dict) -> float:
    """A set's signed error: the mean of its per-world median signed errors."""
    return statistics.fmean(v["median_signed_error"] for v in s["by_world"].values())


def analyse(runs: list[tuple[int, str, dict]], history_min: int = 3) -> tuple[list[str], dict]:
    from bench_prediction import at_profile_speed
    lines, pts, hist_pts, plan_pts = [], [], [], []
    history: list[float] = []
    lines.append(f"{'run':>4} {'set':<10} {'probe':>6} {'ref':>6} {'signed':>8} {'at probe':>9} {'history':>8}")
    for n, name, d in runs:
        after_cal = (d.get("machine_reference_ms") or {}).get("after calibration")
        typical = statistics.median(history) if len(history) >= history_min else None
        for key in ("in_sample", "held_out"):
            s = d.get(key) or {}
            if "by_world" not in s or "speed_probe_vs_profile" not in s:
                continue
            e, p = set_signed(s), s["speed_probe_vs_profile"]
            hist = (1 + e) * typical / after_cal - 1 if typical and after_cal else None
            pts.append((p, e))
            if hist is not None:
                hist_pts.append((e, hist))
            lines.append(f"{n:>4} {key:<10} {p:6.3f} {s.get('machine_vs_profile') or float('nan'):6.3f} "
                         f"{100 * e:+7.1f}% {100 * ((1 + e) * p - 1):+8.1f}% "
                         + (f"{100 * hist:+7.1f}%" if hist is not None else f"{'-':>8}"))
            for r in d.get(f"plans_{key}") or ():
                if r.get("same_as") is None and r.get("measured_s"):
                    m = at_profile_speed(r)
                    if m:
                        plan_pts.append((n, key, (r["predicted_s"] - r["measured_s"]) / r["measured_s"],
                                         (r["predicted_s"] - m) / m))
        if after_cal:
            history.append(after_cal)
    out: dict = {"sets": len(pts)}
    if len(pts) > 2:
        ps, es = [p for p, _ in pts], [e for _, e in pts]
        slope, intercept = statistics.linear_regression([p - 1 for p in ps], es)
        out.update(correlation=statistics.correlation(ps, es), slope=slope, intercept=intercept,
                   median_abs_signed=statistics.median(abs(e) for e in es),
                   median_abs_signed_at_probe=statistics.median(abs((1 + e) * p - 1) for p, e in pts))
        lines += ["", f"{len(pts)} sets (in-sample and held-out of {len(runs)} runs): correlation of the signed "
                  f"error with the probe ratio {out['correlation']:+.2f}; least squares: signed = "
                  f"{out['intercept']:+.3f} {out['slope']:+.3f} x (probe - 1)",
                  f"median |signed error| of a set: {100 * out['median_abs_signed']:.1f}% as predicted, "
                  f"{100 * out['median_abs_signed_at_probe']:.1f}% with the prediction stated at the speed the "
                  "probe read during the runs (a diagnostic: no prediction made before a run knows it)"]
    if hist_pts:
        out["history_sets"] = len(hist_pts)
        out["median_abs_signed_same_sets"] = statistics.median(abs(e) for e, _ in hist_pts)
        out["median_abs_signed_history"] = statistics.median(abs(h) for _, h in hist_pts)
        lines.append(f"speed history (each calibration rescaled to the median reference step after the "
                     f"calibrations of the runs before it, >= {history_min}): median |signed error| "
                     f"{100 * out['median_abs_signed_history']:.1f}% against "
                     f"{100 * out['median_abs_signed_same_sets']:.1f}% as predicted on the same "
                     f"{len(hist_pts)} sets")
    gaps = [(key, s["by_world"]["4"]["median_signed_error"] - s["by_world"]["2"]["median_signed_error"])
            for _, _, d in runs for key in ("in_sample", "held_out")
            for s in [d.get(key) or {}] if {"2", "4"} <= set(s.get("by_world") or {})]
    for key in ("in_sample", "held_out"):
        g = [x for k, x in gaps if k == key]
        if g:
            out[f"world_gap_{key}"] = statistics.median(g)
            lines.append(f"{key}: world 4's median signed error minus world 2's, per run: median "
                         f"{100 * statistics.median(g):+.1f} points, positive in {sum(x > 0 for x in g)} of {len(g)} "
                         "runs (a bias between the world sizes that no speed correction removes)")
    if plan_pts:
        out["plans"] = len(plan_pts)
        out["plan_median_abs"] = statistics.median(abs(a) for *_, a, _ in plan_pts)
        out["plan_median_abs_at_profile_speed"] = statistics.median(abs(b) for *_, b in plan_pts)
        for key in ("in_sample", "held_out"):
            k = [(a, b) for _, s, a, b in plan_pts if s == key]
            if k:
                lines.append(f"{key}: {len(k)} plans of runs that kept them: per-plan median |error| "
                             f"{100 * statistics.median(abs(a) for a, _ in k):.1f}% as measured, "
                             f"{100 * statistics.median(abs(b) for _, b in k):.1f}% with each round at the "
                             "profile's speed")
    return lines, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", help="also write the printout here")
    args = ap.parse_args(argv)
    runs = load_runs()
    lines, _ = analyse(runs)
    head = (f"# python benchmarks/speed_drift_across_runs.py: the committed prediction runs "
            f"{', '.join(str(n) for n, _, _ in runs)} (a set counts when it recorded the probe ratio and "
            "per-world signed errors); probe = the calibration's speed probe after each plan's timing / the "
            "profile's nominal reading (median), ref = the machine reference step before the rounds / after "
            "the calibration, signed = the set's mean per-world median signed error, at probe = "
            "(1 + signed) x probe - 1, history = (1 + signed) x typical / after-calibration reference - 1")
    text = "\n".join([head, *lines]) + "\n"
    print(text, end="")
    if args.out:
        sys.path.insert(0, str(ROOT))
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
