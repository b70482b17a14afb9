"""Does what the calling process did before a calibration change what the calibration reads?

The in-step costs of 2 ranks (``calibrate.insitu.measure_in_situ``: the blocking all-reduce's
latency in situ, the straggler kappa and sigma, the share of a gradient all-reduce compute does
not hide) measured from a fresh process (``fresh``), against the same from a process that first
ran a small training step (``after_step``: two 3x3 convolutions with batch norm, SGD, as
``bench_prediction.machine_reference_ms``), as the prediction benchmark's in-process
calibration did before it ran the calibration command instead (``bench_prediction.calibrate_cli``).
One process per reading, the two kinds alternating over ``--rounds`` rounds so that both meet the
same machine load. Prints every reading and the median of each kind.

    python benchmarks/bench_calibration_caller.py [--rounds 4] [--iters 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
if sys.argv[1] == "after_step":
    from bench_prediction import machine_reference_ms
    machine_reference_ms()
from autopar.calibrate.insitu import measure_in_situ
if __name__ == "__main__":
    st, lat, _, phi = measure_in_situ([2], iters=int(sys.argv[2]))
    print(json.dumps({"latency_ms": 1e3 * lat["2"]["2"], "sigma": st["2"].sigma, "kappa": st["2"].kappa,
                      "interference": phi["2"]}))
"""

KEYS = (("latency_ms", "in-situ all-reduce latency", "ms", 2), ("sigma", "straggler sigma", "s^0.5", 4),
        ("kappa", "straggler kappa", "", 3), ("interference", "comm interference", "", 2))


def reading(kind: str, iters: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, kind, str(iters), str(ROOT / "benchmarks")],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20, help="in-situ repeats (the quick calibration's 20)")
    ap.add_argument("--out", help="also write the printout here")
    args = ap.parse_args(argv)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"# python benchmarks/bench_calibration_caller.py --rounds {args.rounds} --iters {args.iters}; "
        f"load average at the start {os.getloadavg()[0]:.2f}")
    got: dict[str, list[dict]] = {"fresh": [], "after_step": []}
    for k in range(args.rounds):
        for kind in (("fresh", "after_step") if k % 2 == 0 else ("after_step", "fresh")):
            r = reading(kind, args.iters)
            got[kind].append(r)
            say(f"round {k} {kind:<10} " + ", ".join(f"{name} {r[key]:.{nd}f}{(' ' + unit) if unit else ''}"
                                                     for key, name, unit, nd in KEYS))
    for kind, rs in got.items():
        say(f"median {kind:<10} " + ", ".join(
            f"{name} {statistics.median(r[key] for r in rs):.{nd}f}{(' ' + unit) if unit else ''} "
            f"(range {min(r[key] for r in rs):.{nd}f}-{max(r[key] for r in rs):.{nd}f})" for key, name, unit, nd in KEYS))
    if args.out:
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
