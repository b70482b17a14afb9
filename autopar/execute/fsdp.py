"""``autopar execute`` of a sharded-data-parallel plan (plan.json ``runtime.expected == "fsdp"``,
``planner.strategies.sharded``): the user's untouched module on torch's FSDP2 (``runtime.fsdp``).

On every rank of the world, in this order (each step collective):

1. validation in ``opts.validate_dtype``: the plan (FSDP2 per unit as plan.json says, activation
   checkpointing on the units whose decision has ``ac``: ``runtime.fsdp.checkpoint_unit``) on the
   rank's block of samples against one process on the whole batch (every rank computes the
   reference): the rank's output block, the loss (the mean of the ranks' block means), every
   gradient (``full_tensor``) and every parameter after one SGD step (``opts.lr``,
   ``opts.momentum``); FSDP2 averages gradients over the data axis, so each rank back-propagates
   its block's mean loss;
2. measured peak memory per rank: one float32 training step (the second: optimizer state exists)
   under ``runtime.fsdp.LiveBytes`` (live tensor bytes: parameters, gradients, optimizer state,
   gathered parameters, activations) on CPU, ``torch.cuda.max_memory_allocated`` on CUDA;
3. timing, float32: the plan, torch DDP and torch FSDP2 with ``fully_shard`` on every block and
   the root (same module, same batch, same SGD) in interleaved rounds, the order rotating round
   by round, so that machine drift falls on all three alike.

A ZeRO-1 plan (DDP + ``ZeroRedundancyOptimizer``, ``runtime.fsdp.make_optimizer``) runs the same
three steps with its optimizer built by ``make_optimizer`` (SGD with momentum partitioned). A TP +
sharding plan (``runtime.sharded.mesh`` with a ``tp`` axis) runs on a (dp, tp) mesh with plan.json's
DTensor styles applied first; each rank feeds its data-axis block (the tp ranks of a group the
same one), and the FSDP2 baseline keeps its 1-D mesh over the world.

Returns the dict ``execute.runner`` turns into the run (``sharded``: memory and the FSDP2 baseline).
"""

from __future__ import annotations

import statistics
from typing import Any

from ..decomp.fsdp import Sharded, unit_of
from ..runtime import fsdp as rf
from ..runtime.fsdp import sharded_record, units_of  # noqa: F401  (runner imports them from here)
from ..runtime.entry import build_user_model, synthetic_batch
from ..runtime.model import output_tensor
from . import timing
from .baseline import ddp_runner
from .validate import compare, ghost_batch_norm

#: interleaved rounds of plan / DDP / FSDP2 timing
ROUNDS = 6


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def every_block(model) -> dict[str, Sharded]:
    """FSDP2's usual wrapping: ``fully_shard`` (ZeRO-3, reshard after forward) on every block."""
    import torch.distributed as dist
    world = dist.get_world_size()
    blocks = sorted({unit_of(n) for n, _ in model.named_modules()} - {""})
    blocks = [b for b in blocks if not any(b != o and b.startswith(o + ".") for o in blocks)]
    z3 = Sharded(3, True, world)
    return {**{b: z3 for b in blocks}, "": z3}


def instrumented_phases(model, opt, xs, loss_of, comm, sync) -> dict[str, float]:
    """One step timed by phase on this rank (forward, backward with FSDP2's all-gathers and
    reduce-scatters inside it, optimizer on the shards); the slowest rank's of each."""
    import time

    import torch
    comm.barrier()
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = model(*xs)
    sync()
    t1 = time.perf_counter()
    loss_of(out).backward()
    sync()
    t2 = time.perf_counter()
    opt.step()
    sync()
    t3 = time.perf_counter()
    ts = torch.tensor([t1 - t0, t2 - t1, t3 - t2], dtype=torch.float64, device=comm.device)
    comm.all_reduce_(ts, torch.distributed.ReduceOp.MAX)
    f, b, o = (float(x) for x in ts)
    return {"fwd_s": f, "bwd_s": b, "grad_sync_wait_s": 0.0, "optimizer_s": o}


