"""Benchmark: where a native data-parallel step and torch DDP's step differ, phase by phase.

For each model and world size, the plan ``autopar plan`` makes (it must run natively:
``runtime.native``) is run with torch DDP's reducer (the default) and with autopar's
``GradSync`` (``AUTOPAR_NATIVE_REDUCER=gradsync``), side by side with torch DDP on the same
batch split, steps interleaved (the order rotated every step). Per phase of the step (zero_grad,
forward, loss, backward, finishing the gradient sync, optimizer) it records the main thread's
CPU time (``time.thread_time``: what the step's own Python and kernels cost, much less moved
by other processes on the cores than wall time) and the step's wall time, and prints the mean
CPU per phase and the median wall time per rank. Then ``--blocks`` rounds of ``--block-steps``
consecutive steps per runner (no barrier between them, as a training loop runs them; runners
rotated each round): work one step leaves running into the next (an asynchronous collective
waited a step later) shows there and not in fenced steps. The difference between a native runner and
DDP, phase by phase, is the per-step overhead the native path pays and DDP does not.

    python benchmarks/bench_native_overhead.py [--models gnn_pcqm4m] [--worlds 2 4] [--steps 200]
        [--calibration PROFILE] [--blocks 8] [--block-steps 15] [--out FILE]

Figures are measured: the machine load is printed at start and end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("zero_grad", "forward", "loss", "backward", "finish", "optimizer")


def _rank_main(rank: int, world: int, plan_path: str, steps: int, blocks: int = 0,
               block_steps: int = 15) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopar.artifacts import load_plan
    from autopar.execute.baseline import ddp_split
    from autopar.execute.runner import _import_generated
    from autopar.runtime.comm import Comm
    from autopar.runtime.entry import build_user_model, synthetic_batch

    comm = Comm.from_env()
    plan = load_plan(plan_path)
    gen = _import_generated(Path(plan_path).parent / plan.generated)
    runners, notes = {}, {}
    for reducer in ("ddp", "gradsync"):
        os.environ["AUTOPAR_NATIVE_REDUCER"] = reducer
        mf, model = build_user_model(plan, plan_path, 0)
        dm = gen.PlannedModel(plan, model, comm)
        os.environ.pop("AUTOPAR_NATIVE_REDUCER")
        dm.train()
        if not dm.native:
            raise RuntimeError(f"the plan does not run natively: {dm.native_off_reason}")
        lf = mf.loss_fn()
        xs, ys = synthetic_batch(mf, plan.model.batch_size, 1)
        local = dm.shard_inputs(xs)
        opt = torch.optim.SGD(dm.parameters(), lr=0.01, momentum=0.9)
        name = f"native/{reducer}"
        notes[name] = dm._native.reducer
        runners[name] = (opt, lambda dm=dm, local=local: dm(*local),
                         lambda o, dm=dm, ys=ys, lf=lf: dm.local_loss(o, ys, lf), dm.finish_grads)
    torch.manual_seed(0)
    base, bx, by, rows, _ = ddp_split(mf, xs, ys, comm, dm.graph)
    base.train()
    ddp = DDP(base, process_group=comm.mesh_group)
    opt2 = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    cut = rows or (lambda o: o)
    runners["torch DDP"] = (opt2, lambda: ddp(*bx),
                            (lambda o: lf(cut(o), by)) if by is not None else (lambda o: lf(cut(o))),
                            lambda: None)
    names = list(runners)
    cpu = {n: {p: [] for p in PHASES} for n in names}
    wall = {n: [] for n in names}
    warmup = 5
    for k in range(warmup + steps):
        for n in names[k % len(names):] + names[:k % len(names)]:
            opt, fwd, loss_of, finish = runners[n]
            comm.barrier()
            w0 = time.perf_counter()
            t = [time.thread_time()]
            opt.zero_grad(set_to_none=True)
            t.append(time.thread_time())
            out = fwd()
            t.append(time.thread_time())
            loss = loss_of(out)
            t.append(time.thread_time())
            loss.backward()
            t.append(time.thread_time())
            finish()
            t.append(time.thread_time())
            opt.step()
            t.append(time.thread_time())
            w1 = time.perf_counter()
            if k >= warmup:
                for p, a, b in zip(PHASES, t, t[1:]):
                    cpu[n][p].append(b - a)
                wall[n].append(w1 - w0)
    # blocks: consecutive steps with nothing between them, as a training loop runs them (the
    # fence above, a barrier before every step, hides what one step leaves running into the next)
    from autopar.execute.timing import timed_block
    block: dict[str, list[float]] = {n: [] for n in names}
    for k in range(blocks):
        for n in names[k % len(names):] + names[:k % len(names)]:
            opt, fwd, loss_of, finish = runners[n]
            block[n].append(timed_block(lambda fwd=fwd: fwd(), opt, (), loss_of, finish, block_steps,
                                        comm, lambda: None, comm.barrier))
    return {"cpu": {n: {p: statistics.mean(v) for p, v in d.items()} for n, d in cpu.items()},
            "wall": {n: statistics.median(v) for n, v in wall.items()}, "notes": notes,
            "block": block}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gnn_pcqm4m")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--calibration", default=None, help="profile (default calibration/cpu-2core-gloo.json)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="also write the lines printed to this file")
    ap.add_argument("--blocks", type=int, default=8,
                    help="rounds of blocks of consecutive steps per runner (0: none), runners rotated")
    ap.add_argument("--block-steps", type=int, default=15)
    args = ap.parse_args(argv)
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import load_calibration, make_plan
    from autopar.runtime.launch import run_ranks
    _, profile = load_calibration(args.calibration)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)
    say(f"machine load at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) on "
        f"{os.cpu_count()} cores")
    say(f"main-thread CPU per phase of a step (ms, mean over {args.steps} steps, runners interleaved "
        f"step by step) and the step's wall time (ms, median)")
    for name in args.models.split(","):
        for world in args.worlds:
            with tempfile.TemporaryDirectory() as tmp:
                r = make_plan(ROOT / "strategies/examples" / f"{name}.py",
                              PlanOptions(world_size=world, out_dir=tmp, placement="block"),
                              PlanHooks(profile=profile))
                res = run_ranks(_rank_main, world, args=(str(r.plan_path), args.steps, args.blocks,
                                                          args.block_steps),
                                timeout_s=args.timeout)
            say(f"\n== {name} world {world} ({', '.join(sorted({d.choice for d in r.plan.layers}))})")
            for n, note in res[0]["notes"].items():
                say(f"   {n}: {note}")
            say(f"   {'rank':<4} {'runner':<17}" + "".join(f"{p:>10}" for p in PHASES) + f"{'CPU':>9}{'wall':>9}")
            for rank, rr in enumerate(res):
                for n, d in rr["cpu"].items():
                    say(f"   {rank:<4} {n:<17}" + "".join(f"{d[p] * 1e3:10.3f}" for p in PHASES)
                        + f"{sum(d.values()) * 1e3:9.3f}{rr['wall'][n] * 1e3:9.2f}")
            for n in res[0]["cpu"]:
                if n == "torch DDP":
                    continue
                per = [sum(rr["cpu"][n].values()) / sum(rr["cpu"]["torch DDP"].values()) for rr in res]
                say(f"   {n} / torch DDP, main-thread CPU per step: "
                    + ", ".join(f"rank {i} {x:.3f}" for i, x in enumerate(per)))
            blk = res[0]["block"]
            if blk.get("torch DDP"):
                say(f"   blocks of {args.block_steps} consecutive steps (the slowest rank's wall time per step, "
                    f"ms; {len(blk['torch DDP'])} rounds, runners rotated): "
                    + ", ".join(f"{n} {statistics.median(v) * 1e3:.2f}" for n, v in blk.items()))
                for n, v in blk.items():
                    if n != "torch DDP":
                        ratio = statistics.median(a / b for a, b in zip(v, blk["torch DDP"]))
                        say(f"   {n} / torch DDP, blocks: {ratio:.3f} (median of the rounds' ratios)")
    say(f"machine load at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    if args.out:
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
