"""Pure-logic tests of the spatial decomposition: layouts, legality (with reasons), halo plans
(simulated exchange in one process), and the cost model (halo volume, links, monotonicity,
memory). No process group."""

from __future__ import annotations

import math

import pytest

import autopar.decomp.spatial  # noqa: F401  (registration)
from autopar.decomp.base import CostContext
from autopar.decomp.ir import (ADAPTIVE_POOL, BATCH_NORM, BINARY, CONV, DROPOUT, FLATTEN, MEAN,
                               POOL, UNARY, Layer, OpSpec)
from autopar.decomp.sharding import HaloShard, Sharding, Shard
from autopar.decomp.replicate import Replicate
from autopar.decomp.sample import Sample
from autopar.decomp.spatial import Spatial
from autopar.decomp.spatial.geometry import WindowGeom, axis_pieces, axis_problem, plan_halo, window_bounds

ALPHA, BETA = 1e-5, 1e-9          # p2p: alpha + n*beta (intra); inter: 10x


class FakeProfile:
    """The four methods the cost model calls, with round numbers."""

    def collective_time_s(self, kind, p, nbytes, level):
        f = 10.0 if level == "inter" else 1.0
        if kind == "p2p":
            return f * (ALPHA + nbytes * BETA)
        steps = math.ceil(math.log2(max(p, 2)))
        return f * (2 * steps * ALPHA + 2 * (p - 1) / p * nbytes * BETA)

    def kernel_time_s(self, op_class, flops, nbytes):
        return 1e-6 + flops * 1e-11 + nbytes * 1e-10

    def exact_time_s(self, key, phase):
        return None

    def slowdown(self, ranks_on_node):
        return 1.0


def ctx(world, ranks_per_node=64, **kw):
    return CostContext(profile=FakeProfile(), world=world, ranks_per_node=ranks_per_node, **kw)


# ---- hand-made ops ----------------------------------------------------------------------------
def conv_out(n, k, s, p, d=1):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def conv_op(name, x, cout, k, s=1, p=None, d=1, module=None, transposed=False):
    nsp = len(x) - 2
    p = d * (k - 1) // 2 if p is None else p
    out = [x[0], cout] + [conv_out(n, k, s, p, d) for n in x[2:]]
    w = [cout, x[1]] + [k] * nsp
    return OpSpec(name=name, kind=CONV, target=f"aten.conv{nsp}d.default",
                  args=[{"v": "x"}, {"p": f"{name}.weight"}, None, [s] * nsp, [p] * nsp, [d] * nsp, 1],
                  kwargs={}, out_shape=out, dtype="float32", inputs=["x"], in_shapes=[list(x)],
                  params={"weight": w}, param_names={"weight": f"{name}.weight"},
                  attrs={"stride": [s] * nsp, "padding": [p] * nsp, "dilation": [d] * nsp, "groups": 1,
                         "transposed": transposed},
                  module=module or name)


def follow(op, kind, name, out_shape=None, attrs=None, target="aten.relu.default", args=None,
           params=None, inputs=None, in_shapes=None):
    return OpSpec(name=name, kind=kind, target=target,
                  args=args if args is not None else [{"v": op.name}], kwargs={},
                  out_shape=list(out_shape or op.out_shape), dtype="float32",
                  inputs=inputs or [op.name], in_shapes=in_shapes or [list(op.out_shape)],
                  params=params or {}, param_names={r: f"{name}.{r}" for r in (params or {})},
                  attrs=attrs or {}, module=name)


def bn(op, name="bn"):
    c = op.out_shape[1]
    o = follow(op, BATCH_NORM, name, attrs={"training": True, "momentum": 0.1, "eps": 1e-5},
               target="aten.batch_norm.default", params={"weight": [c], "bias": [c]})
    return o


def layer(*ops, module=None):
    return Layer(index=0, name=ops[0].name, ops=list(ops), inputs=list(ops[0].inputs),
                 output=ops[-1].name, module=module if module is not None else ops[0].module)