def fsdp_main(plan, plan_path: str, comm, opts) -> dict[str, Any]:
    """One rank of a sharded plan (module docstring)."""
    import torch

    rec = sharded_record(plan)
    units, _ = units_of(rec)
    tp, styles = rf.mesh_of(rec)
    rank, world = comm.rank, comm.world
    device = comm.device
    vdt = getattr(torch, opts.validate_dtype)
    rtol, atol = opts.tolerances()
    mesh = rf.make_mesh(world, tp, device.type)
    mesh_1d = mesh if tp == 1 else rf.make_mesh(world, 1, device.type)   # the FSDP2-every-block baseline
    dp, dp_rank = world // tp, rank // tp       # the data axis: each tensor group feeds one block
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def build(dtype, how):
        mf_, m = build_user_model(plan, plan_path, opts.seed)
        m.to(device=device, dtype=dtype).train()
        if how is not None:
            rf.parallelize(m, mesh, {k: v for k, v in how.items() if k}, styles, root=how.get(""))
        return mf_, m

    mf, ref = build(vdt, None)
    loss_fn = mf.loss_fn()
    xs32, ys32 = synthetic_batch(mf, plan.model.batch_size, opts.seed + 1)

    def cast(ts, dtype):
        return [x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device) for x in ts]

    def block(t):
        return t.chunk(dp)[dp_rank] if t is not None and t.dim() else t

    def block_w(t):
        return t.chunk(world)[rank] if t is not None and t.dim() else t

    ys = ys32.to(device) if ys32 is not None else None
    ysv = ys.to(vdt) if ys is not None and ys.is_floating_point() else ys

    def loss_of(out, y):
        return loss_fn(out, y) if y is not None else loss_fn(out)

    # 1. validation
    _, model = build(vdt, units)
    xs = cast(xs32, vdt)
    opt = rf.make_optimizer(model, torch.optim.SGD, lr=opts.lr, momentum=opts.momentum)
    ropt = torch.optim.SGD(ref.parameters(), lr=opts.lr, momentum=opts.momentum)
    out = model(*[block(x) for x in xs])
    loss = loss_of(out, block(ysv))
    loss.backward()
    bn = plan.bn_stats()     # FSDP2's ranks normalise their own samples: the reference says so
    with ghost_batch_norm(bn.group if bn.local else None):
        rout = ref(*xs)
        rloss = loss_of(rout, ysv)
    rloss.backward()
    lsum = loss.detach().clone()
    comm.all_reduce_(lsum)
    checks = [compare("output", output_tensor(out).detach(), block(output_tensor(rout).detach()), rtol, atol),
              compare("loss", lsum / world, rloss.detach(), rtol, atol)]
    rparams = dict(ref.named_parameters())
    for q, p in model.named_parameters():
        g = _full(p.grad) if p.grad is not None else None
        checks.append(compare(f"grad:{q}", g, rparams[q].grad, rtol, atol))
    opt.step()
    ropt.step()
    for q, p in model.named_parameters():
        checks.append(compare(f"param_after_step:{q}", _full(p.detach()), rparams[q].detach(), rtol, atol))
    del model, opt, ref, ropt
    comm.barrier()

    # 2. float32: the plan's model, peak memory of its second step
    _, model = build(torch.float32, units)
    xs_l = [block(x.to(device)) for x in xs32]
    ys_l = block(ys.to(torch.float32) if ys is not None and ys.is_floating_point() else ys)
    opt = rf.make_optimizer(model, torch.optim.SGD, lr=opts.lr, momentum=opts.momentum)
    plan_loss = lambda o: loss_of(o, ys_l)  # noqa: E731
    timing.step_once(model, opt, xs_l, plan_loss, lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        timing.step_once(model, opt, xs_l, plan_loss, lambda: None)
        peak = int(torch.cuda.max_memory_allocated(device))
    else:
        opt.zero_grad(set_to_none=True)
        with rf.LiveBytes(also=rf.state_tensors(model, getattr(opt, "optim", opt))) as lb:   # ZeRO-1: its part
            timing.step_once(model, opt, xs_l, plan_loss, lambda: None)
        peak = int(lb.peak_bytes)
    peaks = torch.tensor([float(peak)], dtype=torch.float64, device=device)
    comm.all_reduce_(peaks, torch.distributed.ReduceOp.MAX)
    comm.barrier()

    # 3. timing: plan, DDP, FSDP2 on every block, interleaved
    _, f2 = build(torch.float32, None)
    rf.parallelize(f2, mesh_1d, {k: v for k, v in every_block(f2).items() if k}, root=every_block(f2)[""])
    xs_w = [block_w(x.to(device)) for x in xs32]
    ys_w = block_w(ys.to(torch.float32) if ys is not None and ys.is_floating_point() else ys)
    f2opt = torch.optim.SGD(f2.parameters(), lr=opts.lr, momentum=opts.momentum)
    ddp = ddp_runner(mf, [x.to(device) for x in xs32], ys.to(torch.float32) if ys is not None and
                     ys.is_floating_point() else ys, loss_fn, comm, opts.seed, opts.lr, opts.momentum,
                     bn_stats=bn) \
        if opts.ddp and world > 1 else None
    runs = {"plan": (model, opt, xs_l, plan_loss, lambda: None),
            "fsdp2": (f2, f2opt, xs_w, lambda o: loss_of(o, ys_w), lambda: None)}
    if ddp is not None:
        runs["ddp"] = ddp.step_args()
    barrier = comm.barrier
    for args in runs.values():
        timing.timed_steps(*args, opts.warmup, comm, sync, barrier)
    times = timing.interleaved_rounds({name: (lambda n, a=args: timing.timed_steps(*a, n, comm, sync, barrier))
                                       for name, args in runs.items()}, opts.steps, ROUNDS)
    med = {k: statistics.median(v) for k, v in times.items()}
    phases = instrumented_phases(model, opt, xs_l, plan_loss, comm, sync)
    rs_bytes = sum((p.to_local().numel() * world if hasattr(p, "to_local") else p.numel()) * p.element_size()
                   for p in model.parameters())
    return {"rank": rank, "checks": checks, "plan_step_times_s": times["plan"], "per_layer": [],
            "phases": phases, "baseline": ddp.result(times["ddp"]) if ddp is not None else None,
            "grad_sync_bytes_per_step": rs_bytes,
            "runtime": {"native": True,
                        "note": "runtime: torch FSDP2 (fully_shard per unit as plan.json says) on the user's module"
                                + (f", DTensor tensor parallelism over {tp} ranks first" if tp > 1 else "")},
            "speed_probe_s": None,
            "sharded": {"units": {k or "<root>": (str(v) if v is not None else "data parallel")
                                  for k, v in units.items()},
                        "measured_peak_bytes_per_rank": float(peaks.item()),
                        "predicted_memory_per_rank_bytes": float(plan.predicted.memory_per_rank_bytes),
                        "memory_ratio_measured_to_predicted": float(peaks.item()) / float(plan.predicted.memory_per_rank_bytes),
                        "memory_measured_by": "live tensor bytes (runtime.fsdp.LiveBytes)" if device.type == "cpu"
                        else "torch.cuda.max_memory_allocated",
                        "fsdp2_every_block_step_times_s": times["fsdp2"],
                        "fsdp2_every_block_step_time_s": med["fsdp2"],
                        "ratio_to_fsdp2": med["plan"] / med["fsdp2"],
                        "ratio_to_ddp": (med["plan"] / med["ddp"]) if "ddp" in med else None}}
