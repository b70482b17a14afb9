"""What running a plan op by op costs beyond running the user's module: the traced runtime's gap.

A pure data-parallel plan runs the user's module natively (``runtime.native``); any other plan
runs its traced program op by op through ``DistModel.op`` (argument substitution, the
decomposition's ``run``, local shapes, transitions looked up per op). Both pay torch's own
per-op dispatch and the autograd engine, so the gap between the two is what the planner must
weigh when it compares the best op-by-op plan with the native data-parallel one
(``cost.native``). It is measured once per calibration on a chain of ``N_OPS`` small ops of the
kinds a Transformer or GNN step is made of (a unary op, a two-operand op, a view, in turn),
forward and backward, at world size 1::

    traced_gap_s = (t(chain through DistModel) - t(same chain in plain torch)) / N_OPS

and stored in the profile as the pseudo kernel class ``runtime_traced_op`` (``t0_s``: seconds
per op, forward and backward together). A profile without it prices no gap (the planner then
never prefers the native plan for its runtime alone).
"""

from __future__ import annotations

import statistics
import time

N_OPS = 60
CLASS = "runtime_traced_op"


def _chain_plan(n_ops: int, shape: list[int]) -> dict:
    from ..decomp.ir import GraphInput, Layer, LayerGraphData, OpSpec
    layers, prev = [], "x"
    for i in range(n_ops):
        kind = ("unary", "binary", "view")[i % 3]
        name = f"{kind}_{i}"
        if kind == "unary":
            op = OpSpec(name=name, kind="unary", target="aten.relu.default", args=[{"v": prev}], kwargs={},
                        out_shape=shape, dtype="float32", inputs=[prev], in_shapes=[shape], params={},
                        param_names={})
            ins = [prev]
        elif kind == "binary":
            op = OpSpec(name=name, kind="binary", target="aten.add.Tensor", args=[{"v": prev}, {"v": "x"}],
                        kwargs={}, out_shape=shape, dtype="float32", inputs=[prev, "x"],
                        in_shapes=[shape, shape], params={}, param_names={})
            ins = [prev, "x"]
        else:
            op = OpSpec(name=name, kind="view", target="aten.view.default", args=[{"v": prev}, list(shape)],
                        kwargs={}, out_shape=shape, dtype="float32", inputs=[prev], in_shapes=[shape],
                        params={}, param_names={})
            ins = [prev]
        layers.append(Layer(index=i, name=name, ops=[op], inputs=ins, output=name))
        prev = name
    graph = LayerGraphData(layers=layers, inputs=[GraphInput("x", shape, "float32")], output=prev,
                           batch_size=shape[0])
    return {"world_size": 1, "graph": graph.to_json(),
            "layers": [{"layer": i, "decomposition": {"kind": "replicate"}} for i in range(n_ops)]}


def measure_traced_gap_s(repeats: int = 30) -> float:
    """Seconds per op (forward + backward) that the op-by-op runtime adds to plain torch."""
    import torch
    from ..artifacts import plan_from_decisions
    from ..runtime.comm import Comm
    from ..runtime.model import DistModel

    shape = [2, 8]
    dm = DistModel(plan_from_decisions(_chain_plan(N_OPS, shape)), torch.nn.Module(), Comm(0, 1))
    kinds = [("unary", "binary", "view")[i % 3] for i in range(N_OPS)]
    names = [f"{k}_{i}" for i, k in enumerate(kinds)]

    def run_dist():
        x = torch.randn(shape, requires_grad=True)
        v = x
        for k, n in zip(kinds, names):
            v = dm.op(n, v, x) if k == "binary" else dm.op(n, v)
        v.sum().backward()

    def run_plain():
        x = torch.randn(shape, requires_grad=True)
        v = x
        for k in kinds:
            v = torch.relu(v) if k == "unary" else (v + x if k == "binary" else v.view(shape))
        v.sum().backward()

    def med(fn):
        fn()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    # interleaved rounds: the two sides see the same machine load
    gaps = [(med(run_dist) - med(run_plain)) / N_OPS for _ in range(3)]
    return max(0.0, statistics.median(gaps))


def add_traced_gap(profile, seconds_per_op: float) -> None:
    """Store the measurement in ``profile`` as the pseudo class ``runtime_traced_op``."""
    profile.kernels[CLASS] = {"t0_s": float(seconds_per_op), "s_per_flop": 0.0, "s_per_byte": 0.0,
                              "measured": True,
                              "note": "op-by-op runtime beyond the native module, per op, forward + "
                                      "backward (autopar.calibrate.traced_gap)"}


def traced_gap_s(profile) -> float:
    """The stored gap per op, 0 when the profile has none."""
    k = profile.kernels.get(CLASS) if isinstance(getattr(profile, "kernels", None), dict) else None
    return float(k["t0_s"]) if k else 0.0


def main(argv=None) -> int:
    """``python -m autopar.calibrate.traced_gap PROFILE``: measure the gap here and store it in
    PROFILE (a profile of this machine, written atomically)."""
    import argparse
    from .profile import load_profile, save_profile
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("profile")
    a = ap.parse_args(argv)
    prof = load_profile(a.profile)
    gap = measure_traced_gap_s()
    add_traced_gap(prof, gap)
    save_profile(prof, a.profile)
    print(f"{a.profile}: op-by-op runtime gap {gap * 1e6:.1f} us per op")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
