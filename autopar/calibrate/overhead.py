"""The runtime's own cost per op: what kernel benchmarks do not see.

Every op of a generated module goes through ``DistModel.op`` -> ``Decomposition.run`` ->
``call_local`` in forward, and through the autograd engine in backward. On a CPU with small
layers that Python and engine work is a visible share of a step. It is measured here, once per
calibration, by running a chain of ``N_OPS`` tiny ReLUs (forward and backward) through a real
``DistModel`` at world size 1, subtracting what the fitted kernel model predicts for the same
ops, and dividing by the number of ops. The profile stores it as the pseudo op class
``runtime_op`` (``t0_s`` = seconds per op, forward and backward together); the cost model adds
it once per op (views, priced as free, do not pay it).

What it does not see: a pure data-parallel plan runs the user's module natively
(``runtime.native``), so it pays module calls instead of this per-op dispatch (the cost model
still adds it: a slight over-estimate for such plans); the local batch-norm bookkeeping of the
traced path and multi-input ops cost more per op than this chain of ReLUs.
"""

from __future__ import annotations

import statistics
import time

N_OPS = 64


def _plan_for_chain(n_ops: int, shape: list[int]) -> dict:
    from ..decomp.ir import GraphInput, Layer, LayerGraphData, OpSpec
    layers = []
    prev = "x"
    for i in range(n_ops):
        name = f"relu_{i}"
        op = OpSpec(name=name, kind="unary", target="aten.relu.default", args=[{"v": prev}], kwargs={},
                    out_shape=shape, dtype="float32", inputs=[prev], in_shapes=[shape], params={},
                    param_names={})
        layers.append(Layer(index=i, name=name, ops=[op], inputs=[prev], output=name))
        prev = name
    graph = LayerGraphData(layers=layers, inputs=[GraphInput("x", shape, "float32")], output=prev, batch_size=shape[0])
    return {"world_size": 1, "graph": graph.to_json(),
            "layers": [{"layer": i, "decomposition": {"kind": "replicate"}} for i in range(n_ops)]}


def measure_runtime_overhead_s(repeats: int = 30, profile=None) -> float:
    """Seconds of runtime work per op (forward + backward) beyond what is priced elsewhere:
    beyond the fitted elementwise kernel model of ``profile`` when given (autograd-engine and
    dispatch work that kernel benchmarks miss), else beyond a plain torch chain."""
    import torch
    from ..artifacts import plan_from_decisions
    from ..runtime.comm import Comm
    from ..runtime.model import DistModel

    shape = [2, 8]
    plan = _plan_for_chain(N_OPS, shape)
    dm = DistModel(plan_from_decisions(plan), torch.nn.Module(), Comm(0, 1))
    names = [f"relu_{i}" for i in range(N_OPS)]

    def run_dist():
        x = torch.randn(shape, requires_grad=True)
        v = x
        for n in names:
            v = dm.op(n, v)
        v.sum().backward()

    def run_plain():
        x = torch.randn(shape, requires_grad=True)
        v = x
        for _ in names:
            v = torch.relu(v)
        v.sum().backward()

    def med(fn):
        fn()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    per_op = med(run_dist) / N_OPS
    if profile is not None and "elementwise" in profile.kernels:
        numel = shape[0] * shape[1]
        # what primitives.op_compute_s prices for one unary op: forward t, backward 2t
        t = profile.kernel_time_s("elementwise", float(numel), 2.0 * numel * 4)
        return max(0.0, per_op - 3.0 * t)
    return max(0.0, per_op - med(run_plain) / N_OPS)


def add_runtime_overhead(profile, seconds_per_op: float) -> None:
    """Store the measurement in the profile as the pseudo op class ``runtime_op``."""
    profile.kernels["runtime_op"] = {"t0_s": float(seconds_per_op), "s_per_flop": 0.0, "s_per_byte": 0.0,
                                     "measured": True,
                                     "note": "DistModel dispatch per op, forward + backward (autopar.calibrate.overhead)"}
