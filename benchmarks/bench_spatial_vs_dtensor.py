"""Measured: autopar's spatial convolution vs DTensor's convolution, activations split on W.

At world 2 (gloo, CPU, one set of forked ranks) and for each 3x3 "same" convolution shape below,
one training step of one layer -- forward, loss ``sum(y * R)``, backward, weight-gradient
SUM-allreduce -- is timed (median of ``--steps`` after ``--warmup``, the slowest rank) under:

  autopar   ``Spatial(1, (1, 2))``: the local block, halo exchange (``autopar.runtime.halo``),
            local conv on the window; weight/bias grads allreduced (``dist.all_reduce``)
  dtensor   ``torch.distributed.tensor``: x = distribute_tensor(x, mesh, [Shard(3)]), weight
            and bias [Replicate()], ``F.conv2d`` (DTensor's ``tp_convolution`` halo handler),
            weight grads made whole with ``.full_tensor()``
  single    one process on the whole tensor (rank 0, no communication), for scale

Each distributed result is checked against the single-process one (output, input gradient,
weight gradient); a failure or a silently wrong gradient is reported as such, not hidden. The
ratio printed is dtensor / autopar step time (> 1: autopar faster).

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


def _conv_layer(n, c, h, w, f):
    from autopar.decomp.ir import CONV, Layer, OpSpec
    out = [n, f, h, w]
    op = OpSpec(name="conv", kind=CONV, target="aten.conv2d.default",
                args=[{"v": "x"}, {"p": "w"}, {"p": "b"}, [1, 1], [1, 1], [1, 1], 1], kwargs={},
                out_shape=out, dtype="float32", inputs=["x"], in_shapes=[[n, c, h, w]],
                params={"weight": [f, c, 3, 3], "bias": [f]}, param_names={"weight": "w", "bias": "b"},
                attrs={"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1,
                       "transposed": False}, module="conv")
    return Layer(index=0, name="conv", ops=[op], inputs=["x"], output="conv", module="conv")


def _time(fn, warmup, steps):
    import torch.distributed as dist
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def _max_err(a, b):
    if a is None or b is None:
        return float("inf")
    return float((a - b).abs().max() / max(1.0, float(b.abs().max())))


def _rank(rank, world, shapes, warmup, steps):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import autopar.decomp.spatial  # noqa: F401
    from autopar.decomp.spatial import Spatial
    from autopar.runtime.comm import Comm, assemble, local_slice

    comm = Comm(rank, world)
    results = []
    for (n, c, h, w, f) in shapes:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, c, h, w, generator=g)
        wt = torch.randn(f, c, 3, 3, generator=g) / (9 * c) ** 0.5
        bs = torch.randn(f, generator=g) * 0.1
        r = torch.randn(n, f, h, w, generator=g)
        res = {"shape": [n, c, h, w, f]}

        # ---- single process (reference and scale) ----------------------------------------
        xr, wr, br = x.clone().requires_grad_(), wt.clone().requires_grad_(), bs.clone().requires_grad_()

        def single():
            for t in (xr, wr, br):
                t.grad = None
            y = F.conv2d(xr, wr, br, 1, 1)
            (y * r).sum().backward()
            return y

        y_ref = single()
        ref = (y_ref.detach(), xr.grad.clone(), wr.grad.clone())
        res["single_s"] = statistics.median(_time(single, warmup, steps))  # both ranks, one core each

        # ---- autopar spatial -----------------------------------------------------------------
        layer = _conv_layer(n, c, h, w, f)
        dec = Spatial(1, (1, 2))
        lay = dec.layout()
        xl = local_slice(x, lay, comm).clone().requires_grad_()
        rl = local_slice(r, lay, comm)
        wa, ba = wt.clone().requires_grad_(), bs.clone().requires_grad_()
        out = {}

        def autopar_step():
            for t in (xl, wa, ba):
                t.grad = None
            y = dec.run(comm, layer, layer.ops[0], [xl], {"w": wa, "b": ba}, {})
            (y * rl).sum().backward()
            flat = torch.cat([wa.grad.reshape(-1), ba.grad.reshape(-1)])
            dist.all_reduce(flat)
            out["y"], out["dw"] = y, flat[:wa.numel()].reshape(wa.shape)

        autopar_step()
        res["autopar_err"] = max(
            _max_err(assemble(out["y"], lay, [n, f, h, w], comm, "value"), ref[0]),
            _max_err(assemble(xl.grad, lay, [n, c, h, w], comm, "sum"), ref[1]),
            _max_err(out["dw"], ref[2]))
        res["autopar_s"] = max(_gather_max(_time(autopar_step, warmup, steps)))

        # ---- DTensor -------------------------------------------------------------------------
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor
            from torch.distributed.tensor.debug import CommDebugMode

            mesh = init_device_mesh("cpu", (world,))
            xd = distribute_tensor(x.clone(), mesh, [Shard(3)]).requires_grad_()
            wd = distribute_tensor(wt.clone(), mesh, [Replicate()]).requires_grad_()
            bd = distribute_tensor(bs.clone(), mesh, [Replicate()]).requires_grad_()
            rd = distribute_tensor(r, mesh, [Shard(3)])
            dout = {}

            def dtensor_step():
                for t in (xd, wd, bd):
                    t.grad = None
                y = F.conv2d(xd, wd, bd, 1, 1)
                (y * rd).sum().backward()
                dout["y"] = y
                dout["dw"] = wd.grad.full_tensor() if wd.grad is not None else None
                bd.grad.full_tensor() if bd.grad is not None else None

            with CommDebugMode() as cdm:
                dtensor_step()
            res["dtensor_collectives"] = {str(k): v for k, v in cdm.get_comm_counts().items()}
            y_pl = [str(p) for p in dout["y"].placements]
            res["dtensor_out_placements"] = y_pl
            xg = xd.grad
            res["dtensor_dx"] = "None" if xg is None else str([str(p) for p in xg.placements])
            res["dtensor_err"] = max(
                _max_err(dout["y"].full_tensor(), ref[0]),
                _max_err(xg.full_tensor() if xg is not None else None, ref[1]),
                _max_err(dout["dw"], ref[2]))
            res["dtensor_s"] = max(_gather_max(_time(dtensor_step, warmup, steps)))
        except Exception as e:  # report what DTensor does, do not hide it
            res["dtensor_error"] = f"{e.__class__.__name__}: {str(e).splitlines()[0][:300]}"
        results.append(res)
    return results


def _gather_max(ts):
    """Median step time of the slowest rank (all ranks get the same list)."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([statistics.median(ts)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(t)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from autopar.runtime.launch import run_ranks
    import torch
    world = 2
    res = run_ranks(_rank, world, args=(SHAPES, args.warmup, args.steps), timeout_s=900)[0]
    print(f"world {world}, gloo, CPU ({os.cpu_count()} cores), torch {torch.__version__}; "
          f"3x3 conv, padding 1, activations split on W; median of {args.steps} steps, slowest rank")
    print(f"{'N,C,H,W,F':>20} {'single ms':>10} {'autopar ms':>11} {'dtensor ms':>11} {'dt/ap':>7}  "
          f"{'ap err':>8} {'dt err':>8}  dtensor notes")
    for r in res:
        shp = ",".join(map(str, r["shape"]))
        ap_ms = r["autopar_s"] * 1e3
        if "dtensor_error" in r:
            print(f"{shp:>20} {r['single_s'] * 1e3:10.1f} {ap_ms:11.1f} {'failed':>11} {'-':>7}  "
                  f"{r['autopar_err']:8.1e} {'-':>8}  {r['dtensor_error']}")
            continue
        dt_ms = r["dtensor_s"] * 1e3
        note = (f"out {r['dtensor_out_placements']}, dx {r['dtensor_dx']}, "
                f"collectives {r['dtensor_collectives'] or 'none counted'}")
        if r["dtensor_err"] > 1e-4:
            note = "WRONG RESULT; " + note
        print(f"{shp:>20} {r['single_s'] * 1e3:10.1f} {ap_ms:11.1f} {dt_ms:11.1f} {dt_ms / ap_ms:7.2f}  "
              f"{r['autopar_err']:8.1e} {r['dtensor_err']:8.1e}  {note}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
