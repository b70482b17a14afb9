"""Sequence parallelism (Korthikanti et al., 2022) of norm / dropout / residual layers, with data
parallelism: ``sequence(s, p)``.

Between the tensor-parallel regions of a Transformer (head-parallel attention, column -> row
MLP) the layer norms, dropouts and residual adds run on every rank of the tensor group on the
same whole activation when they are replicated. Split instead along the sequence: activations
x_NSE have layout ``((0, s), (1, p))`` (samples over the sample axis, sequence over the tensor
axis, ``rank = c_s * p + c_t``), so each rank computes and stores S/p positions. Every op here
is independent along the sequence (layer / RMS norm over the last dim, elementwise ops).

The communication is the edges': a row-parallel exit (``head``, ``row_parallel``: a partial sum
over the tensor group) enters this layout through a reduce-scatter along the sequence instead
of an all-reduce, and the next column-parallel entry (``head``, ``filter``: input replicated
over the tensor group) leaves it through an all-gather along the sequence (each the other's
adjoint in backward); both are priced on the edge (``decomp.transition``).

An operand of lower rank or of extent 1 on a dim (a broadcast position embedding [S, E], a
[1, S, E] table) is taken whole and this rank's sequence block is sliced from it locally.
Layer norm and elementwise parameters stay whole; their gradients are partial per sequence
block and are summed over the world like any whole parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import CostContext, Decomposition, LayerCost, register
from ..common import price_replicated_weights
from ..ir import BINARY, DROPOUT, LAYER_NORM, RMS_NORM, UNARY, Layer
from ..sharding import Sharding, Shard
from .common import mesh_check, two_axis_candidates

SUPPORTED = frozenset({LAYER_NORM, RMS_NORM, UNARY, BINARY, DROPOUT})


@register
@dataclass(frozen=True)
class SequenceParallel(Decomposition):
    """Activations split along (samples, sequence) = ((0, sample), (1, parts))."""

    sample: int = 1
    parts: int = 2
    kind = "sequence"
    supported_ops = SUPPORTED

    def sharding(self) -> Sharding:
        return Sharding.of((Shard(0), self.sample), (Shard(1), self.parts))

    def _full_rank(self, layer: Layer, shape) -> bool:
        out = layer.out_shape
        return len(shape) == len(out) and int(shape[0]) == int(out[0]) and int(shape[1]) == int(out[1])

    def in_placement(self, layer: Layer, value: str) -> Sharding:
        return self.sharding() if self._full_rank(layer, layer.in_shape(value)) else Sharding()

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        return self.sharding()

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        if len(layer.out_shape) != 3 or any(op.kind not in SUPPORTED for op in layer.ops):
            return []
        return two_axis_candidates(cls, ctx)

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        why = mesh_check(self, layer, ctx)
        if why:
            return why
        name = layer.module or layer.name
        n, seq = int(layer.out_shape[0]), int(layer.out_shape[1])
        for op in layer.ops:
            if list(op.out_shape) != list(layer.out_shape):
                return f"{name}: {op.name} changes the (batch, sequence, width) shape"
            if op.kind in (LAYER_NORM, RMS_NORM) and len(op.attrs.get("normalized_shape") or [1]) > 1:
                return f"{name}: {op.name} normalizes over the sequence dim"
            for v, sh in zip(op.inputs, op.in_shapes):
                if not self._full_rank(layer, sh):
                    a = 1 - (len(layer.out_shape) - len(sh))
                    if len(sh) > len(layer.out_shape) or (a >= 0 and int(sh[a]) not in (1, seq)):
                        return f"{name}: operand {v} {list(sh)} does not broadcast over (N, S)"
        if seq < self.parts:
            return f"{name}: sequence {seq} < {self.parts} parts (some rank would hold no position)"
        if n < self.sample:
            return f"{name}: batch {n} < {self.sample} sample parts"
        return None

    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """``price_replicated_weights`` with layout ((0, s), (1, p)): every op on N/s x S/p x E,
        whole parameters (norm weights) all-reduced over the world, saved activations at the
        local shape (1/P of the replicated layer's when s*p = P). No communication inside the
        layer: entering from a partial sum is a reduce-scatter, leaving for a replicated input
        an all-gather, both on the edges."""
        return price_replicated_weights(layer, self.sharding(), ctx)

