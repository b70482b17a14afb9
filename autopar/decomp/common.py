"""Pieces shared by decompositions whose weights are replicated (sample, replicate, spatial)."""

from __future__ import annotations

import dataclasses
import math

from .base import CostContext, LayerCost
from ..ops import family_of
from ..ops.registry import batch_free_operand
from .ir import BATCH_NORM, OTHER, UNARY, Layer
from .sharding import Sharding


def price_replicated_weights(layer: Layer, layout: Sharding, ctx: CostContext,
                             extra_fwd_comm_s: float = 0.0, extra_bwd_comm_s: float = 0.0,
                             workspace_bytes: float = 0.0, bn_group_size: int = 1,
                             compute_shapes=None) -> LayerCost:
    """Price a layer whose every tensor has ``layout`` and whose weights are whole on every rank.

    compute  = sum over ops of op_compute_s(local block-0 shapes)            (primitives)
    bn stats = per training batch norm, ``bn_stats_comm_s`` (global statistics over the
               ``bn_group_size`` ranks whose blocks differ, local statistics over the ranks
               holding other spatial blocks of the same samples)
    grad     = allreduce(param bytes) over the world (replicated weights)    -> grad_sync_s
    memory   = params + grads + optimizer state (whole) + saved activations (local) + workspace
    """
    from ..cost import primitives as prim  # plan-time half: the runtime never loads cost
    fwd = bwd = 0.0
    saved = 0.0
    sources = set()
    bn_fwd = bn_bwd = 0.0
    item = layer.itemsize
    for op in layer.ops:
        ins = [layout.max_local_operand_shape(s, len(op.out_shape)) for s in op.in_shapes]
        out = layout.max_local_shape(op.out_shape)
        if compute_shapes is not None:
            ins, out = compute_shapes(op, ins, out)
        f, b, src = prim.op_compute_s(op, ins, out, ctx, itemsize=item)
        fwd += f
        bwd += b
        sources.add(src)
        saved += prim.saved_bytes(op, ins, out, item)
        if op.kind == BATCH_NORM and op.attrs.get("training", True):
            f, b = bn_stats_comm_s(op, layout, ctx, bn_group_size)
            bn_fwd += f
            bn_bwd += b
            f, b = bn_group_copies_s(op, layout, ctx)
            fwd += f
            bwd += b
    pbytes = float(layer.param_numel * item)
    gsync = prim.grad_sync_time_s(ctx, pbytes, range(ctx.world)) if pbytes else 0.0
    src = sources.pop() if len(sources) == 1 else "mixed"
    return LayerCost(fwd_compute_s=fwd, bwd_compute_s=bwd,
                     fwd_comm_s=bn_fwd + extra_fwd_comm_s, bwd_comm_s=bn_bwd + extra_bwd_comm_s,
                     grad_sync_s=gsync, grad_sync_bytes=pbytes if ctx.world > 1 else 0.0,
                     grad_sync_latency=prim.grad_sync_latency(ctx, range(ctx.world), "world") if gsync else (),
                     param_bytes=pbytes, grad_bytes=pbytes,
                     optim_bytes=prim.optimizer_bytes(ctx, pbytes),
                     activation_bytes=saved, workspace_bytes=workspace_bytes, source=src)


