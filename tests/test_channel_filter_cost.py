"""Channel / filter / channel+filter: layouts, legality and cost (pure logic, no process group).

Also home of ``make_layer``, the hand-built layer (anchor + batch norm + ReLU, with the tracer's
argument conventions) that ``test_channel_filter.py`` and the benchmark reuse.
"""

from __future__ import annotations

import math

import pytest

from autopar.decomp.base import CostContext, decomposition_from_json
from autopar.decomp.channel_filter import Channel, ChannelFilter, Filter
from autopar.decomp.ir import BATCH_NORM, CONV, LINEAR, UNARY, Layer, OpSpec
from autopar.decomp.sharding import Sharding, Shard
from autopar.decomp.sample import Sample
from autopar.decomp.transition import recv_bytes


# ---- hand-built layers ----------------------------------------------------------------------
def make_layer(index: int, kind: str, x_name: str, x_shape, f: int, *, k: int = 3,
               stride: int = 1, padding: int = 1, bias: bool = False, bn: bool = True,
               relu: bool = True, groups: int = 1, prefix: str | None = None) -> Layer:
    """``kind`` "conv" (conv1d/2d/3d after the rank of ``x_shape``) or "linear", then optional
    batch norm and ReLU, as the tracer would write them. Parameters are named
    ``{prefix}.anchor.weight``, ``{prefix}.bn.weight``...; buffers ``{prefix}.bn.running_mean``.
    """
    prefix = prefix or f"l{index}"
    x_shape = [int(s) for s in x_shape]
    n, c = x_shape[0], x_shape[1] if kind == "conv" else x_shape[-1]
    w, b = f"{prefix}.anchor.weight", f"{prefix}.anchor.bias"
    if kind == "conv":
        nd = len(x_shape) - 2
        sp = [(s + 2 * padding - k) // stride + 1 for s in x_shape[2:]]
        out = [n, f] + sp
        w_shape = [f, c // groups] + [k] * nd
        attrs = {"stride": [stride] * nd, "padding": [padding] * nd, "dilation": [1] * nd,
                 "groups": groups}
        args = [{"v": x_name}, {"p": w}, {"p": b} if bias else None, attrs["stride"],
                attrs["padding"], attrs["dilation"], groups]
        target = f"aten.conv{nd}d.default"
        flops = 2.0 * n * f * math.prod(sp) * (c // groups) * k ** nd
    else:
        out = x_shape[:-1] + [f]
        w_shape = [f, c]
        attrs = {}
        args = [{"v": x_name}, {"p": w}, {"p": b} if bias else None]
        target = "aten.linear.default"
        flops = 2.0 * math.prod(x_shape[:-1]) * c * f
    params = {"weight": w_shape}
    names = {"weight": w}
    if bias:
        params["bias"], names["bias"] = [f], b
    name = f"{prefix}_anchor"
    ops = [OpSpec(name=name, kind=CONV if kind == "conv" else LINEAR, target=target, args=args,
                  kwargs={}, out_shape=out, dtype="float32", inputs=[x_name], in_shapes=[x_shape],
                  params=params, param_names=names, attrs=attrs, module=f"{prefix}.anchor",
                  flops_fwd=flops, flops_bwd=2 * flops)]
    if bn:
        q = f"{prefix}.bn"
        ops.append(OpSpec(
            name=f"{prefix}_bn", kind=BATCH_NORM, target="aten.batch_norm.default",
            args=[{"v": ops[-1].name}, {"p": f"{q}.weight"}, {"p": f"{q}.bias"},
                  {"b": f"{q}.running_mean"}, {"b": f"{q}.running_var"}, True, 0.1, 1e-5, False],
            kwargs={}, out_shape=out, dtype="float32", inputs=[ops[-1].name], in_shapes=[out],
            params={"weight": [f], "bias": [f]},
            param_names={"weight": f"{q}.weight", "bias": f"{q}.bias"},
            buffers={"running_mean": f"{q}.running_mean", "running_var": f"{q}.running_var"},
            attrs={"training": True, "momentum": 0.1, "eps": 1e-5}, module=q))
    if relu:
        ops.append(OpSpec(name=f"{prefix}_relu", kind=UNARY, target="aten.relu.default",
                          args=[{"v": ops[-1].name}], kwargs={}, out_shape=out, dtype="float32",
                          inputs=[ops[-1].name], in_shapes=[out], params={}, param_names={}))
    return Layer(index=index, name=name, ops=ops, inputs=[x_name], output=ops[-1].name,
                 module=prefix)


class FakeProfile:
    """Analytic stand-in for a calibration profile (the Profile API, nothing measured).

    kernels: 10 us + flops / 50 GFLOP/s + bytes / 10 GB/s; collectives: alpha-beta with
    alpha = 20 us per log2(p) step and 1 GB/s links, the usual ring factors.
    """

    def kernel_time_s(self, op_class, flops, bytes_moved):
        return 1e-5 + flops / 50e9 + bytes_moved / 10e9

    def exact_time_s(self, shape_key, phase):
        return None

    def slowdown(self, ranks_on_node):
        return 1.0

    def collective_time_s(self, kind, group_size, nbytes, level="intra"):
        p = int(group_size)
        if p <= 1:
            return 0.0
        beta = 1e-9 * (4 if level == "inter" else 1)
        factor = {"allreduce": 2 * (p - 1) / p, "allgather": (p - 1) / p,
                  "reduce_scatter": (p - 1) / p, "all_to_all": (p - 1) / p,
                  "broadcast": 1.0}.get(kind, 1.0)
        return 2e-5 * math.ceil(math.log2(p)) + factor * nbytes * beta


def ctx_for(world: int, batch: int = 1, ranks_per_node: int | None = None) -> CostContext:
    return CostContext(profile=FakeProfile(), world=world,
                       ranks_per_node=ranks_per_node or world, batch_size=batch,
                       prefer_exact=False)


def step_s(c) -> float:
    """Exposed step time of one layer in isolation (gradient sync not overlapped)."""
    return c.fwd_s + c.bwd_s + c.grad_sync_s


# ---- layouts ----------------------------------------------------------------------------------
def test_layouts_and_free_edges():
    lay = make_layer(0, "conv", "x", [8, 16, 8, 8], 32)
    assert Channel(2, 2).in_placement(lay, "x") == Sharding.of((Shard(0), 2), (Shard(1), 2))
    assert Channel(2, 2).out_placement(lay) == Sharding.of((Shard(0), 2), (Shard(1), 2))
    assert Filter(2, 2).in_placement(lay, "x") == Sharding.of((Shard(0), 2))
    assert Filter(2, 2).out_placement(lay) == Sharding.of((Shard(0), 2), (Shard(1), 2))
    assert ChannelFilter(1, 2, 2).in_placement(lay, "x") == Sharding.of((Shard(1), 2))
    assert ChannelFilter(1, 2, 2).out_placement(lay) == Sharding.of((Shard(0), 2), (Shard(1), 2))
    nxt = make_layer(1, "conv", lay.output, lay.out_shape, 32)
    shape = lay.out_shape
    # filter -> channel, channel -> channel, channel+filter -> channel(s*pc, pf): free edges
    for a, b in ((Filter(2, 2), Channel(2, 2)), (Channel(1, 4), Channel(1, 4)),
                 (ChannelFilter(1, 2, 2), Channel(2, 2)), (Filter(1, 4), Channel(1, 4))):
        assert a.out_placement(lay) == b.in_placement(nxt, lay.output), (a, b)
        assert recv_bytes(a.out_placement(lay), b.in_placement(nxt, lay.output), shape, 4, 4) == 0
    # sample -> filter with the same sample split: replicated within the filter group, free
    assert Sample(2).out_placement(lay) == Filter(2, 2).in_placement(nxt, lay.output)
    # channel -> filter needs the allgather (the transition prices it)
    assert recv_bytes(Channel(1, 4).out_placement(lay), Filter(1, 4).in_placement(nxt, lay.output),
                      shape, 4, 4) > 0


def test_linear_feature_dim_and_json():
    lay = make_layer(0, "linear", "x", [8, 64], 32)
    assert Channel(1, 2).in_placement(lay, "x") == Sharding.of((Shard(1), 2))
    assert ChannelFilter(1, 2, 2).out_placement(lay) == Sharding.of((Shard(0), 2), (Shard(1), 2))
    for d in (Channel(2, 2), Filter(1, 4), ChannelFilter(2, 2, 2)):
        assert decomposition_from_json(d.to_json()) == d
    assert str(ChannelFilter(2, 2, 2)) == "channel_filter(2,2,2)"


def test_param_shards_and_grad_groups():
    lay = make_layer(0, "conv", "x", [8, 16, 8, 8], 32, bias=True)
    conv, bn = lay.ops[0], lay.ops[1]
    d = Channel(2, 2)      # ranks 0..3 = (cs, cc): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1)
    w = d.param_shard(conv, "weight")
    assert w.local_shape([32, 16, 3, 3], 1, 4) == (32, 8, 3, 3)
    assert w.grad_group(1, 4) == [1, 3]
    assert d.param_shard(conv, "bias").local_bounds([32], 1, 4) == ((16, 16),)
    assert d.param_shard(bn, "weight").grad_group(0, 4) == [0, 2]
    f = Filter(2, 2)
    assert f.param_shard(conv, "weight").local_bounds([32, 16, 3, 3], 3, 4)[0] == (16, 16)
    cf = ChannelFilter(2, 2, 2)   # rank = (cs*2 + cc)*2 + cf
    ws = cf.param_shard(conv, "weight")
    assert ws.local_shape([32, 16, 3, 3], 0, 8) == (16, 8, 3, 3)
    assert ws.grad_group(3, 8) == [3, 7]                 # same (cc, cf), both samples
    assert cf.param_shard(conv, "bias").grad_group(3, 8) == [1, 3, 5, 7]   # same cf
    # partitions cover what the runtime uses
    parts = cf.partitions(lay, 8)
    assert [[0, 2], [1, 3], [4, 6], [5, 7]] in parts      # channel groups
    assert [[0, 2, 4, 6], [1, 3, 5, 7]] in parts          # output sample groups
    assert [[0, 4], [1, 5], [2, 6], [3, 7]] in parts      # weight-shard groups


def test_candidates():
    lay = make_layer(0, "conv", "x", [8, 16, 8, 8], 32)
    ctx = ctx_for(8)
    assert Channel.candidates(lay, ctx) == [Channel(4, 2), Channel(2, 4), Channel(1, 8)]
    assert Filter.candidates(lay, ctx) == [Filter(4, 2), Filter(2, 4), Filter(1, 8)]
    assert set(ChannelFilter.candidates(lay, ctx)) == {
        ChannelFilter(2, 2, 2), ChannelFilter(1, 2, 4), ChannelFilter(1, 4, 2)}
    assert ChannelFilter.candidates(lay, ctx_for(2)) == []
    for d in Channel.candidates(lay, ctx) + Filter.candidates(lay, ctx) + \
            ChannelFilter.candidates(lay, ctx):
        assert d.check(lay, ctx) is None, d


# ---- legality ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dec, layer, world, words", [
    (Filter(1, 4), make_layer(0, "conv", "x", [8, 16, 8, 8], 3, prefix="layer3.conv"), 4,
     ["layer3.conv", "3 filters", "4 filter parts"]),
    (Channel(1, 4), make_layer(0, "conv", "x", [8, 2, 8, 8], 8), 4, ["2 channels", "4 channel parts"]),
    (Channel(1, 4), make_layer(0, "conv", "x", [8, 8, 8, 8], 2), 4, ["2 filters"]),
    (Channel(1, 2), make_layer(0, "conv", "x", [8, 8, 8, 8], 8, groups=2), 2, ["groups=2"]),
    (Filter(4, 2), make_layer(0, "conv", "x", [2, 8, 8, 8], 8), 8, ["batch 2", "4 sample parts"]),
    (ChannelFilter(1, 2, 2), make_layer(0, "conv", "x", [1, 8, 8, 8], 8), 4, ["batch 1"]),
    (ChannelFilter(2, 3, 2), make_layer(0, "conv", "x", [10, 8, 8, 8], 8), 12, ["refine"]),
    (Channel(2, 2), make_layer(0, "conv", "x", [8, 8, 8, 8], 8), 8, ["world size is 8"]),
    (Channel(1, 2), make_layer(0, "linear", "x", [8, 4, 16], 8), 2, ["batch norm", "linear"]),
])
def test_illegal_splits_are_rejected_with_a_reason(dec, layer, world, words):
    why = dec.check(layer, ctx_for(world))
    assert why is not None
    for w in words:
        assert w in why, why


def test_remainders_are_legal():
    lay = make_layer(0, "conv", "x", [6, 6, 8, 8], 5)
    for d in (Channel(1, 4), Filter(1, 4), ChannelFilter(1, 2, 2), Channel(2, 2)):
        assert d.check(lay, ctx_for(4)) is None, d


def test_non_anchor_layer_has_no_candidates():
    lay = make_layer(0, "conv", "x", [8, 8, 8, 8], 8)
    bn_only = Layer(index=0, name="bn", ops=lay.ops[1:], inputs=[lay.ops[0].name], output="o")
    assert Channel.candidates(bn_only, ctx_for(4)) == []
    assert "conv or linear anchor" in Channel(1, 4).check(bn_only, ctx_for(4))


# ---- cost golden tests ------------------------------------------------------------------------
def test_wide_layer_small_batch_is_cheaper_under_channel_and_filter():
    lay = make_layer(0, "conv", "x", [4, 1024, 8, 8], 1024)
    ctx = ctx_for(4, batch=4)
    sample = step_s(Sample(4).cost(lay, ctx))
    for d in (Channel(1, 4), Filter(1, 4), ChannelFilter(1, 2, 2)):
        assert d.check(lay, ctx) is None
        t = step_s(d.cost(lay, ctx))
        if not isinstance(d, Channel):
            # the input allgather of filter-style layers is the incoming edge's transition
            from autopar.decomp.transition import transition_s
            f, b = transition_s(Channel(1, 4).out_placement(lay), d.in_placement(lay, "x"),
                                lay.in_shape("x"), 4, ctx)
            t += f + b
        assert t < sample, (d, t, sample)


def test_narrow_layer_large_batch_is_cheaper_under_sample():
    lay = make_layer(0, "conv", "x", [256, 16, 32, 32], 16)
    ctx = ctx_for(4, batch=256)
    sample = step_s(Sample(4).cost(lay, ctx))
    for d in (Channel(1, 4), Channel(2, 2), Filter(1, 4), ChannelFilter(1, 2, 2)):
        assert step_s(d.cost(lay, ctx)) > sample, d


def test_segmented_allreduce_volume_is_weights_over_p_model():
    lay = make_layer(0, "conv", "x", [8, 64, 8, 8], 128, bias=False, bn=False)
    w_bytes = 128 * 64 * 9 * 4
    ctx = ctx_for(8)
    assert Sample(8).cost(lay, ctx).grad_sync_bytes == w_bytes
    for d, p_model in ((Channel(2, 4), 4), (Filter(4, 2), 2), (Channel(4, 2), 2),
                       (ChannelFilter(2, 2, 2), 4)):
        c = d.cost(lay, ctx)
        assert c.grad_sync_bytes == w_bytes / p_model, d
        assert c.param_bytes == w_bytes / p_model
        assert c.optim_bytes == ctx.optimizer_state_per_param * w_bytes / p_model
        # priced as one allreduce among the s ranks, not the world
        s = d.grid()[0]
        assert c.grad_sync_s == pytest.approx(
            ctx.profile.collective_time_s("allreduce", s, w_bytes / p_model))
    # pure model parallelism: no gradient allreduce at all
    assert Channel(1, 8).cost(lay, ctx).grad_sync_bytes == 0
    assert Channel(1, 8).cost(lay, ctx).grad_sync_s == 0


def test_segmented_volume_with_bias_and_bn():
    lay = make_layer(0, "conv", "x", [8, 64, 8, 8], 128, bias=True, bn=True)
    ctx = ctx_for(8)
    c = ChannelFilter(2, 2, 2).cost(lay, ctx)
    # weight / (pc*pf) among s=2 ranks; bias + BN weight/bias / pf among s*pc = 4 ranks
    assert c.grad_sync_bytes == (128 * 64 * 9 / 4 + 3 * 128 / 2) * 4
    c = Channel(2, 4).cost(lay, ctx)
    assert c.grad_sync_bytes == (128 * 64 * 9 + 3 * 128) * 4 / 4


def test_comm_terms_on_the_right_groups():
    lay = make_layer(0, "conv", "x", [8, 32, 8, 8], 64, bn=False, relu=False)
    ctx = ctx_for(4)
    prof = ctx.profile
    c = Channel(1, 4).cost(lay, ctx)
    y_part = 8 * 64 * 8 * 8 * 4      # local partial output, all F
    assert c.fwd_comm_s == pytest.approx(prof.collective_time_s("reduce_scatter", 4, y_part))
    assert c.bwd_comm_s == pytest.approx(prof.collective_time_s("allgather", 4, y_part))
    assert c.workspace_bytes == y_part
    f = Filter(1, 4).cost(lay, ctx)
    assert f.fwd_comm_s == 0 and f.bwd_comm_s == 0
    cf = ChannelFilter(1, 2, 2).cost(lay, ctx)
    assert cf.fwd_comm_s == pytest.approx(prof.collective_time_s("reduce_scatter", 2, y_part / 2))
    # inter-node channel groups are priced on the inter-node link
    slow = Channel(1, 4).cost(lay, ctx_for(4, ranks_per_node=2))
    assert slow.fwd_comm_s > c.fwd_comm_s
    # the segmented allreduce of Channel(2, 2) crosses nodes when ranks_per_node = 2
    lay2 = make_layer(0, "conv", "x", [8, 32, 8, 8], 64, bn=False, relu=False)
    a = Channel(2, 2).cost(lay2, ctx_for(4))
    b = Channel(2, 2).cost(lay2, ctx_for(4, ranks_per_node=2))
    assert b.grad_sync_s > a.grad_sync_s and b.fwd_comm_s == a.fwd_comm_s


def test_compute_uses_local_shapes():
    lay = make_layer(0, "conv", "x", [8, 64, 8, 8], 64, bn=False, relu=False)
    ctx = ctx_for(4)
    sh = Channel(1, 4).local_shapes(lay)
    assert sh == {"x": (8, 16, 8, 8), "w": (64, 16, 3, 3), "y_part": (8, 64, 8, 8),
                  "y": (8, 16, 8, 8)}
    assert Filter(2, 2).local_shapes(lay)["w"] == (32, 64, 3, 3)
    assert ChannelFilter(1, 2, 2).local_shapes(lay) == {
        "x": (8, 32, 8, 8), "w": (32, 32, 3, 3), "y_part": (8, 32, 8, 8), "y": (4, 32, 8, 8)}
    # the anchor is priced on the local shard: a quarter of the single-process FLOPs
    from autopar.cost.primitives import op_compute_s
    f, b, _ = op_compute_s(lay.anchor, [sh["x"]], sh["y_part"], ctx, w_shape=sh["w"])
    c = Channel(1, 4).cost(lay, ctx)
    assert (c.fwd_compute_s, c.bwd_compute_s) == (f, b)
    f1, _, _ = op_compute_s(lay.anchor, [[8, 64, 8, 8]], [8, 64, 8, 8], ctx)
    t0 = 1e-5
    assert (f - t0) == pytest.approx((f1 - t0) / 4, rel=0.05)


def test_pricing_at_large_worlds_uses_the_right_links():
    # (how long pricing takes is measured by benchmarks/bench_planning.py, not asserted here)
    lay = make_layer(0, "conv", "x", [1024, 256, 8, 8], 512, bias=True)
    ctx = ctx_for(1024, ranks_per_node=8)
    decs = Channel.candidates(lay, ctx) + Filter.candidates(lay, ctx) + \
        ChannelFilter.candidates(lay, ctx)
    costs = [d.cost(lay, ctx) for d in decs if d.check(lay, ctx) is None]
    assert costs
    # the segmented allreduce among s = 128 ranks crosses nodes, the 8-rank channel group not
    c = Channel(128, 8)
    assert list(c.partition("c")[1]) == list(range(8, 16))
    assert ctx.level(c.partition("c")[1]) == "intra" and ctx.level(c.partition("s")[0]) == "inter"


def test_batch_norm_statistics_priced_on_the_output_sample_group(profile):
    """With the shared synthetic Profile (the real API): BN sync over the s ranks that hold
    the same F shard, sized by the local channels."""
    lay = make_layer(0, "conv", "x", [8, 32, 8, 8], 64, bn=True, relu=False)
    ctx = CostContext(profile=profile, world=4, ranks_per_node=4)
    plain = make_layer(0, "conv", "x", [8, 32, 8, 8], 64, bn=False, relu=False)
    for d, g, c_loc in ((Channel(2, 2), 2, 32), (Filter(2, 2), 2, 32), (ChannelFilter(1, 2, 2), 2, 32),
                        (Channel(1, 4), 1, 16)):
        extra_f = d.cost(lay, ctx).fwd_comm_s - d.cost(plain, ctx).fwd_comm_s
        extra_b = d.cost(lay, ctx).bwd_comm_s - d.cost(plain, ctx).bwd_comm_s
        want_f = profile.collective_time_s("allreduce", g, g * (2 * c_loc + 1) * 4) if g > 1 else 0
        want_b = profile.collective_time_s("allreduce", g, 2 * c_loc * 4) if g > 1 else 0
        assert extra_f == pytest.approx(want_f) and extra_b == pytest.approx(want_b), d
