"""Cost primitives that read measured in-step behaviour: in-situ latency of blocking
collectives per (group size, ranks on the node), and the learned correction factors."""

import dataclasses

import pytest

from autopar.cost import primitives as prim
from autopar.decomp.base import CostContext


def test_insitu_latency_depends_on_ranks_running(profile):
    profile.samples["insitu_latency_by_world_s"] = {"2": {"2": 0.001}, "4": {"2": 0.003, "3": 0.005, "4": 0.008}}
    profile.samples["insitu_latency_s"] = {"2": 0.001, "4": 0.008}
    # a pair alone on the node vs a pair while two more ranks compute
    assert prim.insitu_latency_s(profile, 2, 2) == pytest.approx(0.001)
    assert prim.insitu_latency_s(profile, 2, 4) == pytest.approx(0.003)
    assert prim.insitu_latency_s(profile, 4, 4) == pytest.approx(0.008)
    # beyond the measured worlds: the nearest one
    assert prim.insitu_latency_s(profile, 2, 64) == pytest.approx(0.003)
    # without the ranks running, the p = w diagonal (older profiles have only that)
    assert prim.insitu_latency_s(profile, 4) == pytest.approx(0.008)
    del profile.samples["insitu_latency_by_world_s"]
    assert prim.insitu_latency_s(profile, 2, 4) == pytest.approx(0.001)


def test_blocking_collective_priced_with_the_world_it_runs_in(profile):
    profile.samples["insitu_latency_by_world_s"] = {"2": {"2": 0.001}, "4": {"2": 0.003, "4": 0.008}}
    alone = CostContext(profile=profile, world=2, ranks_per_node=2)
    crowded = CostContext(profile=profile, world=4, ranks_per_node=4)
    t2 = prim.blocking_s(alone, "allreduce", 2, 64, "intra")
    t4 = prim.blocking_s(crowded, "allreduce", 2, 64, "intra")
    assert t4 - t2 == pytest.approx(0.002, rel=1e-6)


def test_grad_sync_latency_names_the_group(profile):
    ctx = CostContext(profile=profile, world=4, ranks_per_node=4)
    ((sig, lat, final),) = prim.grad_sync_latency(ctx, range(4), "world")
    assert sig == "world"
    assert lat == pytest.approx(profile.collective_time_s("allreduce", 4, 0.0))
    assert final == pytest.approx(lat)          # nothing measured in situ: the fit
    profile.samples["insitu_latency_by_world_s"] = {"4": {"4": 0.05}}
    ((_, lat2, final2),) = prim.grad_sync_latency(ctx, range(4), "world")
    assert lat2 == pytest.approx(lat) and final2 == pytest.approx(max(lat, 0.05))
    assert 0 < lat < prim.grad_sync_time_s(ctx, 1e6, range(4))
    assert prim.grad_sync_latency(ctx, [2]) == ()


def test_insitu_measurement_covers_every_group_size_of_every_world(profile):
    from autopar.calibrate.insitu import apply_insitu, measure_insitu_latency_s
    res = measure_insitu_latency_s([3], iters=2, timeout_s=120)
    assert set(res) == {"3"} and set(res["3"]) == {"2", "3"}
    assert all(t >= 0 for t in res["3"].values())
    apply_insitu(profile, res)
    assert profile.samples["insitu_latency_s"] == {"3": res["3"]["3"]}
    assert profile.samples["insitu_latency_by_world_s"] == res


def test_insitu_latency_per_kind_falls_back_to_allreduce(profile):
    profile.samples["insitu_latency_by_world_s"] = {"4": {"2": 0.003, "4": 0.008}}
    profile.samples["insitu_latency_by_kind_s"] = {"all_to_all": {"4": {"4": 0.002}},
                                                   "p2p": {"4": {"2": 0.004}}}
    assert prim.insitu_latency_s(profile, 4, 4, "all_to_all") == pytest.approx(0.002)
    assert prim.insitu_latency_s(profile, 2, 4, "p2p") == pytest.approx(0.004)
    assert prim.insitu_latency_s(profile, 4, 4, "allgather") == pytest.approx(0.008)   # no table: all-reduce's
    assert prim.insitu_latency_s(profile, 4, 4) == pytest.approx(0.008)


# ---- the runtime's per-op overhead, per op family ------------------------------------------

