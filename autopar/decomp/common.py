"""Pieces shared by decompositions whose weights are replicated (sample, replicate, spatial)."""

from __future__ import annotations

import math

from .base import CostContext, LayerCost
from ..ops import family_of
from .ir import BATCH_NORM, OTHER, Layer
from .layout import Layout


def price_replicated_weights(layer: Layer, layout: Layout, ctx: CostContext,
                             extra_fwd_comm_s: float = 0.0, extra_bwd_comm_s: float = 0.0,
                             workspace_bytes: float = 0.0, bn_group_size: int = 1,
                             compute_shapes=None) -> LayerCost:
    """Price a layer whose every tensor has ``layout`` and whose weights are whole on every rank.

    compute  = sum over ops of op_compute_s(local block-0 shapes)            (primitives)
    bn stats = per batch norm (runtime ``_SyncBatchNorm``), over the G ranks whose blocks differ
               (``layout.data_group``; G = ``bn_group_size``): forward one all-reduce of a
               G x (2C+1) table, backward one all-reduce of 2C floats; zero when G = 1
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
        ins = [layout.max_local_shape(s) for s in op.in_shapes]
        out = layout.max_local_shape(op.out_shape)
        if compute_shapes is not None:
            ins, out = compute_shapes(op, ins, out)
        f, b, src = prim.op_compute_s(op, ins, out, ctx, itemsize=item)
        fwd += f
        bwd += b
        sources.add(src)
        saved += prim.saved_bytes(op, ins, out, item)
        if op.kind == BATCH_NORM and bn_group_size > 1 and op.attrs.get("training", True):
            c = op.out_shape[1]
            group = layout.data_group(0, ctx.world) if layout.splits else list(range(bn_group_size))
            g = len(group)
            bn_fwd += prim.allreduce_s(ctx, g * (2 * c + 1) * 4, group)
            bn_bwd += prim.allreduce_s(ctx, 2 * c * 4, group)
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


def batch_dim_ok(layer: Layer) -> str | None:
    """Sample splitting needs dim 0 to be the batch in every tensor of the layer, and every op
    to run on blocks of samples: dim 0 among its family's ``independent_dims`` (run unchanged
    by ``runtime.ops.call_local``) or ``synced_dims`` (batch norm: ``sync_batch_norm``).
    Unregistered ops (kind ``other``) are independent along no dim."""
    n = None
    for op in layer.ops:
        for s in list(op.in_shapes) + [op.out_shape]:
            if not s:
                return f"op {op.name} has a scalar tensor"
            if n is None:
                n = s[0]
            elif s[0] != n:
                return f"op {op.name} changes dim 0 ({n} -> {s[0]}): dim 0 is not the batch"
        fam = family_of(op.kind)
        if 0 not in fam.independent_dims(op) and 0 not in fam.synced_dims(op):
            if op.kind == OTHER:
                return f"op {op.name} ({op.target}) is not registered (autopar.ops): it runs replicated"
            if op.kind == "mean":
                return f"op {op.name} reduces over the batch dim"
            if op.kind == "cat":
                return f"op {op.name} concatenates along the batch dim"
            return f"op {op.name} ({op.kind}) does not run unchanged on blocks of samples"
    return None
