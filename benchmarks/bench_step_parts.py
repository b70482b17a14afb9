"""Where does a multi-rank step's time go on this machine, against what the profile assumes?

Two measurements, each of the benchmark models' own training steps (the user's module, SGD with
momentum, synthetic batches as ``autopar execute`` makes them):

1. **Compute slowdown by workload.** The profile prices every local kernel with one factor
   per number of ranks running (``Profile.slowdown``), measured on a fixed kernel set
   (``calibrate.kernels.slowdown_kernel_set``). Here the same windows (``calibrate.run.
   _slowdown_rank``'s idea: k of the ranks run the same local work for the same wall time, the
   others wait; counts alternating round by round) are run for the kernel set, for two
   memory-bound elementwise workloads (``MEMORY_BOUND``) and for each model's local training
   step, k = 1, 2 and 4, so the kernel set's factor can be read against the work it stands
   for. Per round the ratio t(k) / t(1) (t: the median over the k ranks of each rank's mean
   step), the median over rounds printed with its quartiles, and the same ratio for the
   slowest of the k ranks (which a synchronised step waits for).
2. **A world-2 step's parts.** On 2 ranks, one model's local step (half the batch each), in
   blocks of steps fenced once (``execute.timing.timed_block``'s way): ``local`` with no
   communication at all, ``allreduce`` with one blocking all-reduce after backward of as many
   floats as the gradients hold (one buffer), and ``ddp`` with torch DDP's reducer (no buffer sync, as
   ``runtime.native`` builds it). The differences are what the gradient sync costs in situ,
   overlapped (DDP) or not.

Nothing here is a prediction: it says which parts of the cost model a miss comes from.

    python benchmarks/bench_step_parts.py [--rounds 12] [--window 0.25] [--out FILE]
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
WORKLOADS = [("resnet2d", EX / "resnet2d.py", 8), ("heldout_vgg", MODELS / "heldout_vgg.py", 8),
             ("heldout_bottleneck", MODELS / "heldout_bottleneck.py", 8),
             ("cnn3d_large", EX / "cnn3d_large.py", 2), ("gpt", EX / "gpt.py", 4),
             ("gnn_pcqm4m", EX / "gnn_pcqm4m.py", 4)]
#: the models whose world-2 step is split (global batch: twice the local one above)
SPLIT = [("resnet2d", EX / "resnet2d.py", 16), ("gpt", EX / "gpt.py", 8)]


def _step_fn(path: str, batch: int, wrap=None):
    """A closure running one training step of the model file at ``batch`` samples
    (``execute.timing.step_once``: the user's module, SGD with momentum, on the synthetic batch
    ``autopar execute`` makes), and the model; ``wrap(model)`` returns the module called."""
    import torch

    from autopar.execute.timing import step_once
    from autopar.modelfile import load_model_file
    from autopar.runtime.entry import synthetic_batch
    mf = load_model_file(path)
    torch.manual_seed(0)
    model = mf.build_model()
    xs, ys = synthetic_batch(mf, batch, 1)
    loss_fn = mf.loss_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    called = wrap(model) if wrap else model

    def loss_of(out):
        return loss_fn(out, ys) if ys is not None else loss_fn(out)

    def step(after_backward=None):
        step_once(called, opt, xs, loss_of, after_backward or (lambda: None))
    return step, model


#: (label, float32 elements per operand, adds per call): memory-bound elementwise work, an
#: out-of-place add over operands of 8 MiB (beyond the caches) and of 0.5 MiB
MEMORY_BOUND = (("elementwise 8 MiB", 2 << 20, 4), ("elementwise 0.5 MiB", 128 << 10, 64))


def _memory_bound_work() -> dict:
    """``MEMORY_BOUND`` as closures, beside the compute-bound kernel set."""
    import torch
    out = {}
    for label, numel, reps in MEMORY_BOUND:
        a, b = torch.randn(numel), torch.empty(numel)

        def fn(a=a, b=b, reps=reps):
            for _ in range(reps):
                torch.add(a, 1.0, out=b)
        out[label] = fn
    return out


def _slowdown_rank(rank, world, rounds, window_s):
    import torch
    import torch.distributed as dist

    from autopar.calibrate.kernels import slowdown_kernel_set
    kernel_set = slowdown_kernel_set("cpu")

    def kset():
        with torch.no_grad():
            kernel_set()
    work = {"kernel set": kset, **_memory_bound_work()}
    for label, path, batch in WORKLOADS:
        work[label] = _step_fn(str(path), batch)[0]
    counts = [k for k in (1, 2, 4) if k <= world]
    out: dict = {}
    for j in range(rounds):
        for name, fn in work.items():
            for k in (counts if j % 2 == 0 else counts[::-1]):
                dist.barrier()
                if rank < k:
                    fn()
                    n, t0 = 0, time.perf_counter()
                    end = t0 + window_s
                    while time.perf_counter() < end or n < 2:
                        fn()
                        n += 1
                    out.setdefault(f"{name}|{k}", []).append((time.perf_counter() - t0) / n)
                dist.barrier()
    return out


def _split_rank(rank, world, path, batch, rounds, steps):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    local, model = _step_fn(path, batch // world)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    ddp_step, _ = _step_fn(path, batch // world,
                           wrap=lambda m: DDP(m, forward_sync_buffers=False, init_sync=False))
    modes = {"local": lambda: local(), "allreduce": lambda: local(lambda: dist.all_reduce(flat)),
             "ddp": lambda: ddp_step()}
    out: dict = {m: [] for m in modes}
    for j in range(rounds):
        for name in (list(modes) if j % 2 == 0 else list(modes)[::-1]):
            for _ in range(2):
                modes[name]()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                modes[name]()
            dist.barrier()
            out[name].append((time.perf_counter() - t0) / steps)
    return out


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    s = sorted(xs)
    return s[len(s) // 4], statistics.median(s), s[(3 * len(s)) // 4]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--window", type=float, default=0.25, help="seconds each count runs per round")
    ap.add_argument("--split-rounds", type=int, default=6)
    ap.add_argument("--split-steps", type=int, default=40)
    ap.add_argument("--out", help="also write the printout here")
    args = ap.parse_args(argv)
    from autopar.runtime.launch import run_ranks
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"1. compute slowdown by workload ({args.rounds} rounds of {args.window:.2f} s windows per count; "
        "ratio = t(k) / t(1) of the same round, median (quartiles) over rounds)")
    res = run_ranks(_slowdown_rank, 4, args=(args.rounds, args.window), timeout_s=3600)
    names = ["kernel set"] + [m[0] for m in MEMORY_BOUND] + [w[0] for w in WORKLOADS]
    for name in names:
        one = res[0][f"{name}|1"]
        row = f"  {name:<20} 1 rank {1e3 * statistics.median(one):8.2f} ms"
        for k in (2, 4):
            tk = [statistics.median(res[r][f"{name}|{k}"][j] for r in range(k)) for j in range(len(one))]
            slowest = [max(res[r][f"{name}|{k}"][j] for r in range(k)) for j in range(len(one))]
            q1, med, q3 = _quartiles([b / a for a, b in zip(one, tk)])
            row += (f" | {k} ranks x{med:.3f} ({q1:.2f}-{q3:.2f}), slowest rank "
                    f"x{statistics.median(b / a for a, b in zip(one, slowest)):.3f}")
        say(row)
    say(f"2. a world-2 step's parts ({args.split_rounds} rounds of {args.split_steps} steps per block, "
        "the slower rank's block; median over rounds)")
    for label, path, batch in SPLIT:
        r = run_ranks(_split_rank, 2, args=(str(path), batch, args.split_rounds, args.split_steps),
                      timeout_s=3600)
        med = {m: statistics.median(max(a, b) for a, b in zip(r[0][m], r[1][m])) for m in r[0]}
        say(f"  {label} batch {batch} ({batch // 2} per rank): local {1e3 * med['local']:.2f} ms, "
            f"+ a blocking all-reduce of the gradients' size {1e3 * (med['allreduce'] - med['local']):+.2f} ms, "
            f"+ DDP {1e3 * (med['ddp'] - med['local']):+.2f} ms")
    if args.out:
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