def _op(kind: str, shape=(4, 8)):
    from autopar.decomp.ir import OpSpec
    target = {"view": "aten.view.default", "unary": "aten.relu.default", "binary": "aten.add.Tensor",
              "conv": "aten.convolution.default", "scatter": "aten.index_add.default"}.get(kind, f"aten.{kind}.default")
    return OpSpec(name=kind, kind=kind, target=target, args=[{"v": "x"}], kwargs={}, out_shape=list(shape),
                  dtype="float32", inputs=["x"], in_shapes=[list(shape)], params={}, param_names={})


def test_runtime_overhead_per_family_with_fallbacks(profile):
    assert prim.runtime_overhead_s(profile, "binary") == 0.0              # nothing measured
    profile.kernels["runtime_op"] = {"t0_s": 10e-6, "s_per_flop": 0.0, "s_per_byte": 0.0}
    # an older profile: one figure for every op, views free
    assert prim.runtime_overhead_s(profile, "binary") == pytest.approx(10e-6)
    assert prim.runtime_overhead_s(profile, "view") == 0.0
    profile.kernels["runtime_op"]["by_family"] = {"binary": 13e-6, "view": 15e-6, "gather": 9e-6,
                                                  "batch_norm": 200e-6}
    profile.kernels["runtime_op"]["native_by_family"] = {"binary": 3e-6, "view": 5e-6}
    assert prim.runtime_overhead_s(profile, "binary") == pytest.approx(13e-6)
    assert prim.runtime_overhead_s(profile, "permute") == pytest.approx(15e-6)   # every view family
    assert prim.runtime_overhead_s(profile, "scatter") == pytest.approx(9e-6)    # an alias
    assert prim.runtime_overhead_s(profile, "conv") == pytest.approx(10e-6)      # no probe: t0_s
    assert prim.runtime_overhead_s(profile, "binary", native=True) == pytest.approx(3e-6)
    assert prim.runtime_overhead_s(profile, "conv", native=True) == pytest.approx(10e-6)


def test_views_pay_their_dispatch_when_measured(profile):
    ctx = CostContext(profile=profile, world=1, ranks_per_node=1)
    view = _op("view")
    assert prim.op_compute_s(view, [[4, 8]], [4, 8], ctx)[:2] == (0.0, 0.0)
    profile.kernels["runtime_op"] = {"t0_s": 10e-6, "s_per_flop": 0.0, "s_per_byte": 0.0,
                                     "by_family": {"view": 15e-6, "unary": 12e-6}}
    f, b, _ = prim.op_compute_s(view, [[4, 8]], [4, 8], ctx)
    assert f == pytest.approx(5e-6) and b == pytest.approx(10e-6)
    # a unary op: its kernel plus its family's overhead (a third forward, two thirds backward)
    relu = _op("unary")
    f1, b1, _ = prim.op_compute_s(relu, [[4, 8]], [4, 8], ctx)
    del profile.kernels["runtime_op"]
    f0, b0, _ = prim.op_compute_s(relu, [[4, 8]], [4, 8], ctx)
    assert f1 - f0 == pytest.approx(4e-6) and b1 - b0 == pytest.approx(8e-6)


def _chain_graph(kinds, batch=8):
    from autopar.decomp.ir import GraphInput, Layer, LayerGraphData
    layers, prev = [], "x"
    for i, k in enumerate(kinds):
        op = _op(k, (batch, 4))
        op.name, op.args, op.inputs = f"op{i}", [{"v": prev}], [prev]
        layers.append(Layer(index=i, name=op.name, ops=[op], inputs=[prev], output=op.name))
        prev = op.name
    return LayerGraphData(layers=layers, inputs=[GraphInput("x", [batch, 4], "float32")], output=prev,
                          batch_size=batch)


