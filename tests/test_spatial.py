"""Spatial / hybrid sample x spatial decomposition against one process, with real gloo ranks.

Each case is a small layer (a chain of ops on one input ``x``) built on every rank from the same
seed. The single-process reference uses torch.nn.functional on the full tensors. The
distributed run slices ``x`` by the layer's input layout, runs every op through
``Spatial.run`` on local blocks, takes the local loss share ``sum(y_r * R_r) / replicas`` (R a
fixed random tensor, so that the shares add up to ``sum(y * R)``), back-propagates,
SUM-allreduces the weight gradients over the world, and compares: output (assembled by value),
input gradient (assembled by sum), every weight gradient, and batch-norm running statistics.

Tolerance (float32): |dist - ref| <= RTOL * |ref| + ATOL * max(1, max|ref|) elementwise.

All cases of one world size run in one set of processes (process start dominates on 2 cores);
``results_w2`` / ``results_w4`` run them once per module, each case is then one test.
"""

from __future__ import annotations

import pytest

import autopar.decomp.spatial  # noqa: F401  (registration; the integrator adds it to decomp/__init__)

pytestmark = pytest.mark.dist

RTOL = 1e-5
ATOL = 1e-6


def conv(cout, k, s=1, d=1, pad=None, groups=1, bias=True):
    if pad is None:
        pad = d * (k - 1) // 2
    return ("conv", dict(cout=cout, k=k, s=s, d=d, pad=pad, groups=groups, bias=bias))


def case(cid, dec, x, ops, seed=0):
    return dict(id=cid, dec=dec, x=x, ops=ops, seed=seed)


def _conv_grid(dec, x, tag):
    out = []
    for k in (1, 3, 5):
        for s in (1, 2):
            for d in ((1,) if k == 1 else (1, 2)):
                out.append(case(f"{tag}-k{k}s{s}d{d}", dec, x, [conv(4, k, s, d)]))
    return out


# ---- world 2 --------------------------------------------------------------------------------
X2 = [2, 3, 11, 10]       # odd extents: uneven blocks everywhere
BN = ("bn", dict(training=True))
RELU = ("relu", {})
CASES_W2 = (
    _conv_grid((1, (2, 1)), X2, "H2")
    + _conv_grid((1, (1, 2)), X2, "W2")
    + [
        case("H2-valid-k3s2", (1, (2, 1)), X2, [conv(4, 3, 2, pad=0)]),
        case("W2-even-k2s2", (1, (1, 2)), [2, 3, 9, 11], [conv(4, 2, 2, pad=0)]),
        case("W2-even-k4-same", (1, (1, 2)), X2, [conv(4, 4, 1, pad="same")]),
        case("H2-groups2-k3", (1, (2, 1)), [2, 4, 10, 9], [conv(6, 3, 1, groups=2)]),
        case("H2-k3-nobias-pad2", (1, (2, 1)), X2, [conv(4, 3, 1, pad=2, bias=False)]),
        case("L2-conv1d-k3", (1, (2,)), [2, 3, 13], [conv(4, 3)]),
        case("D2-conv3d-k3", (1, (2, 1, 1)), [2, 2, 7, 5, 6], [conv(3, 3)]),
        case("W2-conv3d-k3s2", (1, (1, 1, 2)), [2, 2, 5, 6, 9], [conv(3, 3, 2)]),
        case("H2-conv-bn-relu", (1, (2, 1)), X2, [conv(4, 3, bias=False), BN, RELU]),
        case("W2-bn-eval", (1, (1, 2)), X2, [conv(4, 3), ("bn", dict(training=False))]),
        case("H2-maxpool-k3s2p1", (1, (2, 1)), X2, [conv(4, 3), ("maxpool", dict(k=3, s=2, p=1))]),
        case("W2-maxpool-k2s2", (1, (1, 2)), [2, 3, 8, 11], [("maxpool", dict(k=2, s=2, p=0))]),
        case("W2-maxpool-k3s1p1d2", (1, (1, 2)), X2, [("maxpool", dict(k=3, s=1, p=1, d=2))]),
        case("H2-avgpool-k3s2p1-ceil-nopad", (1, (2, 1)), X2,
             [("avgpool", dict(k=3, s=2, p=1, ceil=True, cip=False))]),
        case("W2-avgpool-k3s1p1", (1, (1, 2)), X2, [("avgpool", dict(k=3, s=1, p=1, ceil=False, cip=True))]),
        case("W2-avgpool-k2s2-ceil", (1, (1, 2)), X2,
             [("avgpool", dict(k=2, s=2, p=0, ceil=True, cip=True))]),
        case("W2-residual", (1, (1, 2)), X2, [conv(3, 3), ("relu", {}), ("add_input", {}), ("relu", {})]),
        case("H2-gap", (1, (2, 1)), X2, [conv(4, 3), ("relu", {}), ("gap", {})]),
        case("W2-mean", (1, (1, 2)), X2, [conv(4, 3), ("mean", dict(keepdim=False))]),
        case("H2-dropout0", (1, (2, 1)), X2, [conv(4, 3), ("dropout0", {})]),
    ]
)

