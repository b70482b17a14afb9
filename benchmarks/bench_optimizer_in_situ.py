"""The optimizer step as a training loop meets it, against the fits the profile can store.

``calibrate.optimizer`` times ``SGD(momentum=0.9).step()`` on sets of tensors. Timed hot (the
same step repeated, as it was fitted before 2026-12-03) it leaves out what a training loop pays:
the update runs right after backward, with the parameters, their momentum buffers and the
interpreter's own working set pushed out of the caches. This measures, for each benchmark
model at the local batch of its world-2 data-parallel plan, the update:

* **in-loop**: ``optimizer.step()`` of the model's own training step (forward, loss, backward,
  step), the median over steps; once on one process and once on each of two processes running
  their loops at the same time (ranks share the last-level cache; the slower rank's median);
* **hot**: the same update repeated at once;
* **cold**: the same update after writing twice the last-level cache;

and prices each model's update with a fresh ``measure_optimizer_step`` (one process), fitted
two ways: its hot medians without a fixed share (the old fit: ``n t0 + bytes s``) and its cold
medians with one (the stored fit now: ``fixed + n t0 + bytes s``). Nothing here is a prediction
of a whole step; it says which fit the update of a real step follows.

    python benchmarks/bench_optimizer_in_situ.py [--steps 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

EX = ROOT / "strategies" / "examples"
MODELS = ROOT / "benchmarks" / "models"
#: (label, model file, local batch): the prediction benchmark's models at the local batch of
#: their world-2 data-parallel plans
WORKLOADS = [("gpt", EX / "gpt.py", 4), ("hf_gpt2", EX / "hf_gpt2.py", 4),
             ("gnn_pcqm4m", EX / "gnn_pcqm4m.py", 4), ("resnet2d", EX / "resnet2d.py", 8),
             ("heldout_vgg", MODELS / "heldout_vgg.py", 8),
             ("heldout_bottleneck", MODELS / "heldout_bottleneck.py", 8),
             ("cnn3d_large", EX / "cnn3d_large.py", 2), ("heldout_cnn3d", MODELS / "heldout_cnn3d.py", 2),
             ("wide_resnet", EX / "wide_resnet.py", 8)]


def _updates(path: str, batch: int, steps: int, probes: bool) -> dict:
    """{"in_loop": [s], "hot": [s], "cold": [s], "tensors": n, "bytes": b} of one model's update."""
    import torch

    from autopar.calibrate.optimizer import cold_flush_bytes
    from autopar.modelfile import load_model_file
    from autopar.runtime.entry import synthetic_batch
    mf = load_model_file(path)
    torch.manual_seed(0)
    model = mf.build_model()
    xs, ys = synthetic_batch(mf, batch, 1)
    loss_fn = mf.loss_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    flush = torch.empty(cold_flush_bytes() // 4) if probes else None
    out: dict = {"in_loop": [], "hot": [], "cold": []}
    for i in range(steps + 2):
        opt.zero_grad(set_to_none=True)
        o = model(*xs)
        (loss_fn(o, ys) if ys is not None else loss_fn(o)).backward()
        t = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t
        if i < 2:
            continue            # momentum buffers made, first-touch costs paid
        out["in_loop"].append(dt)
        if probes:
            t = time.perf_counter()
            opt.step()
            out["hot"].append(time.perf_counter() - t)
            flush.fill_(1.0)
            t = time.perf_counter()
            opt.step()
            out["cold"].append(time.perf_counter() - t)
    params = [p for p in model.parameters() if p.requires_grad]
    out["tensors"] = len(params)
    out["bytes"] = sum(p.numel() * p.element_size() for p in params)
    return out


def _two_ranks(rank, world, steps):
    import torch
    torch.set_num_threads(1)
    return {label: statistics.median(_updates(str(path), batch, steps, probes=False)["in_loop"])
            for label, path, batch in WORKLOADS}


def _hot_fit(rows) -> tuple[float, float]:
    """(t0, s_per_byte) of the hot medians without a fixed share: the fit stored before."""
    import numpy as np
    a = np.array([[r["tensors"], r["bytes"]] for r in rows], float)
    y = np.array([r["hot_median_s"] for r in rows])
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    return max(0.0, float(coef[0])), max(0.0, float(coef[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", help="also write the printout here")
    args = ap.parse_args(argv)
    import torch

    from autopar.calibrate.optimizer import measure_optimizer_step
    from autopar.runtime.launch import run_ranks
    torch.set_num_threads(1)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    fit = measure_optimizer_step()
    t0_hot, sb_hot = _hot_fit(fit["samples"])
    say(f"fresh optimizer fit (one process): cold {fit['fixed_s'] * 1e6:.0f} us a step + {fit['t0_s'] * 1e6:.1f} us "
        f"per tensor + {fit['s_per_byte'] * 1e12:.0f} ps per byte ({fit['cache']}); the same sets hot, fitted "
        f"the old way: {t0_hot * 1e6:.1f} us per tensor + {sb_hot * 1e12:.0f} ps per byte")
    one = {label: _updates(str(path), batch, args.steps, probes=True) for label, path, batch in WORKLOADS}
    two = run_ranks(_two_ranks, 2, args=(args.steps,), timeout_s=1800)
    say(f"the update (ms, median over {args.steps} steps): in its training loop on one process and on two "
        "processes at once (the slower), repeated hot, after a cache-sized write; priced by the hot fit and the cold fit")
    say(f"  {'model':<20}{'tensors':>8}{'MB':>7} | {'in-loop 1':>9} {'in-loop 2':>9} | {'hot':>6} {'cold':>6} | "
        f"{'hot fit':>7} {'cold fit':>8}")
    err_hot: dict[int, list[float]] = {1: [], 2: []}
    err_cold: dict[int, list[float]] = {1: [], 2: []}
    for label, *_ in WORKLOADS:
        u = one[label]
        n, b = u["tensors"], u["bytes"]
        hot_fit = n * t0_hot + b * sb_hot
        cold_fit = fit["fixed_s"] + n * fit["t0_s"] + b * fit["s_per_byte"]
        loop1 = statistics.median(u["in_loop"])
        loop2 = max(two[0][label], two[1][label])
        for k, loop in ((1, loop1), (2, loop2)):
            err_hot[k].append((hot_fit - loop) / loop)
            err_cold[k].append((cold_fit - loop) / loop)
        say(f"  {label:<20}{n:>8}{b / 1e6:>7.2f} | {loop1 * 1e3:>9.3f} {loop2 * 1e3:>9.3f} | "
            f"{statistics.median(u['hot']) * 1e3:>6.3f} {statistics.median(u['cold']) * 1e3:>6.3f} | "
            f"{hot_fit * 1e3:>7.3f} {cold_fit * 1e3:>8.3f}")
    for k, what in ((1, "one process"), (2, "two processes at once")):
        say(f"against the in-loop update on {what}: hot fit median error {100 * statistics.median(err_hot[k]):+.0f} % "
            f"(median |error| {100 * statistics.median(abs(e) for e in err_hot[k]):.0f} %), cold fit "
            f"{100 * statistics.median(err_cold[k]):+.0f} % ({100 * statistics.median(abs(e) for e in err_cold[k]):.0f} %)")
    if args.out:
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
