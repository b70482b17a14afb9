"""A toy decomposition, added to autopar by this one file plus one import line (``import
toys.toy_decomp``): a linear layer split over its input features, leaving a partial sum.

``InFeatures(p)`` on a world of p ranks: the input arrives ``Shard(-1)`` (rank k holds input
features block k), the weight is split by columns (``W[:, block k]``), each rank computes
``x_k @ W_k^T`` and leaves it as ``Partial("sum")`` (layout ``P<p>``); the bias is added by the
rank at partial index 0 only. The next layer resolves the partial sum where it needs it: the
redistribution planner gives an all-reduce (to ``Replicate()``) or a reduce-scatter (to a
sample split), priced by the cost model on that edge, so the ILP keeps the partial sum across
the edge and pays for it once.

Cost: compute = linear on (N, I/p) x (O, I/p); no gradient sync for the weight (each rank owns
its columns); the bias gradient is summed over the world like any whole parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.decomp.base import CostContext, Decomposition, LayerCost, ParamShard, register
from autopar.decomp.ir import LINEAR, Layer, OpSpec
from autopar.decomp.sharding import Sharding, Partial, Shard, block_extent


@register
@dataclass(frozen=True)
class InFeatures(Decomposition):
    parts: int = 2
    kind = "toy_in_features"
    supported_ops = frozenset({LINEAR})

    def in_placement(self, layer: Layer, value: str) -> Sharding:
        return Sharding.of((Shard(len(layer.anchor.in_shapes[0]) - 1), self.parts))

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        return Sharding.of((Partial(), self.parts))

    def param_shard(self, op: OpSpec, role: str) -> ParamShard:
        if role == "weight":
            return ParamShard.on(Sharding.of((Shard(1), self.parts)), ((1, 0),))
        return ParamShard()

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        return [cls(ctx.world)] if ctx.world > 1 else []

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        why = super().check(layer, ctx)
        if why:
            return why
        if len(layer.ops) != 1:
            return "only a lone linear layer (no folded activation: it cannot run on a partial sum)"
        if self.parts != ctx.world:
            return f"{self.parts} parts != world size {ctx.world}"
        if int(layer.anchor.params["weight"][1]) < self.parts:
            return f"fewer input features than {self.parts} parts"
        return None

    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        from autopar.cost import primitives as prim
        a, item = layer.anchor, layer.itemsize
        o, i = (int(n) for n in a.params["weight"])
        x = list(a.in_shapes[0])
        x[-1] = block_extent(i, self.parts, 0)
        w = [o, x[-1]]
        fwd, bwd, src = prim.op_compute_s(a, [x], a.out_shape, ctx, w_shape=w, itemsize=item)
        w_bytes = float(o * x[-1] * item)
        b_bytes = float(math.prod(a.params.get("bias", [0])) * item) if "bias" in a.params else 0.0
        gsync = prim.grad_sync_time_s(ctx, b_bytes, range(ctx.world)) if b_bytes else 0.0
        return LayerCost(fwd_compute_s=fwd, bwd_compute_s=bwd, grad_sync_s=gsync,
                         grad_sync_bytes=b_bytes, param_bytes=w_bytes + b_bytes,
                         grad_bytes=w_bytes + b_bytes,
                         optim_bytes=prim.optimizer_bytes(ctx, w_bytes + b_bytes),
                         activation_bytes=prim.saved_bytes(a, [x], a.out_shape, item), source=src)

    def run(self, comm, layer, op, inputs, params, buffers):
        import torch.nn.functional as F
        w = params[op.param_names["weight"]]
        b = params[op.param_names["bias"]] if "bias" in op.param_names else None
        first = self.out_placement(layer).partial_index(comm.rank, comm.world) == 0
        return F.linear(inputs[0], w, b if first else None)