# ---- world 4 --------------------------------------------------------------------------------
X4 = [2, 3, 13, 11]
X3D = [2, 2, 7, 9, 6]
CASES_W4 = [
    case("HW22-k3s1d1", (1, (2, 2)), X4, [conv(4, 3)]),
    case("HW22-k5s2d1", (1, (2, 2)), X4, [conv(4, 5, 2)]),
    case("HW22-k3s1d2", (1, (2, 2)), X4, [conv(4, 3, 1, 2)]),
    case("HW22-k1s2", (1, (2, 2)), X4, [conv(4, 1, 2)]),
    case("HW22-k5s1d2", (1, (2, 2)), [2, 3, 17, 15], [conv(4, 5, 1, 2)]),
    case("H4-k3s1", (1, (4, 1)), X4, [conv(4, 3)]),
    case("H4-k5s2", (1, (4, 1)), [2, 3, 17, 8], [conv(4, 5, 2)]),
    case("W4-k3d2", (1, (1, 4)), [2, 3, 7, 17], [conv(4, 3, 1, 2)]),
    case("L4-conv1d-k5", (1, (4,)), [2, 3, 23], [conv(4, 5)]),
    case("N2H2-k3", (2, (2, 1)), X4, [conv(4, 3)]),
    case("N2W2-k3s2", (2, (1, 2)), X4, [conv(4, 3, 2)]),
    case("N2W2-k5d2", (2, (1, 2)), [4, 3, 9, 14], [conv(4, 5, 1, 2)]),
    case("DH22-conv3d-k3", (1, (2, 2, 1)), X3D, [conv(3, 3)]),
    case("HW22-conv3d-k3s2", (1, (1, 2, 2)), X3D, [conv(3, 3, 2)]),
    case("DW22-conv3d-k3d2", (1, (2, 1, 2)), [2, 2, 9, 5, 10], [conv(3, 3, 1, 2)]),
    case("N2D2-conv3d-k3", (2, (2, 1, 1)), X3D, [conv(3, 3)]),
    case("HW22-conv-bn-relu", (1, (2, 2)), X4, [conv(4, 3, bias=False), BN, RELU]),
    case("N2W2-conv-bn-relu", (2, (1, 2)), X4, [conv(4, 3, bias=False), BN, RELU]),
    case("DH22-conv3d-bn", (1, (2, 2, 1)), X3D, [conv(3, 3, bias=False), ("bn", dict(training=True))]),
    case("HW22-maxpool-k3s2p1", (1, (2, 2)), X4, [conv(4, 3), ("maxpool", dict(k=3, s=2, p=1))]),
    case("HW22-avgpool-k3s2p1-ceil-nopad", (1, (2, 2)), X4,
         [("avgpool", dict(k=3, s=2, p=1, ceil=True, cip=False))]),
    case("N2H2-avgpool-k2s2", (2, (2, 1)), X4, [("avgpool", dict(k=2, s=2, p=0, ceil=False, cip=True))]),
    case("DH22-maxpool3d-k3s2p1", (1, (2, 2, 1)), X3D, [("maxpool", dict(k=3, s=2, p=1))]),
    case("HW22-residual", (1, (2, 2)), X4, [conv(3, 3, bias=False), BN, ("add_input", {}), RELU]),
    case("HW22-gap", (1, (2, 2)), X4, [conv(4, 3), ("relu", {}), ("gap", {})]),
    case("N2H2-gap", (2, (2, 1)), X4, [conv(4, 3), ("gap", {})]),
    case("N2W2-mean-keepdim", (2, (1, 2)), X4, [conv(4, 3), ("mean", dict(keepdim=True))]),
    case("HW22-gap-bn-after", (1, (2, 2)), X4, [conv(4, 3, bias=False), ("gap", {}), BN]),
    case("N2H2-gap-bn-after", (2, (2, 1)), [4, 3, 9, 8], [conv(4, 3, bias=False), ("gap", {}), BN]),
    case("L4-maxpool1d-k3s2p1", (1, (4,)), [2, 3, 19], [("maxpool", dict(k=3, s=2, p=1))]),
    case("L4-avgpool1d-k3s2p1-nopad", (1, (4,)), [2, 3, 19],
         [("avgpool", dict(k=3, s=2, p=1, ceil=True, cip=False))]),
]


