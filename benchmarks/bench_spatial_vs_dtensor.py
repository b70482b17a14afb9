"""Measured: autopar's spatial convolution vs DTensor's convolution, activations split on W.

At world 2 (gloo, CPU, forked ranks) and for each 3x3 "same" convolution shape below, one
training step of one layer -- forward, loss ``sum(y * R)``, backward, weight gradients made whole
-- is timed (median of ``--steps`` after ``--warmup``; the slowest rank) under:

  single          one process per rank on the whole tensor, no communication (for scale)
  autopar         ``Spatial(1, (1, 2))``: the local W block, halo exchange
                  (``autopar.runtime.layers.halo``), local conv on the window; weight and bias
                  gradients SUM-allreduced
  dtensor         torch.distributed.tensor as shipped: ``distribute_tensor(x, mesh,
                  [Shard(3)])``, weight and bias ``[Replicate()]``, ``F.conv2d``,
                  ``.full_tensor()`` of the weight gradients
  dtensor-legacy  the same after removing torch's single-dim sharding strategies for
                  ``aten.convolution`` / ``convolution_backward`` so that DTensor's own halo
                  handler (``torch/distributed/tensor/_tp_conv.py``) decides the output
                  placement (run in fresh processes: the change is process-global)
  dtensor-gather  what works with DTensor today: ``x.redistribute(mesh, [Replicate()])``
                  (all-gather), conv on the whole tensor, output back to ``[Shard(3)]``

Every variant is checked against the single-process result (output, input gradient, weight
gradient). Wrong results, missing gradients and errors are printed as such; a ratio is printed
only for a variant whose results are right. Ratios are variant / autopar step time (> 1:
autopar faster). On 2 cores, world 2 uses one core per rank.

Usage: python benchmarks/bench_spatial_vs_dtensor.py [--steps 10] [--warmup 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = [  # (N, C, H, W, F)
    (8, 16, 64, 64, 16),
    (4, 32, 128, 128, 32),
    (2, 16, 256, 256, 16),
]
TOL = 1e-4            # max |dist - ref| / max(1, max |ref|) for "right"


def _conv_layer(n, c, h, w, f):
    from autopar.decomp.ir import CONV, Layer, OpSpec
    op = OpSpec(name="conv", kind=CONV, target="aten.conv2d.default",
                args=[{"v": "x"}, {"p": "w"}, {"p": "b"}, [1, 1], [1, 1], [1, 1], 1], kwargs={},
                out_shape=[n, f, h, w], dtype="float32", inputs=["x"], in_shapes=[[n, c, h, w]],
                params={"weight": [f, c, 3, 3], "bias": [f]}, param_names={"weight": "w", "bias": "b"},
                attrs={"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1,
                       "transposed": False}, module="conv")
    return Layer(index=0, name="conv", ops=[op], inputs=["x"], output="conv", module="conv")


def _median_slowest(fn, warmup, steps) -> float:
    """Median step time of the slowest rank."""
    import torch
    import torch.distributed as dist
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(ts)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _err(a, b) -> float:
    if a is None:
        return float("inf")
    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    return float((a.detach() - b).abs().max() / max(1.0, float(b.abs().max())))


def _data(shape):
    import torch
    n, c, h, w, f = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, w, generator=g)
    wt = torch.randn(f, c, 3, 3, generator=g) / (9 * c) ** 0.5
    bs = torch.randn(f, generator=g) * 0.1
    r = torch.randn(n, f, h, w, generator=g)
    return x, wt, bs, r


def _single(x, wt, bs, r, warmup, steps, timed=True):
    import torch.nn.functional as F
    xr, wr, br = x.clone().requires_grad_(), wt.clone().requires_grad_(), bs.clone().requires_grad_()
    out = {}

    def step():
        for t in (xr, wr, br):
            t.grad = None
        out["y"] = F.conv2d(xr, wr, br, 1, 1)
        (out["y"] * r).sum().backward()

    step()
    ref = (out["y"].detach(), xr.grad.clone(), wr.grad.clone())
    return ref, (_median_slowest(step, warmup, steps) if timed else None)


def _autopar(comm, shape, x, wt, bs, r, ref, warmup, steps):
    import torch
    import torch.distributed as dist

    import autopar.decomp.spatial  # noqa: F401
    from autopar.decomp.spatial import Spatial
    from autopar.runtime.comm import assemble, local_slice

    n, c, h, w, f = shape
    layer = _conv_layer(*shape)
    dec = Spatial(1, (1, 2))
    lay = dec.sharding()
    xl = local_slice(x, lay, comm).clone().requires_grad_()
    rl = local_slice(r, lay, comm)
    wa, ba = wt.clone().requires_grad_(), bs.clone().requires_grad_()
    out = {}

    def step():
        for t in (xl, wa, ba):
            t.grad = None
        y = dec.run(comm, layer, layer.ops[0], [xl], {"w": wa, "b": ba}, {})
        (y * rl).sum().backward()
        flat = torch.cat([wa.grad.reshape(-1), ba.grad.reshape(-1)])
        dist.all_reduce(flat)
        out["y"], out["dw"] = y, flat[:wa.numel()].reshape(wa.shape)

    step()
    err = max(_err(assemble(out["y"], lay, [n, f, h, w], comm, "value"), ref[0]),
              _err(assemble(xl.grad, lay, [n, c, h, w], comm, "sum"), ref[1]),
              _err(out["dw"], ref[2]))
    return {"err": err, "s": _median_slowest(step, warmup, steps)}


def _dtensor(variant, world, x, wt, bs, r, ref, warmup, steps):
    """One DTensor variant: what it does (placements, collectives), whether it is right, time."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world,))
    xd = distribute_tensor(x.clone(), mesh, [Shard(3)]).requires_grad_()
    wd = distribute_tensor(wt.clone(), mesh, [Replicate()]).requires_grad_()
    bd = distribute_tensor(bs.clone(), mesh, [Replicate()]).requires_grad_()
    rd = distribute_tensor(r, mesh, [Shard(3)])
    out: dict = {}
    res: dict = {}

    def fwd():
        if variant == "dtensor-gather":
            y = F.conv2d(xd.redistribute(mesh, [Replicate()]), wd, bd, 1, 1)
            return y.redistribute(mesh, [Shard(3)])
        return F.conv2d(xd, wd, bd, 1, 1)

    def step():
        for t in (xd, wd, bd):
            t.grad = None
        out["y"] = y = fwd()
        (y * rd).sum().backward()
        out["dw"] = wd.grad.full_tensor() if wd.grad is not None else None
        if bd.grad is not None:
            bd.grad.full_tensor()

    try:
        with CommDebugMode() as cdm:
            y = fwd()
    except Exception as e:
        res["error"] = f"forward: {e.__class__.__name__}: {str(e).splitlines()[0][:200]}"
        return res
    import torch.distributed as dist
    res["out"] = f"{[str(p) for p in y.placements]} local {list(y.to_local().shape)}"
    res["fwd_collectives"] = {str(k).split(".")[-1]: v for k, v in cdm.get_comm_counts().items()}
    # the values each rank holds, against its W block of the reference (the halo columns)
    res["local_fwd_err"] = _err(y.to_local(), ref[0].chunk(world, 3)[dist.get_rank()])
    try:
        res["fwd_err"] = _err(y.full_tensor(), ref[0])
    except Exception as e:
        res["error"] = f"output.full_tensor(): {e.__class__.__name__}: {str(e).splitlines()[0][:200]}"
        return res
    try:
        step()
        res["dx"] = "None (no input gradient)" if xd.grad is None else \
            str([str(p) for p in xd.grad.placements])
        res["err"] = max(res["fwd_err"], _err(xd.grad.full_tensor() if xd.grad is not None else None, ref[1]),
                         _err(out["dw"], ref[2]))
        res["s"] = _median_slowest(step, warmup, steps)
    except Exception as e:
        res["error"] = f"backward: {e.__class__.__name__}: {str(e).splitlines()[0][:200]}"
    return res