# ---- layouts ---------------------------------------------------------------------------------
def test_layouts_and_out_layout_after_global_pooling():
    c = conv_op("c", [4, 8, 32, 32], 16, 3)
    gap = follow(c, ADAPTIVE_POOL, "gap", out_shape=[4, 16, 1, 1],
                 attrs={"output_size": [1, 1], "pool": "avg"}, target="aten.adaptive_avg_pool2d.default")
    mean = follow(c, MEAN, "mean", out_shape=[4, 16], attrs={"dims": [2, 3], "keepdim": False},
                  target="aten.mean.dim")
    d = Spatial(2, (2, 1))
    assert d.sharding() == Sharding.of((Shard(0), 2), (Shard(2), 2))
    assert Spatial(1, (1, 4)).sharding() == Sharding.of((Shard(3), 4))
    # the conv reads its input with a halo of 1 row each side of its H block (3x3, padding 1)
    assert d.in_placement(layer(c), "x") == Sharding.of((Shard(0), 2), (HaloShard(2, 1, 1), 2))
    assert d.in_placement(layer(c), "x").owned() == d.sharding()
    assert d.out_placement(layer(c)) == d.sharding()
    assert d.out_placement(layer(c, gap)) == Sharding.of((Shard(0), 2))
    assert d.out_placement(layer(c, mean)) == Sharding.of((Shard(0), 2))
    assert Spatial(1, (2, 2)).out_placement(layer(c, gap)) == Sharding()
    assert d.to_json() == {"kind": "spatial", "sample": 2, "spatial": [2, 1]}
    parts = Spatial(1, (2, 2)).partitions(layer(c, gap), 4)
    assert [[0, 1, 2, 3]] in parts


def test_residual_binary_keeps_both_inputs_in_the_spatial_layout():
    c = conv_op("c", [2, 8, 16, 16], 8, 3)
    add = follow(c, BINARY, "add", target="aten.add.Tensor", args=[{"v": "c"}, {"v": "x"}],
                 inputs=["c", "x"], in_shapes=[[2, 8, 16, 16], [2, 8, 16, 16]])
    d = Spatial(1, (2, 2))
    lay = layer(c, add)
    assert d.check(lay, ctx(4)) is None
    assert d.in_placement(lay, "x") == Sharding.of((HaloShard(2, 1, 1), 2), (HaloShard(3, 1, 1), 2))
    assert d.in_placement(lay, "x").owned() == d.sharding() and d.out_placement(lay) == d.sharding()


# ---- legality --------------------------------------------------------------------------------
def test_named_rejection_halo_radius_exceeds_neighbour_extent():
    c = conv_op("c", [2, 8, 24, 24], 8, 9, module="layer3.0.conv1")      # radius 4
    why = Spatial(1, (8, 1)).check(layer(c), ctx(8))
    assert why == "layer3.0.conv1: local H extent 3 < halo radius 4 at 8 parts"
    assert Spatial(1, (4, 1)).check(layer(c), ctx(4)) is None            # extent 6 >= 4
    why = Spatial(1, (1, 8)).check(layer(c), ctx(8))
    assert "local W extent 3 < halo radius 4 at 8 parts" in why


def test_uneven_blocks_checked_per_block():
    # H = 6 in 4 parts: blocks 2, 2, 1, 1; a 5x5 kernel needs 2 rows from the block below
    c = conv_op("c", [1, 2, 6, 8], 2, 5)
    why = Spatial(1, (4, 1)).check(layer(c), ctx(4))
    assert why and "local H extent 1 < halo radius 2 at 4 parts" in why
    assert Spatial(1, (3, 1)).check(layer(c), ctx(3)) is None


