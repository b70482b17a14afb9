"""Print the table of every shipped run (``reports/*/run.json``) that ``reports/README.md``
shows: decompositions, validation, predicted and measured step, error, plan / DDP, runtime.

    python scripts/runs_table.py [REPORTS_DIR] > reports/runs_table.md
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def row(name: str, run: dict) -> tuple[str, float | None, float | None]:
    val = run.get("validation") or {}
    checked = val.get("checked", len(val.get("checks", [])))
    v = f"{'passed' if val.get('passed') else 'FAILED'} ({checked}, {val.get('dtype', '?')})"
    pred = run["predicted"]["step_time_s"]
    meas = run["measured"]["step_time_s"]
    err = (pred - meas) / meas if meas else None
    ratio = run.get("ratio_to_ddp")
    base = run.get("baseline") or {}
    same = base.get("equivalent")
    r = (f"{ratio:.2f}x" + ("" if same else " (not the same function)")) if ratio else "(no DDP baseline)"
    decs = ", ".join(sorted({d if isinstance(d, str) else d.get("choice", str(d))
                             for d in (run.get("decompositions") or [])}))
    runtime = "native" if run.get("native_runtime") else "traced"
    # the machine's speed probe at execute time over the one the profile's kernels are stated at
    # (calibrate.speed; < 1: the machine ran faster than when it was calibrated)
    probe = (run.get("speed_probe") or {}).get("slowdown_vs_pricing")
    ps = f"{probe:.2f}" if probe else "-"
    return (f"| `{name}` | {decs} | {v} | {pred * 1e3:.1f} ms | {meas * 1e3:.1f} ms | "
            f"{100 * err:+.1f} % | {ps} | {r} | {runtime} |"), err, probe


def main(argv=None) -> int:
    root = Path((argv or sys.argv[1:] or ["reports"])[0])
    lines = ["| run | decompositions chosen | validation | predicted | measured | error | "
             "machine speed probe / calibration | plan / DDP (same function) | runtime |",
             "|---|---|---|---|---|---|---|---|---|"]
    errs, probes = [], []
    for p in sorted(root.glob("*/run.json")):
        text, err, probe = row(p.parent.name, json.loads(p.read_text()))
        lines.append(text)
        if err is not None:
            errs.append(abs(err))
        if probe:
            probes.append(probe)
    if errs:
        lines.append("")
        lines.append(f"median |prediction error| over these {len(errs)} runs: "
                     f"{100 * statistics.median(errs):.1f} %")
    if probes:
        lines.append(f"median speed probe at execute over the profile's nominal: {statistics.median(probes):.2f} "
                     "(local compute runs that much faster or slower than the profile prices it; "
                     "the predictions above are not scaled)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