def bn_stats_comm_s(op, layout: Sharding, ctx: CostContext, global_group_size: int) -> tuple[float, float]:
    """Blocking communication of one training batch norm's statistics whose input has ``layout``
    (runtime ``runtime.ops.run_batch_norm``), (forward s, backward s):

    global (``ctx.batch_norm`` None or global): over the G = ``global_group_size`` ranks whose
           blocks differ (``layout.data_group``): forward one all-reduce of a G x (2C+1) table,
           backward one all-reduce of 2C floats; zero when G = 1
    local  (groups of g samples): over the A ranks holding other spatial blocks of the same
           samples (``layout.split_group`` of the spatial dims), k = n_local / g groups each:
           forward one all-reduce of an A x k x (2C+1) table, backward one of k x 2C floats;
           zero when A = 1 (sample, replicate, channel/filter: whole groups on one rank)
    The running statistics are not priced: under local statistics nothing is sent for them per
    step (``runtime.native``, ``runtime.ops.BatchNormRuntime``: combined when read).
    """
    from ..cost import primitives as prim
    c = op.out_shape[1]
    bn = getattr(ctx, "batch_norm", None)
    if bn is not None and bn.local:
        agg = layout.split_group([d for d in layout.shard_dims if d >= 2], 0, ctx.world)
        a = len(agg)
        if a <= 1:
            return 0.0, 0.0
        k = max(1, layout.max_local_shape(op.in_shapes[0])[0] // bn.group)
        return (prim.allreduce_s(ctx, a * k * (2 * c + 1) * 4, agg),
                prim.allreduce_s(ctx, k * 2 * c * 4, agg))
    if global_group_size <= 1:
        return 0.0, 0.0
    group = layout.data_group(0, ctx.world) if layout.shard_axes else list(range(global_group_size))
    g = len(group)
    return prim.allreduce_s(ctx, g * (2 * c + 1) * 4, group), prim.allreduce_s(ctx, 2 * c * 4, group)


#: ops ``runtime.ops._native_group_batch_norm`` runs beyond the batch-norm kernel when k > 1
#: groups are whole on a rank: forward the scratch statistics (2), the repeated weight and bias
#: (2), the moves of the groups into the channel dim and back (6), the group sums (8) and the
#: recorded running-statistics update (4); backward the repeats' and the moves' nodes (8)
GROUP_BN_EXTRA_OPS = (22, 8)


def bn_group_copies_s(op, layout: Sharding, ctx: CostContext) -> tuple[float, float]:
    """Compute beyond the batch-norm kernel of one training batch norm under local statistics
    whose k > 1 groups are whole on this rank (no other rank holds their spatial blocks), (forward
    s, backward s): ``runtime.ops._native_group_batch_norm`` moves the groups into the channel
    dim, ``(k, g, C, *) -> (g, k C, *)``, so that one kernel normalises every group: two copies of
    the local activation each way (``primitives.copy_s``) and ``GROUP_BN_EXTRA_OPS`` small ops,
    each at half the runtime's measured cost of an elementwise op (forward + backward,
    ``primitives.runtime_overhead_s``). Measured on the replicated ResNet-2D at 2 ranks (batch
    16, groups of 8): 0.2-0.3 ms of forward per convolution + batch-norm layer above the kernels'
    price; alone, the grouped path took 0.12-0.19 ms more forward than torch's batch norm on
    [16, C, H, W] for C = 64..16. Zero under global statistics, for one group, and where the
    groups' blocks are spread over ranks (``_GroupBatchNorm``, priced by ``bn_stats_comm_s``)."""
    bn = getattr(ctx, "batch_norm", None)
    if bn is None or not bn.local:
        return 0.0, 0.0
    if len(layout.split_group([d for d in layout.shard_dims if d >= 2], 0, ctx.world)) > 1:
        return 0.0, 0.0
    x = layout.max_local_shape(op.in_shapes[0])
    if x[0] // bn.group <= 1:
        return 0.0, 0.0
    from ..cost import primitives as prim
    copies = 2.0 * prim.copy_s(ctx, math.prod(x))
    per_op = 0.5 * prim.runtime_overhead_s(ctx.profile, UNARY) * prim._compute_slowdown(ctx)
    return copies + GROUP_BN_EXTRA_OPS[0] * per_op, copies + GROUP_BN_EXTRA_OPS[1] * per_op


def batch_dim_ok(layer: Layer, merged_parts: int | None = None) -> str | None:
    """Sample splitting needs dim 0 to be the batch in every tensor of the layer, and every op
    to run on blocks of samples: dim 0 among its family's ``independent_dims`` (run unchanged
    by ``runtime.ops.call_local``) or ``synced_dims`` (batch norm: ``sync_batch_norm``).
    Unregistered ops (kind ``other``) are independent along no dim.

    ``merged_parts``: also accept tensors whose dim 0 is the batch merged with the dims after
    it (``x.view(-1, E)`` of a ``(N, S, E)`` activation: ``N S`` rows, as Hugging Face's
    Conv1D does), when ``merged_parts`` divides the batch N (the smallest dim 0 of the layer):
    block c of the ``N S`` rows is then exactly the rows of sample block c, so a view between
    the two forms is local. Not with batch norm (its statistics are per sample group).

    Operands a broadcasting op reads whole on every block (``batch_free_operand``: a position
    embedding, a ``[1, 1, S, S]`` mask) have no batch dim to check; ``Sample.in_placement``
    keeps them whole."""
    n = None
    dims0 = []
    for op in layer.ops:
        for s in [s for s in op.in_shapes if not batch_free_operand(op, s)] + [op.out_shape]:
            if not s:
                return f"op {op.name} has a scalar tensor"
            if merged_parts is not None and math.prod(int(n) for n in s) == 0 and s is not op.out_shape:
                continue        # an empty operand (an empty cache concatenated to): no rows
            dims0.append((op, int(s[0])))
    if dims0:
        n = min(d for _, d in dims0) if merged_parts is not None else dims0[0][1]
        for op, d in dims0:
            if d == n:
                continue
            merged = (merged_parts is not None and n > 0 and d % n == 0 and n % merged_parts == 0
                      and not any(o.kind == BATCH_NORM for o in layer.ops))
            if not merged:
                return f"op {op.name} changes dim 0 ({n} -> {d}): dim 0 is not the batch"
    for op in layer.ops:
        fam = family_of(op.kind)
        op = without_batch_free_operands(op)
        if 0 not in fam.independent_dims(op) and 0 not in fam.synced_dims(op):
            if op.kind == OTHER:
                return f"op {op.name} ({op.target}) is not registered (autopar.ops): it runs replicated"
            if op.kind == "mean":
                return f"op {op.name} reduces over the batch dim"
            if op.kind == "cat":
                return f"op {op.name} concatenates along the batch dim"
            return f"op {op.name} ({op.kind}) does not run unchanged on blocks of samples"
    return None


def without_batch_free_operands(op):
    """``op`` as its blocks of samples see it: the operands read whole (``batch_free_operand``)
    left out, so the family's ``independent_dims`` judges the batched operands alone."""
    keep = [i for i, s in enumerate(op.in_shapes) if not batch_free_operand(op, s)]
    if len(keep) == len(op.in_shapes):
        return op
    return dataclasses.replace(op, inputs=[op.inputs[i] for i in keep if i < len(op.inputs)],
                               in_shapes=[op.in_shapes[i] for i in keep])


def batch_free_inputs(layer: Layer) -> frozenset[str]:
    """Values entering ``layer`` that every op consuming them reads whole under sample
    parallelism (``batch_free_operand``)."""
    whole, batched = set(), set()
    for op in layer.ops:
        for v, s in zip(op.inputs, op.in_shapes):
            (whole if batch_free_operand(op, s) else batched).add(v)
    return frozenset(whole - batched)
