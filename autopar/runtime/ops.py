"""Local execution of one traced op, and batch normalisation with statistics over a group.

``call_local`` runs an op exactly as traced, on local tensors, after substituting references
(``{"v"}``, ``{"p"}``, ``{"b"}``) and, for ops whose arguments name sizes (view/reshape), the
local extents. Decompositions use it for every op whose mathematics is unchanged by their split
(e.g. any elementwise op, or a convolution under sample parallelism).

``sync_batch_norm`` computes the batch statistics over every rank of ``ranks`` (per-rank mean
and centred sum of squares, combined exactly), so that a batch norm over split samples or split
spatial extents computes the single-process function.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .comm import Comm


@functools.lru_cache(maxsize=None)
def resolve_target(target: str):
    """'aten.conv2d.default' -> torch.ops.aten.conv2d.default (only torch.ops namespaces)."""
    parts = target.split(".")
    if len(parts) < 2 or parts[0] not in ("aten", "prims"):
        raise ValueError(f"unsupported op target {target!r}")
    obj = getattr(torch.ops, parts[0])
    for p in parts[1:]:
        obj = getattr(obj, p)
    return obj


def substitute(template: Any, values: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
               buffers: dict[str, torch.Tensor]) -> Any:
    if isinstance(template, dict):
        if "v" in template and len(template) == 1:
            return values[template["v"]]
        if "p" in template and len(template) == 1:
            return params[template["p"]]
        if "b" in template and len(template) == 1:
            return buffers[template["b"]]
        if "dtype" in template and len(template) == 1:
            return getattr(torch, template["dtype"])
        return {k: substitute(v, values, params, buffers) for k, v in template.items()}
    if isinstance(template, list):
        return [substitute(v, values, params, buffers) for v in template]
    return template


def local_sizes(sizes: Sequence[int], global_out: Sequence[int], local_out: Sequence[int]) -> list[int]:
    """Rewrite a view/reshape size list for the local block (dims whose extent changed)."""
    sizes = list(sizes)
    if len(sizes) == len(global_out):
        return [int(l) if (s == g or s == -1) else s for s, g, l in zip(sizes, global_out, local_out)]
    return sizes


def call_local(op: Any, inputs: Sequence[torch.Tensor], params: dict[str, torch.Tensor],
               buffers: dict[str, torch.Tensor], local_out_shape: Sequence[int] | None = None) -> torch.Tensor:
    """Run ``op`` (an OpSpec) unchanged on local tensors."""
    values = dict(zip(op.inputs, inputs))
    args = substitute(op.args, values, params, buffers)
    kwargs = substitute(op.kwargs, values, params, buffers)
    if op.kind == "view" and local_out_shape is not None and len(args) >= 2 and isinstance(args[1], list):
        args[1] = local_sizes(args[1], op.out_shape, local_out_shape)
    return resolve_target(op.target)(*args, **kwargs)


class _SyncBatchNorm(torch.autograd.Function):
    """Batch norm over a group: one all-gather forward, one all-reduce backward.

    forward:  each rank shares (n_r, mean_r, M2_r) per channel (one all-reduce of a table) (M2_r = sum (x - mean_r)^2);
              every rank combines them (Chan et al.): N = sum n_r, mean = sum n_r mean_r / N,
              M2 = sum M2_r + n_r (mean_r - mean)^2, var = M2 / N; y = (x - mean) / sqrt(var +
              eps) * w + b.
    backward: S1 = sum_g sum dy, S2 = sum_g sum dy * xhat (one all-reduce of 2C floats);
              dx = w / sqrt(var + eps) * (dy - S1 / N - xhat * S2 / N); dw, db are the local
              partial sums (the gradient sync adds them over the ranks).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, comm, ranks, running_mean, running_var, momentum):
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        c = x.shape[1]
        n_local = x.numel() // c
        mean_r = x.mean(dims) if n_local else torch.zeros(c, dtype=x.dtype, device=x.device)
        m2_r = ((x - mean_r.reshape(shape)) ** 2).sum(dims)
        mine = torch.cat([torch.full((1,), float(n_local), dtype=x.dtype, device=x.device), mean_r, m2_r])
        # all-gather through an all-reduce of a zero-padded table (one row per rank): the
        # same bytes order of magnitude for 2C+1 floats, and one API on every backend
        g = torch.zeros(len(ranks), mine.numel(), dtype=x.dtype, device=x.device)
        g[list(ranks).index(comm.rank)] = mine
        dist.all_reduce(g, group=comm.group(ranks))
        n_g = g[:, :1]
        n = n_g.sum()
        mean = (n_g * g[:, 1:1 + c]).sum(0) / n
        m2 = (g[:, 1 + c:] + n_g * (g[:, 1:1 + c] - mean) ** 2).sum(0)
        var = m2 / n
        invstd = torch.rsqrt(var + eps)
        xhat = (x - mean.reshape(shape)) * invstd.reshape(shape)
        y = xhat
        if weight is not None:
            y = y * weight.reshape(shape)
        if bias is not None:
            y = y + bias.reshape(shape)
        if running_mean is not None and running_var is not None:
            m = 0.1 if momentum is None else momentum
            nn = float(n)
            running_mean.mul_(1 - m).add_(mean, alpha=m)
            running_var.mul_(1 - m).add_(var * (nn / max(nn - 1.0, 1.0)), alpha=m)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.meta = (comm, ranks, float(n), weight is not None, bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        comm, ranks, n, has_w, has_b = ctx.meta
        dims = [0] + list(range(2, dy.dim()))
        shape = [1, -1] + [1] * (dy.dim() - 2)
        s1 = dy.sum(dims)
        s2 = (dy * xhat).sum(dims)
        both = torch.cat([s1, s2])
        dist.all_reduce(both, group=comm.group(ranks))
        c = s1.numel()
        t1, t2 = both[:c], both[c:]
        scale = invstd if weight is None else invstd * weight
        dx = scale.reshape(shape) * (dy - (t1 / n).reshape(shape) - xhat * (t2 / n).reshape(shape))
        return (dx, s2 if has_w else None, s1 if has_b else None, None, None, None, None, None, None)


def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    training: bool, momentum: float, eps: float, comm: Comm,
                    ranks: Sequence[int]) -> torch.Tensor:
    """Batch norm whose statistics cover every rank of ``ranks`` (``_SyncBatchNorm``; the
    per-rank sample counts are gathered with the statistics); the plain local batch norm when
    not training or alone."""
    if not training or len(ranks) <= 1:
        return torch.nn.functional.batch_norm(x, running_mean, running_var, weight, bias,
                                              training, momentum, eps)
    return _SyncBatchNorm.apply(x, weight, bias, eps, comm, tuple(sorted(ranks)),
                                running_mean, running_var, momentum)


def run_batch_norm(op: Any, inputs: Sequence[torch.Tensor], params: dict[str, torch.Tensor],
                   buffers: dict[str, torch.Tensor], comm: Comm, ranks: Sequence[int],
                   channels: tuple[int, int] | None = None) -> torch.Tensor:
    """A traced ``aten.batch_norm`` (x, weight, bias, running_mean, running_var, training,
    momentum, eps) on this rank's block, its statistics over the mesh ranks ``ranks``: the one
    batch-norm runtime every decomposition uses. ``channels`` = (start, extent) of this rank's
    channel block when the channels are split: the running statistics are updated in that
    slice (views of the whole buffers)."""
    x, w, b, rm, rv, training, momentum, eps = substitute(
        op.args[:8], dict(zip(op.inputs, inputs)), params, buffers)
    if channels is not None:
        start, ext = channels
        rm = rm[start:start + ext] if rm is not None else None
        rv = rv[start:start + ext] if rv is not None else None
    return sync_batch_norm(x, w, b, rm, rv, training, momentum, eps, comm, ranks)
