"""Reduce-scatter of one tensor dim over a process group, with its adjoint allgather.

Channel and channel+filter parallelism (``autopar.decomp.channel_filter``) need, inside a layer:

* ``reduce_scatter_dim``: every rank of ``ranks`` holds a partial sum of the same tensor; each
  ends with the SUM of its own slice along ``dim``. Backward: allgather of the output gradient
  (the adjoint of "sum, then keep my slice" is "gather every slice, then give it to everyone").

gloo only scatters and gathers along dim 0 into a concatenated buffer of equal chunks
(see the environment notes), so ``dim`` is moved to the front and uneven slices (``extents``,
the ``tensor_split`` rule of ``Layout``) are zero-padded to the largest slice; padding is
dropped again after the collective, so remainders cost at most one extra row per rank.

The i-th slice belongs to the i-th smallest rank of ``ranks`` (the rank order of the group
``Comm`` creates).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .comm import Comm

# Newer torch names the dim-0 collectives *_single (the *_tensor names are deprecated there).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _pad_chunks(xt: torch.Tensor, extents: Sequence[int]) -> torch.Tensor:
    """(sum extents, ...) -> (p * max extent, ...): chunk i zero-padded to the largest."""
    m = max(extents)
    if all(e == m for e in extents):
        return xt.contiguous()
    buf = xt.new_zeros((len(extents) * m,) + tuple(xt.shape[1:]))
    off = 0
    for i, e in enumerate(extents):
        buf[i * m:i * m + e] = xt[off:off + e]
        off += e
    return buf


def _rs(x: torch.Tensor, dim: int, comm: Comm, ranks: tuple[int, ...],
        extents: tuple[int, ...]) -> torch.Tensor:
    me = ranks.index(comm.rank)
    m = max(extents)
    buf = _pad_chunks(x.movedim(dim, 0), extents)
    out = x.new_empty((m,) + tuple(buf.shape[1:]))
    _reduce_scatter(out, buf, group=comm.group(ranks))
    return out[:extents[me]].movedim(0, dim).contiguous()


def _ag(x: torch.Tensor, dim: int, comm: Comm, ranks: tuple[int, ...],
        extents: tuple[int, ...]) -> torch.Tensor:
    m = max(extents)
    xt = x.movedim(dim, 0)
    if xt.shape[0] < m:
        pad = xt.new_zeros((m - xt.shape[0],) + tuple(xt.shape[1:]))
        xt = torch.cat([xt, pad])
    buf = x.new_empty((len(extents) * m,) + tuple(xt.shape[1:]))
    _all_gather(buf, xt.contiguous(), group=comm.group(ranks))
    if any(e != m for e in extents):
        buf = torch.cat([buf[i * m:i * m + e] for i, e in enumerate(extents)])
    return buf.movedim(0, dim).contiguous()


class _ReduceScatterDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm, ranks, extents):
        ctx.args = (dim, comm, ranks, extents)
        return _rs(x, dim, comm, ranks, extents)

    @staticmethod
    def backward(ctx, dy):
        return _ag(dy, *ctx.args), None, None, None, None


def _check(x: torch.Tensor, dim: int, ranks: Sequence[int], extents: Sequence[int], total: int) -> None:
    if len(ranks) != len(extents):
        raise ValueError(f"{len(ranks)} ranks but {len(extents)} slice extents")
    if min(extents) < 1:
        raise ValueError(f"empty slice in extents {list(extents)} (a plan-time check was skipped)")
    if sum(extents) != total:
        raise ValueError(f"slice extents {list(extents)} do not add up to {total} along dim {dim} "
                         f"of a {tuple(x.shape)} tensor")


def reduce_scatter_dim(x: torch.Tensor, dim: int, comm: Comm, ranks: Sequence[int],
                       extents: Sequence[int]) -> torch.Tensor:
    """Sum ``x`` over ``ranks`` and keep this rank's slice of ``dim`` (differentiable).

    ``extents[i]``: length along ``dim`` of the slice kept by the i-th smallest rank.
    """
    ranks, extents = tuple(sorted(ranks)), tuple(int(e) for e in extents)
    dim = dim % x.dim()
    _check(x, dim, ranks, extents, x.shape[dim])
    if len(ranks) <= 1:
        return x
    return _ReduceScatterDim.apply(x, dim, comm, ranks, extents)
