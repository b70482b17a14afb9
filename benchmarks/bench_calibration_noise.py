"""How noisy are two of calibration's measurements on this machine, and what do more rounds buy?

1. The machine-speed probe (``calibrate.speed``): ``--readings`` readings back to back (each the
   median of ``speed.PROBE_REPEATS`` runs of the probe, about 25 ms apart). Printed: their mean,
   spread and coefficient of variation, and the correlation of readings 1, 5 and 20 apart: how
   long a phase of the machine's speed lasts, so how far from a measurement a reading still
   says something about it.
2. The compute slowdown of k ranks (``calibrate.run._slowdown_rank`` at world 4, estimated by
   ``slowdown_factors``): ``--repeats`` launches each of the quick (0.6 s per count) and full
   (2.0 s) windows split into 3 rounds (the old default) and into the rounds calibration now
   uses (8 quick, 12 full). Printed: the factors for 2 and 4 ranks of every repeat, their range
   and coefficient of variation.

    python benchmarks/bench_calibration_noise.py [--readings 120] [--repeats 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def _corr(xs, lag: int) -> float:
    a, b = xs[:-lag], xs[lag:]
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else float("nan")


def probe_noise(n: int, say) -> None:
    import torch
    from autopar.calibrate.kernels import slowdown_kernel_set
    from autopar.calibrate.speed import PROBE_REPEATS, probe_reading_s
    torch.set_num_threads(1)
    fn = slowdown_kernel_set()
    t0 = time.perf_counter()
    r = [probe_reading_s(probe=fn) for _ in range(n)]
    dt = (time.perf_counter() - t0) / n
    say(f"speed probe: {n} readings back to back, {1e3 * dt:.0f} ms apart (median of {PROBE_REPEATS} runs "
        f"each): mean {1e3 * statistics.fmean(r):.2f} ms, {1e3 * min(r):.2f}-{1e3 * max(r):.2f} ms, "
        f"coefficient of variation {100 * statistics.pstdev(r) / statistics.fmean(r):.1f} %; correlation of "
        f"readings 1 / 5 / 20 apart: {_corr(r, 1):.2f} / {_corr(r, 5):.2f} / {_corr(r, 20):.2f}")


def slowdown_noise(repeats: int, say) -> None:
    import torch  # noqa: F401  (before forking)
    from autopar.calibrate.run import FULL, QUICK, _slowdown_rank, slowdown_factors
    from autopar.runtime.launch import run_ranks
    configs = [("quick", QUICK.slowdown_window_s, 3), ("quick", QUICK.slowdown_window_s, QUICK.slowdown_rounds),
               ("full", FULL.slowdown_window_s, 3), ("full", FULL.slowdown_window_s, FULL.slowdown_rounds)]
    res: dict[tuple, list] = {c: [] for c in configs}
    for _ in range(repeats):
        for c in configs:            # interleaved, so that a slow minute falls on every config
            _, total, rounds = c
            w = total / rounds
            s, _, _ = slowdown_factors(run_ranks(_slowdown_rank, 4, args=(w, "cpu", rounds)), 4, rounds, w)
            res[c].append((s["2"], s["4"]))
    for (mode, total, rounds), v in res.items():
        parts = []
        for i, k in ((0, 2), (1, 4)):
            xs = [x[i] for x in v]
            parts.append(f"{k} ranks {min(xs):.2f}-{max(xs):.2f} (CV {100 * statistics.pstdev(xs) / statistics.fmean(xs):.1f} %: "
                         + " ".join(f"{x:.2f}" for x in xs) + ")")
        say(f"compute slowdown, {mode} window {total:.1f} s in {rounds:2d} rounds, {repeats} repeats: " + "; ".join(parts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--readings", type=int, default=120)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"# python benchmarks/bench_calibration_noise.py, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    probe_noise(args.readings, say)
    slowdown_noise(args.repeats, say)
    if args.out:
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