def test_rejections_with_reasons():
    x = [2, 8, 16, 16]
    c = conv_op("c", x, 8, 3)
    w4 = ctx(4)
    assert "!= world size 4" in Spatial(1, (2, 1)).check(layer(c), w4)
    assert "samples < 4 sample parts" in Spatial(4, (1, 1)).check(layer(c), w4)
    assert "extent 0" in Spatial(1, (1, 4)).check(layer(conv_op("c", [2, 8, 16, 3], 8, 1)), w4)
    assert "transposed" in Spatial(1, (2, 2)).check(layer(conv_op("c", x, 8, 3, transposed=True)), w4)
    assert "splits 3" in Spatial(1, (2, 1, 2)).check(layer(c), w4)
    drop = follow(c, DROPOUT, "drop", attrs={"p": 0.5, "train": True}, target="aten.dropout.default",
                  args=[{"v": "c"}, 0.5, True])
    assert "random" in Spatial(1, (2, 2)).check(layer(c, drop), w4)
    drop_eval = follow(c, DROPOUT, "drop", attrs={"p": 0.5, "train": False}, target="aten.dropout.default",
                       args=[{"v": "c"}, 0.5, False])
    assert Spatial(1, (2, 2)).check(layer(c, drop_eval), w4) is None
    ap2 = follow(c, ADAPTIVE_POOL, "ap", out_shape=[2, 8, 2, 2], attrs={"output_size": [2, 2], "pool": "avg"})
    assert "output size 1" in Spatial(1, (2, 2)).check(layer(c, ap2), w4)
    mean_c = follow(c, MEAN, "m", out_shape=[2, 16, 16], attrs={"dims": [1], "keepdim": False})
    assert "only the mean over every spatial dim" in Spatial(1, (2, 2)).check(layer(c, mean_c), w4)
    flat = follow(c, FLATTEN, "f", out_shape=[2, 8 * 256], attrs={"start_dim": 1, "end_dim": -1})
    assert "flatten" in Spatial(1, (2, 2)).check(layer(c, flat), w4)
    pos = follow(c, BINARY, "pos", target="aten.add.Tensor", args=[{"v": "c"}, {"p": "pos.pe"}],
                 params={"pe": [1, 8, 16, 16]})
    assert "spatial extent" in Spatial(1, (2, 2)).check(layer(c, pos), w4)
    scale = follow(c, BINARY, "scale", target="aten.mul.Tensor", args=[{"v": "c"}, {"p": "scale.s"}],
                   params={"s": [1, 8, 1, 1]})
    assert Spatial(1, (2, 2)).check(layer(c, scale), w4) is None


def test_stride_and_even_kernels_need_no_alignment():
    # k=2, s=2 on an odd extent: block 0 needs one element of block 1 (computed offset)
    c = conv_op("c", [1, 2, 9, 9], 2, 2, s=2, p=0)
    assert Spatial(1, (2, 1)).check(layer(c), ctx(2)) is None
    g = WindowGeom(n_in=9, n_out=4, pad_lo=0, stride=2, k_eff=2)
    assert window_bounds(g, 2, 0) == (0, 4) and window_bounds(g, 2, 1) == (4, 8)
    # blocks of 9 in 2: [0,5) [5,9): block 1 needs element 4 from block 0, trims element 8
    z_lo, lo, own_start, own_len, hi, z_hi, sends = axis_pieces(g, 2, 1)
    assert (z_lo, lo, own_start, own_len, hi, z_hi) == (0, 1, 0, 3, 0, 0)
    assert axis_pieces(g, 2, 0)[6] == ((1, 4, 1),)   # block 0 sends its element 4 to block 1
    assert axis_pieces(g, 2, 0)[:6] == (0, 0, 0, 4, 0, 0)   # needs nothing, trims its element 4
    assert axis_problem(WindowGeom(8, 8, 2, 1, 5), 8, "H") == "local H extent 1 < halo radius 2 at 8 parts"


def _simulate_windows(x_shape, layout, geoms, world):
    """Run every rank's halo plan in one process (messages matched by sender/receiver) and
    return each rank's window as nested index ranges (global coordinates, None = fill)."""
    import torch

    full = torch.arange(math.prod(x_shape), dtype=torch.float64).reshape(x_shape)
    plans = [plan_halo(tuple(x_shape), layout, geoms, r, world) for r in range(world)]
    cur = []
    for r in range(world):
        b = layout.local_bounds(x_shape, r, world)
        cur.append(full[tuple(slice(s, s + e) for s, e in b)].clone())
    for dim in sorted(d for d, _ in geoms):
        steps = {r: next((s for s in plans[r].steps if s.dim == dim), None) for r in range(world)}
        msgs = {}
        for r, st in steps.items():
            if st:
                for peer, start, n in st.sends:
                    msgs[(r, peer)] = cur[r].narrow(dim, start, n)
        new = []
        for r, st in steps.items():
            t = cur[r]
            if st is None:
                new.append(t)
                continue
            shp = list(t.shape)
            pieces = []
            if st.z_lo:
                shp[dim] = st.z_lo
                pieces.append(torch.full(shp, -1.0, dtype=t.dtype))
            if st.lo_len:
                pieces.append(msgs[(st.lo_peer, r)])
            if st.own_len:
                pieces.append(t.narrow(dim, st.own_start, st.own_len))
            if st.hi_len:
                pieces.append(msgs[(st.hi_peer, r)])
            if st.z_hi:
                shp = list(t.shape)
                shp[dim] = st.z_hi
                pieces.append(torch.full(shp, -1.0, dtype=t.dtype))
            new.append(torch.cat(pieces, dim))
        cur = new
    return full, plans, cur


