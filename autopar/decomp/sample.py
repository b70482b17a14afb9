"""Sample (data) parallelism: split dim 0 (the samples) into ``parts`` blocks.

Every tensor of the layer has layout ``N<parts>``; with world P, P/parts ranks replicate each
block. Weights are whole on every rank and their gradients are summed over the world (the DDP
allreduce, bucketed and overlapped with backward by the runtime). Batch norm: under global
statistics it aggregates over the ``parts`` ranks holding different samples (DDP +
SyncBatchNorm); under local statistics (``decomp.bn``) each rank holds whole groups of samples
and computes their statistics alone, as torch DDP does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .base import CostContext, Decomposition, LayerCost, divisors, register
from .common import batch_dim_ok, batch_free_inputs, price_replicated_weights
from ..ops.registry import batch_free_operand
from .ir import REGISTERED, Layer
from .sharding import Sharding, Shard


@register
@dataclass(frozen=True)
class Sample(Decomposition):
    parts: int = 1
    kind = "sample"
    always_kept = True
    scaling_series = "sample-only"
    # no fixed op list: every registered op family says whether it runs on blocks of samples
    # (``check`` -> ``batch_dim_ok``: dim 0 in ``independent_dims`` or ``synced_dims``)
    supported_ops = REGISTERED

    def sharding(self) -> Sharding:
        return Sharding.of((Shard(0), self.parts))

    def in_placement(self, layer: Layer, value: str) -> Sharding:
        try:
            shape = layer.in_shape(value)
        except KeyError:
            return self.sharding()
        if not shape or any(int(n) == 0 for n in shape):
            return Sharding()      # an empty operand (an empty cache): whole, there is nothing to split
        if value in batch_free_inputs(layer):
            return Sharding()      # read whole by a broadcasting op on every block (a position embedding)
        return self.sharding()

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        return self.sharding()

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        lay = self.sharding()
        groups = {tuple(lay.data_group(r, world)) for r in range(world)}
        return [sorted(list(g) for g in groups)]

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        return [cls(p) for p in divisors(ctx.world) if p > 1]

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        """Legal when every op is registered, the parts divide the world, every op runs on
        blocks of samples (``batch_dim_ok`` asks each op's family) and every part holds a
        sample."""
        why = super().check(layer, ctx)
        if why:
            return why
        if ctx.world % self.parts:
            return f"{self.parts} parts do not divide world size {ctx.world}"
        why = batch_dim_ok(layer, merged_parts=self.parts)
        if why:
            return why
        n = min([int(layer.out_shape[0])] + [int(s[0]) for op in layer.ops for s in op.in_shapes
                                             if s and all(int(k) for k in s) and not batch_free_operand(op, s)])
        if n < self.parts:
            return f"batch {n} < {self.parts} sample parts (some rank would hold no sample)"
        return None

    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """``price_replicated_weights`` with layout N<parts>; batch-norm statistics over the
        ``parts`` ranks that hold different samples."""
        return price_replicated_weights(layer, self.sharding(), ctx, bn_group_size=self.parts)


@functools.lru_cache(maxsize=None)
def _layout(parts: int) -> Sharding:
    return Sharding.of((Shard(0), parts))


@functools.lru_cache(maxsize=4096)
def _local_shape(parts: int, shape: tuple, rank: int, world: int) -> tuple:
    """This rank's block of ``shape`` (cached: the runtime asks for it on every op of every step)."""
    return _layout(parts).local_shape(shape, rank, world)

