"""Replicate: every rank computes the whole layer on the whole tensor.

Legal for every op (it is the single-process computation), so it is the fallback for ops no
other decomposition can split. Its gradients are partial under the sum convention (each rank
only back-propagates its own share of the loss) and are summed over the world.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import CostContext, Decomposition, LayerCost, register
from .common import price_replicated_weights
from .ir import Layer
from .sharding import Sharding


@register
@dataclass(frozen=True)
class Replicate(Decomposition):
    kind = "replicate"
    always_kept = True

    def in_placement(self, layer: Layer, value: str) -> Sharding:
        return Sharding()

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        return Sharding()

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        return [cls()]

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        return None

    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """All of ``price_replicated_weights`` with the layout R (whole tensors)."""
        return price_replicated_weights(layer, Sharding(), ctx)

