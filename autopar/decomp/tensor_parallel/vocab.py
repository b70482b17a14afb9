"""Vocabulary-parallel embedding (Megatron-LM), with data parallelism: ``vocab(s, p)``.

The table w_VD (V tokens, width D) is split by rows over the tensor axis: rank ``c_t`` holds
rows [v0, v0 + V_c) by the ``tensor_split`` rule, so a vocabulary that p does not divide is
split exactly into uneven blocks (no padding; only V < p is rejected). Every rank of a tensor
group reads all the token ids of its samples (ids replicated over the group, ``((0, s),)``);
ids outside its rows give zeros, so the outputs of the group add up to the lookup: the layer
leaves a partial sum ``((0, s),), partial=p``, resolved by the consumer's edge (an all-reduce,
or a reduce-scatter into a sequence-parallel layer). The gradient of a row exists on the one
rank that holds it (masked rows get zero), summed over the s sample replicas of the shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..base import CostContext, Decomposition, LayerCost, ParamShard, register
from ..common import batch_dim_ok
from ..ir import EMBEDDING, Layer, OpSpec
from ..sharding import Sharding, Partial, Shard, block_extent
from .common import grad_sync, mesh, mesh_check, partition, two_axis_candidates


@register
@dataclass(frozen=True)
class VocabParallel(Decomposition):
    """Embedding rows over ``parts`` ranks, samples over ``sample``."""

    sample: int = 1
    parts: int = 2
    kind = "vocab"
    supported_ops = frozenset({EMBEDDING})

    def in_placement(self, layer: Layer, value: str) -> Sharding:
        return Sharding.of((Shard(0), self.sample))

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        return Sharding.of((Shard(0), self.sample), (Partial(), self.parts))

    def param_shard(self, op: OpSpec, role: str) -> ParamShard:
        if op.kind == EMBEDDING and role == "weight":
            return ParamShard.on(mesh(self.sample, self.parts), ((0, 0 if self.sample == 1 else 1),))
        return ParamShard()

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        return [[list(g) for g in partition(self.sample, self.parts, "s")]] if self.sample > 1 else []

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        if len(layer.ops) != 1 or layer.anchor.kind != EMBEDDING:
            return []
        return two_axis_candidates(cls, ctx)

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        why = mesh_check(self, layer, ctx)
        if why:
            return why
        name = layer.module or layer.name
        if len(layer.ops) != 1:
            return f"{name}: an op after the embedding would run on a partial sum"
        op = layer.anchor
        w = op.params.get("weight")
        if not w or len(w) != 2 or "weight" not in op.param_names:
            return f"{name}: the embedding table is not a 2-d parameter"
        if int(w[0]) < self.parts:
            return f"{name}: vocabulary {w[0]} < {self.parts} parts (some rank would hold no row)"
        if op.args[2:3] and op.args[2] not in (-1, None):
            return f"{name}: padding_idx is not supported by the vocabulary split"
        if self.sample > 1:
            why = batch_dim_ok(layer)
            if why:
                return f"{name}: {why}"
            if int(op.in_shapes[0][0]) < self.sample:
                return f"{name}: batch {op.in_shapes[0][0]} < {self.sample} sample parts"
        return None

    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """compute  = op_compute_s(embedding, ids (N/s, ...), y (N/s, ..., D)) plus the mask (an
                   elementwise pass over y, priced with the op: every rank writes its whole
                   y block, zeros included)
        comm     = 0 (the partial sum is resolved on the outgoing edge)
        grad     = T_allreduce(s, V_0 D bytes) among the shard's sample replicas (V_0: the
                   largest block of rows, ceil(V / p))
        memory   = V_0 D (param) + V_0 D (grad) + optimizer_state_per_param * V_0 D + saved ids
        """
        from ...cost import primitives as prim
        op = layer.anchor
        item = layer.itemsize
        ids = list(op.in_shapes[0])
        out = list(op.out_shape)
        if self.sample > 1:
            ids[0] = out[0] = block_extent(int(ids[0]), self.sample, 0)
        w = op.params["weight"]
        w_loc = (block_extent(int(w[0]), self.parts, 0), int(w[1]))
        f, b, src = prim.op_compute_s(op, [ids], out, ctx, w_shape=w_loc, itemsize=item)
        pbytes = float(math.prod(w_loc) * item)
        gs, synced, latency = grad_sync(ctx, pbytes, 0.0, self.sample, self.parts)
        return LayerCost(fwd_compute_s=2 * f, bwd_compute_s=b, grad_sync_s=gs, grad_sync_bytes=synced,
                         grad_sync_latency=latency, param_bytes=pbytes, grad_bytes=pbytes,
                         optim_bytes=prim.optimizer_bytes(ctx, pbytes),
                         activation_bytes=prim.saved_bytes(op, [ids], out, item), source=src)


from ..channel_filter import Filter  # noqa: E402  (the column-parallel linear it extends)


@register
@dataclass(frozen=True)
class VocabHead(Filter):
    """The language-model head as a column-parallel linear whose vocabulary-split logits are
    never gathered: the loss runs vocabulary-parallel on them (``cross_entropy``: max, sum of
    exponentials and target logit all-reduced over the tensor group). Legal only for the layer
    that makes the model's output, a lone linear, when the model file's loss is one
    cross-entropy over the logits' last dim (``CostContext.loss_output``, set by the planner
    from ``cross_entropy.loss_is_cross_entropy``). Layouts, shards and compute as ``filter``.
    """

    kind = "vocab_head"
    #: the loss is computed on the output layout itself (``runtime.model.DistModel.loss_layout``)
    loss_in_place = True

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        if not getattr(ctx, "loss_output", None) or layer.output != ctx.loss_output:
            return []
        if len(layer.ops) != 1 or layer.anchor.kind != "linear":
            return []
        return two_axis_candidates(cls, ctx)

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        why = super().check(layer, ctx)
        if why:
            return why
        if len(layer.ops) != 1:
            return f"{layer.module or layer.name}: ops after the head would need the whole logits"
        if layer.output != getattr(ctx, "loss_output", None):
            return (f"{layer.module or layer.name}: the vocabulary-parallel loss needs the model's output "
                    f"and a cross-entropy loss_fn")
        return None

    def param_shard(self, op: OpSpec, role: str) -> ParamShard:
        """Filter's shard (the weight's rows and the bias, by vocabulary block ``c_t``), spelled
        on the (s, p) mesh of ``vocab(s, p)``: the same value as the embedding table's shard,
        so a tied table (GPT-2's lm_head weight is wte's) split by both is one shard
        (``cost.table.tied_choice_sets``). Filter's (s, 1, p) grid puts the same rank on the
        same block: ``rank = c_s p + c_f``."""
        if op.kind == "linear" and role in ("weight", "bias"):
            return ParamShard.on(mesh(self.sample, self.parts), ((0, 0 if self.sample == 1 else 1),))
        return ParamShard()

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        """Filter's groups and the tensor groups the loss all-reduces over."""
        return super().partitions(layer, world) + [[list(g) for g in self.partition("f")]]

    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """``filter``'s cost plus the vocabulary-parallel loss on M = N/s x (other dims) tokens:
        forward 3 blocking T_allreduce(p, 8 M bytes) (max, sum of exponentials, target logit, in
        the validation dtype's width at most), backward 1 (the loss gradient). What it saves is
        not priced, as the loss is priced for no plan: the gather of M x V logits that a
        sample-split loss needs (time and memory), and the loss's own M x V softmax (M x V/p
        here). The planner therefore prefers ``filter`` for the head unless told otherwise."""
        from dataclasses import replace
        from ...cost import primitives as prim
        c = super().cost(layer, ctx)
        out = self.out_placement(layer).max_local_shape(layer.out_shape)
        m = math.prod(out[:-1])
        groups = self.partition("f")
        level = ctx.worst_level(groups)
        fwd = 3 * prim.blocking_s(ctx, "allreduce", self.parts, 8 * m, level)
        bwd = prim.blocking_s(ctx, "allreduce", self.parts, 8 * m, level)
        return replace(c, fwd_comm_s=c.fwd_comm_s + fwd, bwd_comm_s=c.bwd_comm_s + bwd)