# ---------------------------------------------------------------------------------------------
# building a layer and its reference (runs inside the rank processes)
# ---------------------------------------------------------------------------------------------
def _build(c):
    """(Layer, full params, full buffers, reference fn(x, params, buffers) -> y)."""
    import torch
    import torch.nn.functional as F

    from autopar.decomp.ir import (ADAPTIVE_POOL, BATCH_NORM, BINARY, CONV, DROPOUT, MEAN, POOL,
                                   UNARY, Layer, OpSpec)

    g = torch.Generator().manual_seed(1000 + c["seed"])
    x_shape = list(c["x"])
    k = len(x_shape) - 2
    params, buffers, ops, steps = {}, {}, [], []
    cur, cur_shape = "x", x_shape
    meta = torch.zeros(x_shape, device="meta")

    def add(kind, target, args, attrs, fn, pnames=None, pshapes=None, bnames=None, extra_in=()):
        nonlocal cur, cur_shape, meta
        name = f"op{len(ops)}"
        out = meta if fn is None else fn(
            meta, {q: torch.zeros(s, device="meta") for q, s in (pshapes or {}).items()},
            {q: torch.zeros(s, device="meta") for q, s in buffers_shapes(bnames)})
        ins = [cur] + list(extra_in)
        in_shapes = [cur_shape] + [x_shape for _ in extra_in]
        ops.append(OpSpec(name=name, kind=kind, target=target, args=args, kwargs={},
                          out_shape=list(out.shape), dtype="float32", inputs=ins, in_shapes=in_shapes,
                          params={r: list(pshapes[q]) for r, q in (pnames or {}).items()},
                          param_names=dict(pnames or {}), buffers=dict(bnames or {}), attrs=attrs,
                          module=f"m.{name}"))
        steps.append(fn)
        cur, cur_shape, meta = name, list(out.shape), out

    def buffers_shapes(bnames):
        return [(q, buffers[q].shape) for q in (bnames or {}).values()]

    for kind, a in c["ops"]:
        i = len(ops)
        if kind == "conv":
            cin = cur_shape[1]
            w_shape = [a["cout"], cin // a["groups"]] + [a["k"]] * k
            fan = (cin // a["groups"]) * a["k"] ** k
            wq, bq = f"m.{i}.weight", f"m.{i}.bias"
            params[wq] = torch.randn(w_shape, generator=g) / fan ** 0.5
            pn, ps = {"weight": wq}, {wq: w_shape}
            if a["bias"]:
                params[bq] = torch.randn([a["cout"]], generator=g) * 0.1
                pn["bias"], ps[bq] = bq, [a["cout"]]
            pad = a["pad"] if isinstance(a["pad"], str) else [a["pad"]] * k
            attrs = {"stride": [a["s"]] * k, "padding": pad, "dilation": [a["d"]] * k,
                     "groups": a["groups"], "transposed": False}
            fconv = (F.conv1d, F.conv2d, F.conv3d)[k - 1]
            fn = (lambda x, p, b, wq=wq, bq=bq, a=a, pad=pad, fconv=fconv:
                  fconv(x, p[wq], p.get(bq), a["s"], pad, a["d"], a["groups"]))
            add(CONV, f"aten.conv{k}d.default",
                [{"v": cur}, {"p": wq}, {"p": bq} if a["bias"] else None, attrs["stride"], pad,
                 attrs["dilation"], a["groups"]], attrs, fn, pn, ps)
        elif kind == "bn":
            ch = cur_shape[1]
            wq, bq, mq, vq = (f"m.{i}.{n}" for n in ("weight", "bias", "running_mean", "running_var"))
            params[wq] = 1.0 + 0.1 * torch.randn([ch], generator=g)
            params[bq] = 0.1 * torch.randn([ch], generator=g)
            buffers[mq] = 0.1 * torch.randn([ch], generator=g)
            buffers[vq] = 1.0 + 0.1 * torch.rand([ch], generator=g)
            tr = a["training"]
            fn = (lambda x, p, b, wq=wq, bq=bq, mq=mq, vq=vq, tr=tr:
                  F.batch_norm(x, b[mq], b[vq], p[wq], p[bq], tr, 0.1, 1e-5))
            add(BATCH_NORM, "aten.batch_norm.default",
                [{"v": cur}, {"p": wq}, {"p": bq}, {"b": mq}, {"b": vq}, tr, 0.1, 1e-5, False],
                {"training": tr, "momentum": 0.1, "eps": 1e-5}, fn,
                {"weight": wq, "bias": bq}, {wq: [ch], bq: [ch]}, {"running_mean": mq, "running_var": vq})
        elif kind == "relu":
            add(UNARY, "aten.relu.default", [{"v": cur}], {}, lambda x, p, b: F.relu(x))
        elif kind == "dropout0":
            add(DROPOUT, "aten.dropout.default", [{"v": cur}, 0.0, True], {"p": 0.0, "train": True},
                lambda x, p, b: F.dropout(x, 0.0, True))
        elif kind == "add_input":
            add(BINARY, "aten.add.Tensor", [{"v": cur}, {"v": "x"}], {}, None, extra_in=("x",))
        elif kind in ("maxpool", "avgpool"):
            kk, s, p = [a["k"]] * k, [a["s"]] * k, [a["p"]] * k
            if kind == "maxpool":
                d = [a.get("d", 1)] * k
                mp = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[k - 1]
                fn = lambda x, pp, b, kk=kk, s=s, p=p, d=d, mp=mp: mp(x, kk, s, p, d, False)  # noqa: E731
                add(POOL, f"aten.max_pool{k}d.default", [{"v": cur}, kk, s, p, d, False],
                    {"pool": "max", "kernel": kk, "stride": s, "padding": p, "dilation": d,
                     "ceil_mode": False}, fn)
            else:
                ap = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[k - 1]
                fn = (lambda x, pp, b, kk=kk, s=s, p=p, a=a, ap=ap:
                      ap(x, kk, s, p, a["ceil"], a["cip"]))
                add(POOL, f"aten.avg_pool{k}d.default", [{"v": cur}, kk, s, p, a["ceil"], a["cip"]],
                    {"pool": "avg", "kernel": kk, "stride": s, "padding": p, "dilation": [1] * k,
                     "ceil_mode": a["ceil"], "count_include_pad": a["cip"]}, fn)
        elif kind == "gap":
            aap = (F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)[k - 1]
            add(ADAPTIVE_POOL, f"aten.adaptive_avg_pool{k}d.default", [{"v": cur}, [1] * k],
                {"output_size": [1] * k, "pool": "avg"}, lambda x, p, b, aap=aap: aap(x, 1))
        elif kind == "mean":
            dims = list(range(2, 2 + k))
            kd = a["keepdim"]
            add(MEAN, "aten.mean.dim", [{"v": cur}, dims, kd], {"dims": dims, "keepdim": kd},
                lambda x, p, b, dims=dims, kd=kd: x.mean(dims, keepdim=kd))
        else:
            raise ValueError(kind)
    layer = Layer(index=0, name=ops[0].name, ops=ops, inputs=["x"], output=ops[-1].name, module="m")

    def reference(x, p, b):
        vals = {"x": x}
        y = x
        for op, fn in zip(ops, steps):
            y = vals[op.inputs[0]] + vals["x"] if fn is None else fn(vals[op.inputs[0]], p, b)
            vals[op.name] = y
        return y

    return layer, params, buffers, reference


def _run_case(c, comm):
    import torch
    import torch.distributed as dist

    from autopar.decomp.base import CostContext
    from autopar.decomp.spatial import Spatial
    from autopar.runtime.comm import assemble, local_slice

    layer, params, buffers, reference = _build(c)
    dec = Spatial(c["dec"][0], tuple(c["dec"][1]))
    why = dec.check(layer, CostContext(profile=None, world=comm.world, ranks_per_node=comm.world))
    if why:
        return {"error": f"check rejected a legal case: {why}"}
    comm.ensure_partitions(dec.partitions(layer, comm.world))

    g = torch.Generator().manual_seed(2000 + c["seed"])
    x = torch.randn(c["x"], generator=g)
    out_shape = layer.out_shape
    r = torch.randn(out_shape, generator=g)

    # reference
    xr = x.clone().requires_grad_(True)
    pr = {q: t.clone().requires_grad_(True) for q, t in params.items()}
    br = {q: t.clone() for q, t in buffers.items()}
    y_ref = reference(xr, pr, br)
    (y_ref * r).sum().backward()

    # distributed
    in_lay, out_lay = dec.in_placement(layer, "x"), dec.out_placement(layer)
    xl = local_slice(x, in_lay, comm).clone().requires_grad_(True)
    pd = {q: t.clone().requires_grad_(True) for q, t in params.items()}
    bd = {q: t.clone() for q, t in buffers.items()}
    vals = {"x": xl}
    for op in layer.ops:
        vals[op.name] = dec.run(comm, layer, op, [vals[v] for v in op.inputs],
                                {q: pd[q] for q in op.param_names.values()},
                                {q: bd[q] for q in op.buffers.values()})
    yl = vals[layer.output]
    rl = local_slice(r, out_lay, comm)
    if tuple(yl.shape) != tuple(rl.shape):
        return {"error": f"local output {tuple(yl.shape)} != expected block {tuple(rl.shape)}"}
    ((yl * rl).sum() / out_lay.replicas(comm.world)).backward()
    for t in pd.values():
        dist.all_reduce(t.grad)

    errs = {}

    def cmp(name, got, ref):
        ref = ref.detach()
        tol = RTOL * ref.abs() + ATOL * max(1.0, float(ref.abs().max()) if ref.numel() else 1.0)
        errs[name] = float(((got.detach() - ref).abs() / tol).max()) if ref.numel() else 0.0

    cmp("y", assemble(yl, out_lay, out_shape, comm, "value"), y_ref)
    cmp("dx", assemble(xl.grad, in_lay, c["x"], comm, "sum"), xr.grad)
    for q in params:
        cmp(f"d[{q}]", pd[q].grad, pr[q].grad)
    for q in buffers:
        cmp(f"buf[{q}]", bd[q], br[q])
    return errs


def _worker(rank, world, cases):
    from autopar.runtime.comm import Comm

    comm = Comm(rank, world)
    out = {}
    for c in cases:
        try:
            out[c["id"]] = _run_case(c, comm)
        except Exception as e:  # a Python error before any communication: report it per case
            import traceback
            out[c["id"]] = {"error": f"{e.__class__.__name__}: {e}\n{traceback.format_exc(limit=4)}"}
    return out


def _run_world(world, cases):
    from autopar.runtime.launch import run_ranks
    return run_ranks(_worker, world, args=(cases,), timeout_s=240)


@pytest.fixture(scope="module")
def results_w2():
    return _run_world(2, CASES_W2)


@pytest.fixture(scope="module")
def results_w4():
    return _run_world(4, CASES_W4)


def _assert_case(results, cid):
    for rank, res in enumerate(results):
        errs = res[cid]
        assert "error" not in errs, f"rank {rank}: {errs.get('error')}"
        bad = {k: v for k, v in errs.items() if v > 1.0}
        assert not bad, f"rank {rank}: error / tolerance > 1: {bad}"


@pytest.mark.parametrize("cid", [c["id"] for c in CASES_W2])
def test_world2(results_w2, cid):
    _assert_case(results_w2, cid)


@pytest.mark.parametrize("cid", [c["id"] for c in CASES_W4])
def test_world4(results_w4, cid):
    _assert_case(results_w4, cid)