def test_runtime_overhead_applies_only_off_the_native_path(profile):
    from autopar.decomp.bn import BatchNormStats
    from autopar.decomp.replicate import Replicate
    from autopar.decomp.sample import Sample
    g = _chain_graph(["unary", "view", "binary"])
    dp = {i: Sample(parts=4) for i in range(3)}
    assert not prim.runtime_overhead_applies(g, dp, 4)
    assert prim.runtime_overhead_applies(g, {**dp, 1: Replicate()}, 4)
    assert prim.runtime_overhead_applies(g, {**dp, 1: Sample(parts=2)}, 4)   # not the whole mesh
    assert prim.runtime_overhead_applies(_chain_graph(["unary"], batch=6), {0: Sample(parts=4)}, 4)
    bn = _chain_graph(["unary", "batch_norm"])
    dp2 = {0: Sample(parts=4), 1: Sample(parts=4)}
    assert prim.runtime_overhead_applies(bn, dp2, 4)                       # global statistics
    assert prim.runtime_overhead_applies(bn, dp2, 4, BatchNormStats("local", 1))
    assert not prim.runtime_overhead_applies(bn, dp2, 4, BatchNormStats("local", 2))
    # what it changes in a prediction: the traced table against the native one
    profile.kernels["runtime_op"] = {"t0_s": 10e-6, "s_per_flop": 0.0, "s_per_byte": 0.0,
                                     "by_family": {"view": 15e-6, "unary": 12e-6, "binary": 13e-6},
                                     "native_by_family": {"view": 5e-6, "unary": 3e-6, "binary": 2e-6}}
    ctx = CostContext(profile=profile, world=1, ranks_per_node=1)
    # on the data and without parameters, no op has a backward: forward thirds only
    assert prim.plan_runtime_overhead_s(g, ctx) == pytest.approx(40e-6 / 3)
    assert prim.plan_runtime_overhead_s(g, ctx, native=True) == pytest.approx(10e-6 / 3)

    def traced_minus_native():
        ctx.native_runtime = False
        traced = sum(sum(prim.op_compute_s(op, op.in_shapes, op.out_shape, ctx)[:2]) for lay in g.layers for op in lay.ops)
        ctx.native_runtime = True
        native = sum(sum(prim.op_compute_s(op, op.in_shapes, op.out_shape, ctx)[:2]) for lay in g.layers for op in lay.ops)
        return traced - native

    # no op of this parameter-free chain on the data carries a gradient: forward thirds only
    assert all(op.attrs.get("input_grad") is False for lay in g.layers for op in lay.ops)
    assert traced_minus_native() == pytest.approx((9e-6 + 10e-6 + 11e-6) / 3)
    for lay in g.layers:        # the same chain inside a network (its input carries a gradient)
        for op in lay.ops:
            op.attrs = {k: v for k, v in op.attrs.items() if k != "input_grad"}
    assert prim.plan_runtime_overhead_s(g, ctx) == pytest.approx(40e-6)
    assert prim.plan_runtime_overhead_s(g, ctx, native=True) == pytest.approx(10e-6)
    assert traced_minus_native() == pytest.approx(30e-6)