def _rank(rank, world, shapes, warmup, steps, legacy):
    from autopar.runtime.comm import Comm

    if legacy:
        import torch
        from torch.distributed.tensor import DTensor
        prop = DTensor._op_dispatcher.sharding_propagator
        for op in (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default):
            prop.op_single_dim_strategy_funcs.pop(op, None)
    comm = Comm(rank, world)
    results = []
    for shape in shapes:
        x, wt, bs, r = _data(shape)
        ref, single_s = _single(x, wt, bs, r, warmup, steps, timed=not legacy)
        res = {"shape": list(shape)}
        if legacy:
            res["dtensor-legacy"] = _dtensor("dtensor-legacy", world, x, wt, bs, r, ref, warmup, steps)
        else:
            res["single"] = {"s": single_s, "err": 0.0}
            res["autopar"] = _autopar(comm, shape, x, wt, bs, r, ref, warmup, steps)
            for v in ("dtensor", "dtensor-gather"):
                res[v] = _dtensor(v, world, x, wt, bs, r, ref, warmup, steps)
        results.append(res)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    from autopar.runtime.launch import run_ranks
    world = 2
    main_res = run_ranks(_rank, world, args=(SHAPES, args.warmup, args.steps, False), timeout_s=900)[0]
    legacy = run_ranks(_rank, world, args=(SHAPES, args.warmup, args.steps, True), timeout_s=900)[0]
    for a, b in zip(main_res, legacy):
        a.update({k: v for k, v in b.items() if k != "shape"})
    print(f"world {world}, gloo, CPU ({os.cpu_count()} cores), torch {torch.__version__}; 3x3 conv, "
          f"padding 1, activations split on W; fwd+bwd+weight-grad sync, median of {args.steps} "
          f"steps, slowest rank; ratio = variant / autopar (> 1: autopar faster)")
    for r in main_res:
        print(f"\nN,C,H,W,F = {','.join(map(str, r['shape']))}")
        ap_s = r["autopar"]["s"]
        for v in ("single", "autopar", "dtensor", "dtensor-legacy", "dtensor-gather"):
            d = r[v]
            right = d.get("err", float("inf")) <= TOL
            if "s" in d and right:
                line = f"{d['s'] * 1e3:9.1f} ms  ratio {d['s'] / ap_s:5.2f}  max rel err {d['err']:.1e}"
            elif "s" in d:
                line = (f"{d['s'] * 1e3:9.1f} ms  (ratio {d['s'] / ap_s:.2f} not comparable: WRONG, max "
                        f"rel err {d['err']:.1e})")
            else:
                line = f"{'-':>9}     (no ratio: FAILED)"
            notes = []
            if "out" in d:
                notes.append(f"out {d['out']}")
            if "local_fwd_err" in d:
                notes.append(f"local block err {d['local_fwd_err']:.1e}")
            if "fwd_err" in d:
                notes.append(f"fwd err {d['fwd_err']:.1e}")
            if "fwd_collectives" in d:
                notes.append(f"fwd collectives {d['fwd_collectives'] or 'none (p2p not counted)'}")
            if "dx" in d:
                notes.append(f"dx {d['dx']}")
            if "error" in d:
                notes.append(d["error"])
            print(f"  {v:<15}{line}" + (f"\n  {'':<15}" + "; ".join(notes) if notes else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(main_res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
