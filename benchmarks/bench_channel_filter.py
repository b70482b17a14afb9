"""Measured: segmented gradient allreduce (channel/filter) vs the world allreduce (sample).

For each world size and each block -- a wide conv block (two 3x3 convs, C = F = ``--conv-width``,
4x4 images) and a wide linear block (two ``--linear-width`` square linears), each followed by
batch norm and ReLU, batch 8 -- run ``--steps`` training steps (forward, loss, backward,
gradient SUM-allreduce over each gradient group with ``GradSync``, SGD with momentum) under:

  sample           Sample(P) -> Sample(P)                 whole weights, allreduce over P ranks
  filter>channel   Filter(1,P) -> Channel(1,P)            free edge, no gradient allreduce
  hybrid           Filter(2,P/2) -> Channel(2,P/2)         |W|/(P/2) among 2 ranks  (P >= 4)
  cf>channel       ChannelFilter(1,2,P/2) -> Channel(2,P/2)                          (P >= 4)

Reported per strategy: bytes allreduced per step by rank 0 (``GradSync.bytes_per_step``; rank 0
holds the largest shards) next to the cost model's ``grad_sync_bytes``; the step time (median
over steps of the slowest rank); the exposed allreduce time (``GradSync.finish``, median of the
slowest rank). Ratios are sample / strategy. On a 2-core machine worlds above 2 oversubscribe
the cores: treat their times as relative, not absolute.

Usage: python benchmarks/bench_channel_filter.py [--worlds 2 4] [--steps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_channel_filter_cost import ctx_for, make_layer  # noqa: E402  (hand-built layers)

from autopar.decomp.channel_filter import Channel, ChannelFilter, Filter  # noqa: E402
from autopar.decomp.sample import Sample  # noqa: E402

BATCH = 8


def strategies(world: int) -> dict[str, list]:
    out = {"sample": [Sample(world), Sample(world)],
           "filter>channel": [Filter(1, world), Channel(1, world)]}
    if world >= 4 and world % 2 == 0:
        h = world // 2
        out["hybrid"] = [Filter(2, h), Channel(2, h)]
        out["cf>channel"] = [ChannelFilter(1, 2, h), Channel(2, h)]
    return out


def blocks(conv_width: int, linear_width: int) -> dict[str, tuple[list[int], str, int]]:
    return {"conv": ([BATCH, conv_width, 4, 4], "conv", conv_width),
            "linear": ([BATCH, linear_width], "linear", linear_width)}


def _rank(rank, world, configs, steps):
    import torch
    import torch.distributed as dist
    from autopar.runtime.comm import Comm, local_slice
    from autopar.runtime.redistribute import redistribute
    from autopar.runtime.gradsync import GradSync

    comm = Comm(rank, world)
    out = {}
    for key, layers, decs, x_shape in configs:
        g = torch.Generator().manual_seed(0)
        params, shards, bufs = {}, {}, {}
        for lay, dec in zip(layers, decs):
            for op in lay.ops:
                for role, shape in op.params.items():
                    q, sh = op.param_names[role], dec.param_shard(op, role)
                    full = torch.randn(shape, generator=g) * (0.02 if op.kind != "batch_norm" else 1)
                    b = sh.local_bounds(shape, rank, world)
                    params[q] = full[tuple(slice(s, s + e) for s, e in b)].clone().requires_grad_()
                    shards[q] = sh
                for role, q in op.buffers.items():
                    bufs[q] = torch.zeros(op.params["weight"]) if role == "running_mean" else \
                        torch.ones(op.params["weight"])
        partitions = [p for lay, dec in zip(layers, decs) for p in dec.partitions(lay, world)]
        partitions += [[sh.grad_group(r, world) for r in range(world)] for sh in shards.values()]
        comm.ensure_partitions(partitions)
        sync = GradSync(comm, [(p, tuple(shards[q].grad_group(rank, world))) for q, p in params.items()])
        opt = torch.optim.SGD(list(params.values()), lr=1e-3, momentum=0.9)
        x = torch.randn(x_shape, generator=g)
        in_lay = decs[0].in_placement(layers[0], "x")
        xl = local_slice(x, in_lay, comm)
        w_loss = torch.randn(layers[-1].out_shape, generator=g)
        step_s, sync_s = [], []
        for i in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            v, src = xl, in_lay
            for lay, dec in zip(layers, decs):
                v = redistribute(v, src, dec.in_placement(lay, lay.inputs[0]),
                                 lay.in_shape(lay.inputs[0]), comm)
                for op in lay.ops:
                    v = dec.run(comm, lay, op, [v], {q: params[q] for q in op.param_names.values()},
                                {q: bufs[q] for q in op.buffers.values()})
                src = dec.out_placement(lay)
            loss = (v * local_slice(w_loss, src, comm)).sum() / src.replicas(world)
            loss.backward()
            t1 = time.perf_counter()
            sync.finish()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            if i:                                    # step 0 is warm-up
                step_s.append(t3 - t0)
                sync_s.append(t2 - t1)
        ctx = ctx_for(world)
        out[key] = {"bytes": sync.bytes_per_step, "step_s": step_s, "sync_s": sync_s,
                    "predicted_bytes": sum(d.cost(lay, ctx).grad_sync_bytes
                                           for lay, d in zip(layers, decs))}
        sync.remove()
        del params, opt, sync
    return out


def run(worlds, steps, conv_width, linear_width):
    from autopar.runtime.launch import run_ranks
    rows = []
    for world in worlds:
        configs = []
        for bname, (x_shape, kind, width) in blocks(conv_width, linear_width).items():
            for sname, decs in strategies(world).items():
                layers = [make_layer(0, kind, "x", x_shape, width),
                          make_layer(1, kind, "l0_relu", x_shape, width)]
                for lay, d in zip(layers, decs):
                    why = d.check(lay, ctx_for(world))
                    if why:
                        raise SystemExit(f"{sname} illegal at world {world}: {why}")
                configs.append(((bname, sname), layers, decs, x_shape))
        res = run_ranks(_rank, world, args=(configs, steps), timeout_s=1200)
        for (bname, sname), *_ in configs:
            per_rank = [r[(bname, sname)] for r in res]
            step = statistics.median(max(r["step_s"][i] for r in per_rank) for i in range(steps))
            sync = statistics.median(max(r["sync_s"][i] for r in per_rank) for i in range(steps))
            rows.append({"world": world, "block": bname, "strategy": sname,
                         "allreduce_bytes_per_step": per_rank[0]["bytes"],
                         "predicted_bytes": per_rank[0]["predicted_bytes"],
                         "step_s": step, "exposed_allreduce_s": sync})
    return rows


def report(rows) -> str:
    lines = [f"{'world':>5} {'block':<7} {'strategy':<15} {'allreduce B/step':>16} {'predicted':>11} "
             f"{'step ms':>8} {'AR ms':>7} {'bytes x':>8} {'step x':>7} {'AR x':>6}"]
    base = {(r["world"], r["block"]): r for r in rows if r["strategy"] == "sample"}
    for r in rows:
        b = base[(r["world"], r["block"])]
        none = not r["allreduce_bytes_per_step"]
        bx = "-" if none else f"{b['allreduce_bytes_per_step'] / r['allreduce_bytes_per_step']:.2f}"
        ax = "-" if none else f"{b['exposed_allreduce_s'] / max(r['exposed_allreduce_s'], 1e-9):.1f}"
        lines.append(f"{r['world']:>5} {r['block']:<7} {r['strategy']:<15} "
                     f"{r['allreduce_bytes_per_step']:>16,} {r['predicted_bytes']:>11,.0f} "
                     f"{1e3 * r['step_s']:>8.1f} {1e3 * r['exposed_allreduce_s']:>7.1f} "
                     f"{bx:>8} {b['step_s'] / r['step_s']:>7.2f} {ax:>6}")
    lines.append("x = sample / strategy (bytes allreduced, step time, exposed allreduce time); "
                 "- = no gradient allreduce at all")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--conv-width", type=int, default=512)
    ap.add_argument("--linear-width", type=int, default=2048)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    rows = run(a.worlds, a.steps, a.conv_width, a.linear_width)
    print(report(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