def test_ops_on_the_data_price_no_input_gradient(profile):
    """A training step never differentiates its data: the first convolution has no bwd_data
    phase, a parameter-free op on the data no backward, and everything downstream of a
    parameter prices its whole backward (``decomp.ir.mark_input_grads``)."""
    from autopar.decomp.ir import GraphInput, Layer, LayerGraphData, OpSpec
    x, w = [4, 3, 16, 16], [8, 3, 3, 3]
    y = [4, 8, 16, 16]

    def conv(name, src, cin):
        return OpSpec(name=name, kind="conv", target="aten.conv2d.default",
                      args=[{"v": src}, {"p": f"{name}.w"}, None, [1, 1], [1, 1], [1, 1], 1], kwargs={},
                      out_shape=y, dtype="float32", inputs=[src], in_shapes=[[4, cin, 16, 16]],
                      params={"weight": [8, cin, 3, 3]}, param_names={"weight": f"{name}.w"},
                      attrs={"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1})
    pad = _op("unary", tuple(x))
    pad.name, pad.args, pad.inputs = "pre", [{"v": "x"}], ["x"]
    c1, c2 = conv("c1", "pre", 3), conv("c2", "c1", 8)
    g = LayerGraphData(layers=[Layer(0, "pre", [pad], ["x"], "pre"), Layer(1, "c1", [c1], ["pre"], "c1"),
                               Layer(2, "c2", [c2], ["c1"], "c2")],
                       inputs=[GraphInput("x", x, "float32")], output="c2", batch_size=4)
    assert [op.attrs.get("input_grad", True) for lay in g.layers for op in lay.ops] == [False, False, True]
    ctx = CostContext(profile=profile, world=1, ranks_per_node=1)
    f0, b0, _ = prim.op_compute_s(pad, pad.in_shapes, pad.out_shape, ctx)
    assert f0 > 0 and b0 == 0.0
    _, b1, _ = prim.op_compute_s(c1, c1.in_shapes, c1.out_shape, ctx, w_shape=w)
    whole = dataclasses.replace(c1, attrs={k: v for k, v in c1.attrs.items() if k != "input_grad"})
    _, b1_whole, _ = prim.op_compute_s(whole, whole.in_shapes, whole.out_shape, ctx, w_shape=w)
    assert 0.0 < b1 < b1_whole
    # the round trip through JSON (plans, the trace cache) keeps the mark
    g2 = LayerGraphData.from_json(g.to_json())
    assert [op.attrs.get("input_grad", True) for lay in g2.layers for op in lay.ops] == [False, False, True]


def _swept_rows(profile, op_class: str, bwd_ratio: float, log_flops, log_bytes, seed: int) -> list[dict]:
    """30 sweep rows of ``op_class`` timed as the profile's forward model says, each backward
    ``bwd_ratio`` times its forward (FLOPs and bytes log-uniform over the given decades)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(30):
        fl, by = float(10 ** rng.uniform(*log_flops)), float(10 ** rng.uniform(*log_bytes))
        t = profile.kernel_time_s(op_class, fl, by)
        rows.append({"config": {}, "flops": fl, "bytes": by, "median_s": t, "bwd_median_s": bwd_ratio * t})
    return rows


def test_measured_matmul_backward_prices_the_backward(profile):
    """A profile whose matmul sweep timed the backward too (``bwd_median_s``) prices a matmul's
    backward by its ``bwd_model``; without it, backward stays twice the forward."""
    from autopar.profile.fit import add_backward_models
    from autopar.decomp.ir import OpSpec
    op = OpSpec(name="mm", kind="matmul", target="aten.matmul.default", args=[{"v": "a"}, {"v": "b"}],
                kwargs={}, out_shape=[64, 32], dtype="float32", inputs=["a", "b"],
                in_shapes=[[64, 128], [128, 32]], params={}, param_names={})
    ctx = CostContext(profile=profile, world=1, ranks_per_node=1)
    f0, b0, _ = prim.op_compute_s(op, op.in_shapes, op.out_shape, ctx)
    assert b0 == pytest.approx(2 * f0)
    profile.samples = {"kernels": {"matmul": _swept_rows(profile, "matmul", 3.0, (5, 9), (4, 7), seed=0)}}
    assert add_backward_models(profile) == ["matmul"]
    bm = profile.kernels["matmul"]["bwd_model"]
    assert bm["form"] == "flat" and bm["heldout_median_rel_err"] < 1e-6
    f1, b1, _ = prim.op_compute_s(op, op.in_shapes, op.out_shape, ctx)
    assert f1 == pytest.approx(f0) and b1 == pytest.approx(3 * f0, rel=1e-6)
    assert add_backward_models(profile) == []          # fitted once


def _norm_op(kind: str, target: str, shape):
    from autopar.decomp.ir import OpSpec
    return OpSpec(name="n", kind=kind, target=target, args=[{"v": "x"}], kwargs={}, out_shape=list(shape),
                  dtype="float32", inputs=["x"], in_shapes=[list(shape)], params={}, param_names={},
                  attrs={"training": True})


def test_swept_backward_prices_only_the_families_the_sweep_timed(profile):
    """The norm sweep times batch norm's backward (``OpFamily.sweep_backward``): with the
    class's ``bwd_model`` fitted, batch norm's backward is priced by it, while layer norm (the
    same class, not what the sweep ran) keeps twice its forward."""
    from autopar.profile.fit import add_backward_models
    from autopar.ops import family_of
    assert family_of("batch_norm").sweep_backward and family_of("pool").sweep_backward
    assert not family_of("layer_norm").sweep_backward and not family_of("unary").sweep_backward
    profile.samples = {"kernels": {"norm": _swept_rows(profile, "norm", 0.5, (4, 8), (4, 8), seed=1)}}
    assert add_backward_models(profile) == ["norm"]
    ctx = CostContext(profile=profile, world=1, ranks_per_node=1)
    bn = _norm_op("batch_norm", "aten.batch_norm.default", [8, 16, 32, 32])
    ln = _norm_op("layer_norm", "aten.layer_norm.default", [8, 64, 256])
    over = prim.runtime_overhead_s(profile, "batch_norm")
    f, b, _ = prim.op_compute_s(bn, bn.in_shapes, bn.out_shape, ctx)
    assert b - 2 * over / 3 == pytest.approx(0.5 * (f - over / 3), rel=1e-6)
    over = prim.runtime_overhead_s(profile, "layer_norm")
    f, b, _ = prim.op_compute_s(ln, ln.in_shapes, ln.out_shape, ctx)
    assert b - 2 * over / 3 == pytest.approx(2 * (f - over / 3), rel=1e-6)
