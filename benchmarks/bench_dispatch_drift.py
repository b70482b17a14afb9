"""Does a small-op training step drift with the calibration's speed probe, or with dispatch?

``calibrate.speed``'s probe (a convolution, a matmul, a ReLU and a batch norm: kernels) states
every kernel time at one machine speed, and ``calibrate.history`` prices plans at the
machine's usual probe reading. A step made of many tiny ops (the GPT and the GNNs of the
prediction benchmark: dispatch and autograd bookkeeping, not arithmetic) may drift with
something else. Here one process reads, round after round for ``--seconds``, the probe and
four workloads in windows of ``--window`` seconds each: a dispatch chain (100 scalar-sized
multiplies, forward and backward), and the GPT's, the padded GNN's and the 2-D ResNet's local
training steps at the local batch of their world-2 plans. Printed: each one's median, spread
(coefficient of variation) and range over the rounds, the correlations of their log times
across rounds, and the ratio of the second half's median to the first's.

    python benchmarks/bench_dispatch_drift.py [--seconds 180] [--window 0.2] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

EX = ROOT / "strategies" / "examples"
#: (label, model file, local batch)
STEPS = [("gpt step", EX / "gpt.py", 4), ("gnn_pcqm4m step", EX / "gnn_pcqm4m.py", 4),
         ("resnet2d step", EX / "resnet2d.py", 8)]


def _window_s(fn, seconds: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() < t0 + seconds or n < 2:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--window", type=float, default=0.2)
    ap.add_argument("--out", help="also write the printout here")
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    from autopar.calibrate.speed import probe_reading_s
    from bench_step_parts import _step_fn
    torch.set_num_threads(1)
    x = torch.randn(64, requires_grad=True)

    def chain():
        y = x
        for _ in range(100):
            y = y * 1.0001
        y.sum().backward()

    work = {"speed probe": lambda: probe_reading_s("cpu"), "dispatch chain": None}
    work.update({label: _step_fn(str(path), batch)[0] for label, path, batch in STEPS})
    names = list(work)
    rows = []
    t_end = time.time() + args.seconds
    while time.time() < t_end:
        row = []
        for name in names:
            if name == "speed probe":
                row.append(work[name]())
            else:
                row.append(_window_s(chain if name == "dispatch chain" else work[name], args.window))
        rows.append(row)
    a = np.array(rows)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"{len(a)} rounds over {args.seconds:.0f} s, one process, windows of {args.window:.2f} s")
    for i, name in enumerate(names):
        c = a[:, i]
        say(f"  {name:<16} median {1e3 * np.median(c):7.3f} ms  cv {c.std() / c.mean():.3f}  "
            f"range {1e3 * c.min():.3f}-{1e3 * c.max():.3f} ms")
    cor = np.corrcoef(np.log(a).T)
    say("correlation of log times across rounds:")
    say("  " + " " * 16 + "".join(f"{n[:14]:>16}" for n in names))
    for i, name in enumerate(names):
        say(f"  {name:<16}" + "".join(f"{cor[i, j]:>16.2f}" for j in range(len(names))))
    h = len(a) // 2
    say("second half's median / first half's: " + ", ".join(
        f"{n} {np.median(a[h:, i]) / np.median(a[:h, i]):.3f}" for i, n in enumerate(names)))
    if args.out:
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