@pytest.mark.parametrize("split,shape,k,s,d", [
    ((2, 2), [1, 2, 11, 10], 3, 1, 1), ((2, 2), [1, 1, 13, 11], 5, 2, 1),
    ((4, 1), [2, 1, 17, 5], 3, 1, 2), ((1, 3), [1, 1, 6, 14], 4, 2, 1),
    ((2, 2, 2), [1, 1, 7, 6, 9], 3, 1, 1), ((3, 1, 2), [1, 1, 10, 4, 7], 5, 2, 1),
])
def test_simulated_exchange_builds_the_padded_window_with_corners(split, shape, k, s, d):
    """Every rank's window (edges and corners included) equals the zero-padded global input
    restricted to the window its output block reads."""
    import torch

    world = math.prod(split)
    dec = Spatial(1, split)
    c = conv_op("c", shape, 1, k, s=s, d=d)
    geoms = dec.window_geoms(c)
    full, plans, windows = _simulate_windows(shape, dec.window_placement(c), geoms, world)
    pads = [(d * (k - 1)) // 2] * len(split)
    padded = torch.nn.functional.pad(full, [p for p in reversed(pads) for _ in (0, 1)], value=-1.0)
    axis_of = {dd: i for i, dd in enumerate(dec.sharding().shard_dims)}
    geo = dict(geoms)
    for r in range(world):
        cs, _ = dec.sharding().coords(r, world)
        idx = [slice(None), slice(None)]
        for dim in range(2, len(shape)):
            pad = pads[dim - 2]
            if dim in geo:
                ci = cs[axis_of[dim]] if dim in axis_of else 0
                a, b = window_bounds(geo[dim], split[dim - 2], ci)
                idx.append(slice(a + pad, b + pad))
            else:
                idx.append(slice(pad, pad + shape[dim]))
        assert torch.equal(windows[r], padded[tuple(idx)]), r
        assert tuple(windows[r].shape) == plans[r].window_shape


# ---- candidates ------------------------------------------------------------------------------
def test_candidates_balanced_and_single_dim_capped():
    c = conv_op("c", [8, 8, 64, 32], 8, 3)
    cands = Spatial.candidates(layer(c), ctx(8))
    strs = [str(x) for x in cands]
    assert all(x.sample * math.prod(x.spatial) == 8 for x in cands)
    assert "spatial(4,2x1)" in strs and "spatial(2,2x2)" in strs and "spatial(1,4x2)" in strs
    assert "spatial(4,1x2)" in strs and "spatial(1,8x1)" in strs and "spatial(1,1x8)" in strs
    assert len(set(strs)) == len(strs)
    assert len(Spatial.candidates(layer(c), ctx(8, max_candidates=3))) == 3
    c3 = conv_op("c", [1, 4, 32, 32, 32], 4, 3)
    strs3 = [str(x) for x in Spatial.candidates(layer(c3), ctx(8))]
    assert "spatial(1,2x2x2)" in strs3 and "spatial(1,8x1x1)" in strs3
    # legal ones first
    c_small = conv_op("c", [1, 4, 8, 8], 4, 3)
    got = Spatial.candidates(layer(c_small), ctx(16))
    ok = [x.check(layer(c_small), ctx(16)) is None for x in got]
    assert ok == sorted(ok, reverse=True)
    fl = follow(c, FLATTEN, "f", out_shape=[8, 8 * 64 * 32])
    assert all(x.check(layer(fl), ctx(8)) for x in Spatial.candidates(layer(fl), ctx(8)))
    relu2d = follow(fl, UNARY, "r")
    assert Spatial.candidates(layer(relu2d), ctx(8)) == []    # a 2-d input: nothing to split


# ---- cost ------------------------------------------------------------------------------------
def p2p(nbytes, level="intra"):
    return FakeProfile().collective_time_s("p2p", 2, nbytes, level)


def test_halo_volume_and_time_match_the_formula():
    n, ch, h, w = 4, 8, 32, 32
    c = conv_op("c", [n, ch, h, w], 16, 3)           # radius 1
    row = n * ch * 1 * w * 4                          # one halo row, bytes
    # 2 parts of H: each rank sends one row and receives one row
    cost = Spatial(1, (2, 1)).cost(layer(c), ctx(2))
    assert cost.fwd_comm_s == pytest.approx(p2p(row))
    assert cost.bwd_comm_s == pytest.approx(p2p(row))  # gradient halos: same volume back
    assert cost.workspace_bytes == 2 * row
    # 4 parts: interior ranks exchange with two neighbours
    cost4 = Spatial(1, (4, 1)).cost(layer(c), ctx(4))
    assert cost4.fwd_comm_s == pytest.approx(2 * p2p(row))
    # 2x2: H step (W block 16), then W step on the H window (16 + halo + zero row: corners travel)
    cost22 = Spatial(1, (2, 2)).cost(layer(c), ctx(4))
    assert cost22.fwd_comm_s == pytest.approx(p2p(n * ch * 16 * 4) + p2p(n * ch * 18 * 4))
    # radius 2 doubles the volume
    c5 = conv_op("c", [n, ch, h, w], 16, 5)
    assert Spatial(1, (2, 1)).cost(layer(c5), ctx(2)).fwd_comm_s == pytest.approx(p2p(2 * row))
    # sample x spatial: the halo carries N / p_N samples
    cost_h = Spatial(2, (2, 1)).cost(layer(c), ctx(4))
    assert cost_h.fwd_comm_s == pytest.approx(p2p(row // 2))


def test_halo_priced_on_the_link_between_the_neighbours():
    c = conv_op("c", [4, 8, 32, 32], 16, 3)
    intra = Spatial(1, (2, 1)).cost(layer(c), ctx(2, ranks_per_node=2))
    inter = Spatial(1, (2, 1)).cost(layer(c), ctx(2, ranks_per_node=1))
    assert inter.fwd_comm_s == pytest.approx(10 * intra.fwd_comm_s)
    # 2 samples x 2 H parts with 2 ranks per node: H neighbours (inner axis) share a node
    hyb = Spatial(2, (2, 1)).cost(layer(c), ctx(4, ranks_per_node=2))
    assert hyb.fwd_comm_s == pytest.approx(p2p(2 * 8 * 32 * 4, "intra"))


def test_compute_on_the_window_shape_with_local_padding():
    c = conv_op("c", [4, 8, 32, 32], 16, 3)
    dec = Spatial(1, (2, 1))
    lays = dec.value_layouts(layer(c))
    ins, out = dec._local_shapes(c, lays)
    assert ins[0] == [4, 8, 18, 32] and out == [4, 16, 16, 32]   # 16 + halo row + zero row
    assert dec.native_padding(c) == [0, 1]
    assert Spatial(1, (2, 2)).native_padding(c) == [0, 0]
    s2 = conv_op("c", [4, 8, 32, 32], 16, 3, s=2)
    ins, out = dec._local_shapes(s2, dec.value_layouts(layer(s2)))
    assert ins[0] == [4, 8, 17, 32] and out == [4, 16, 8, 16]


def test_monotonicity():
    x = [2, 16, 64, 64]
    halo = [Spatial(1, (2, 2)).cost(layer(conv_op("c", x, 16, k)), ctx(4)).fwd_comm_s for k in (1, 3, 5, 7)]
    assert halo[0] == 0.0 and halo[1] < halo[2] < halo[3]
    cost = [Spatial(1, (p, 1)).cost(layer(conv_op("c", x, 16, 3)), ctx(p)) for p in (2, 4, 8)]
    assert cost[0].fwd_compute_s > cost[1].fwd_compute_s > cost[2].fwd_compute_s
    assert cost[0].activation_bytes > cost[1].activation_bytes > cost[2].activation_bytes
    assert cost[0].fwd_comm_s < cost[1].fwd_comm_s         # interior ranks: two neighbours
    assert cost[0].grad_sync_s < cost[2].grad_sync_s        # weights allreduced over the world


def test_spatial_cheaper_in_memory_than_sample_for_huge_samples():
    x = [1, 4, 512, 512]
    c = conv_op("c", x, 16, 3)
    lay = layer(c, bn(c), follow(bn(c), UNARY, "relu", inputs=["bn"]))
    assert Sample(4).check(lay, ctx(4)) is not None        # 1 sample cannot be split 4 ways
    rep = Replicate().cost(lay, ctx(4))
    sp = Spatial(1, (2, 2)).cost(lay, ctx(4))
    assert sp.activation_bytes < 0.3 * rep.activation_bytes
    assert sp.memory_bytes < 0.3 * rep.memory_bytes
    x2 = [2, 4, 512, 512]
    c2 = conv_op("c", x2, 16, 3)
    smp = Sample(2).cost(layer(c2), ctx(4))                  # 2 replicas of each sample
    for d in (Spatial(1, (2, 2)), Spatial(2, (2, 1))):
        assert d.cost(layer(c2), ctx(4)).activation_bytes < 0.6 * smp.activation_bytes


def test_batch_norm_and_global_pooling_collectives_are_priced():
    c = conv_op("c", [4, 8, 32, 32], 16, 3)
    b = bn(c)
    plain = Spatial(1, (2, 2)).cost(layer(c), ctx(4))
    with_bn = Spatial(1, (2, 2)).cost(layer(c, b), ctx(4))
    assert with_bn.fwd_comm_s > plain.fwd_comm_s and with_bn.bwd_comm_s > plain.bwd_comm_s
    gap = follow(c, ADAPTIVE_POOL, "gap", out_shape=[4, 16, 1, 1],
                 attrs={"output_size": [1, 1], "pool": "avg"})
    with_gap = Spatial(1, (2, 2)).cost(layer(c, gap), ctx(4))
    ar = FakeProfile().collective_time_s("allreduce", 4, 4 * 16 * 4, "intra")
    assert with_gap.fwd_comm_s == pytest.approx(plain.fwd_comm_s + ar)
    pool = follow(c, POOL, "pool", out_shape=[4, 16, 16, 16],
                  attrs={"pool": "max", "kernel": [3, 3], "stride": [2, 2], "padding": [1, 1],
                         "dilation": [1, 1], "ceil_mode": False})
    with_pool = Spatial(1, (2, 2)).cost(layer(c, pool), ctx(4))
    assert with_pool.fwd_comm_s > plain.fwd_comm_s
    k2 = follow(c, POOL, "pool", out_shape=[4, 16, 16, 16],
                attrs={"pool": "max", "kernel": [2, 2], "stride": [2, 2], "padding": [0, 0],
                       "dilation": [1, 1], "ceil_mode": False})
    assert Spatial(1, (2, 2)).cost(layer(c, k2), ctx(4)).fwd_comm_s == pytest.approx(plain.fwd_comm_s)


def test_no_latency_without_data_and_no_halo_gradient_without_an_input_gradient():
    """A window op that needs no neighbour's rows sends nothing, so it pays no in-step p2p
    latency either (the runtime skips the exchange); an op whose input carries no gradient
    (``decomp.ir.mark_input_grads``: the first layer on the data) sends no halo gradients back."""

    class Measured(FakeProfile):
        samples = {"insitu_latency_by_kind_s": {"p2p": {"4": {"2": 0.003}}}}

    def mctx():
        return CostContext(profile=Measured(), world=4, ranks_per_node=4)
    c = conv_op("c", [4, 8, 32, 32], 16, 3)
    k2 = follow(c, POOL, "pool", out_shape=[4, 16, 16, 16],
                attrs={"pool": "max", "kernel": [2, 2], "stride": [2, 2], "padding": [0, 0],
                       "dilation": [1, 1], "ceil_mode": False})
    pool_only = Layer(index=0, name="pool", ops=[k2], inputs=["c"], output="pool", module="pool")
    assert Spatial(1, (2, 2)).cost(pool_only, mctx()).fwd_comm_s == 0.0
    with_halo = Spatial(1, (2, 2)).cost(layer(c), mctx())
    assert with_halo.fwd_comm_s > 2 * 0.003 - 2 * ALPHA      # the latency of both split dims
    assert with_halo.bwd_comm_s == pytest.approx(with_halo.fwd_comm_s)
    first = OpSpec(**{**c.__dict__, "attrs": {**c.attrs, "input_grad": False}})
    on_data = Spatial(1, (2, 2)).cost(layer(first), mctx())
    assert on_data.fwd_comm_s == pytest.approx(with_halo.fwd_comm_s) and on_data.bwd_comm_s == 0.0
