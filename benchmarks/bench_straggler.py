"""Benchmark: how long a synchronisation waits for the slowest rank, against the compute since
the previous one, and how the cost model's straggler wait fits it.

w ranks run rounds of L convolutions (forward and backward), each round closed by a one-float
all-reduce (``calibrate.insitu._straggle_rank``); the wait of a round is its slowest rank's
compute minus the ranks' mean (``calibrate.insitu.straggler_point``), median over the rounds.
For each w the lengths the calibration measures are fitted as the calibration fits them
(``fit_straggler``: ``min(kappa t, sigma sqrt t)``) and every length is printed with the wait
that fit predicts and with what the linear factor of earlier profiles (``kappa t``, the same
kappa) charged.

    python benchmarks/bench_straggler.py [--worlds 2 4] [--lengths 2 8 32 128] [--iters 200]
        [--out FILE]

Figures are measured: the machine load is printed at start and end.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from autopar.calibrate.insitu import STRAGGLER_LENGTHS, _straggle_rank, fit_straggler, straggler_point
    from autopar.io import atomic_write_text
    from autopar.runtime.launch import run_ranks
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--lengths", type=int, nargs="+", default=sorted(set(STRAGGLER_LENGTHS) | {128}))
    ap.add_argument("--iters", type=int, default=200, help="rounds = max(12, 3 iters / L)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    lines = [f"machine load at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) on "
             f"{os.cpu_count()} cores",
             f"rounds of L convolutions closed by a one-float all-reduce; wait = slowest rank's compute - mean, "
             f"median over max(12, 3 x {a.iters} / L) rounds; fit on the calibration's lengths {list(STRAGGLER_LENGTHS)}"]
    print("\n".join(lines), flush=True)
    for w in a.worlds:
        per_rank = run_ranks(_straggle_rank, w, args=(a.iters, tuple(a.lengths)), timeout_s=1200)
        pts = {L: straggler_point([r[L] for r in per_rank], "median") for L in a.lengths}
        st = fit_straggler([pts[L] for L in STRAGGLER_LENGTHS if L in pts])
        lines.append(f"== {w} ranks: fitted kappa {st.kappa:.3f}, sigma {st.sigma:.4f} s^0.5")
        for L in a.lengths:
            t, d = pts[L]
            lines.append(f"   L {L:4d}: compute {t * 1e3:8.1f} ms  wait {d * 1e3:7.2f} ms ({d / t:5.2f} of it)  "
                         f"fit {st.wait_s(t) * 1e3:7.2f} ms  linear factor {st.kappa * t * 1e3:7.2f} ms")
        print("\n".join(lines[-1 - len(a.lengths):]), flush=True)
    lines.append(f"machine load at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(lines[-1])
    if a.out:
        atomic_write_text(Path(a.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
