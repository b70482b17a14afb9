"""Branch-boundary communication (LBANN's grid translation), each op with its exact adjoint.

Run-time half of ``autopar.decomp.branch`` (``runtime.layers.branch``), imported only by the runtime (torch and
``torch.distributed``). ``group`` is a tuple of mesh-local ranks (``comm.group`` makes the
process group), ``root`` the group member that holds the parent grid's copy.

Adjoints are taken under the inner product that sums every rank's local tensor (the one
autopar's gradient convention uses: the gradient of a replicated value is the sum of its
replicas' shares)::

    branch_split  fork:  y_i = x_root on every member      backward: dx_root = sum_i dy_i
                                                            (all-reduce; kept on the root)
    branch_sum    join:  y_i = sum_j x_j on every member   backward: dx_i = sum_j dy_j
                                                            (all-reduce)
    branch_slice  fork:  y_i = x_root[chunk i] (scatter)   backward: dx_root = concat_i dy_i
                                                            (gather), zero elsewhere

LBANN writes split as "broadcast forward / all-reduce backward" and sum as "all-reduce forward
/ broadcast backward": the same maps under its convention that every replica holds the whole
gradient (then the reduce onto the root is an all-reduce, and the all-reduce of identical
replicated gradients a broadcast). ``tests/test_branches.py`` checks each by the dot-product
test <A x, y> = <x, A^T y> over the ranks.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def _grp(comm, group):
    return comm.group(tuple(group))


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, group, root):
        ctx.comm, ctx.group, ctx.root = comm, group, root
        y = x.detach().clone().contiguous()
        dist.broadcast(y, src=comm.global_rank(root), group=_grp(comm, group))
        return y

    @staticmethod
    def backward(ctx, dy):
        dx = dy.contiguous().clone()
        dist.all_reduce(dx, group=_grp(ctx.comm, ctx.group))
        if ctx.comm.rank != ctx.root:
            dx.zero_()
        return dx, None, None, None


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, group):
        ctx.comm, ctx.group = comm, group
        y = x.detach().clone().contiguous()
        dist.all_reduce(y, group=_grp(comm, group))
        return y

    @staticmethod
    def backward(ctx, dy):
        dx = dy.contiguous().clone()
        dist.all_reduce(dx, group=_grp(ctx.comm, ctx.group))
        return dx, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, group, root, dim):
        ctx.comm, ctx.group, ctx.root, ctx.dim = comm, group, root, dim
        ctx.shape = tuple(x.shape)
        k = len(group)
        me = group.index(comm.rank)
        n = x.shape[dim] // k
        out_shape = list(x.shape)
        out_shape[dim] = n
        y = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        chunks = None
        if comm.rank == root:
            chunks = [c.contiguous() for c in x.detach().split(n, dim)]
        dist.scatter(y, chunks, src=comm.global_rank(root), group=_grp(comm, group))
        ctx.me = me
        return y

    @staticmethod
    def backward(ctx, dy):
        comm, group, root = ctx.comm, ctx.group, ctx.root
        dy = dy.contiguous()
        bufs = [torch.empty_like(dy) for _ in group] if comm.rank == root else None
        dist.gather(dy, bufs, dst=comm.global_rank(root), group=_grp(comm, group))
        if comm.rank == root:
            dx = torch.cat(bufs, dim=ctx.dim)
        else:
            dx = torch.zeros(ctx.shape, dtype=dy.dtype, device=dy.device)
        return dx, None, None, None, None


def branch_split(x: torch.Tensor, comm, group: Sequence[int], root: int | None = None) -> torch.Tensor:
    """Fork: every member of ``group`` gets ``root``'s ``x`` (broadcast); backward reduces the
    branches' gradients onto the root."""
    group = tuple(group)
    if len(group) <= 1:
        return x
    return _Split.apply(x, comm, group, group[0] if root is None else root)


def branch_sum(x: torch.Tensor, comm, group: Sequence[int]) -> torch.Tensor:
    """Join: the sum of the members' partial values on every member (all-reduce); backward
    all-reduces the gradients."""
    group = tuple(group)
    if len(group) <= 1:
        return x
    return _Sum.apply(x, comm, group)


def branch_slice(x: torch.Tensor, comm, group: Sequence[int], dim: int,
                 root: int | None = None) -> torch.Tensor:
    """Fork by slices: member i gets chunk i of ``root``'s ``x`` along ``dim`` (scatter; the
    extent must divide by the group size); backward gathers the chunks' gradients on the root."""
    group = tuple(sorted(group))
    if len(group) <= 1:
        return x
    root = group[0] if root is None else root
    if x.shape[dim] % len(group):
        raise ValueError(f"branch_slice: extent {x.shape[dim]} of dim {dim} does not divide into "
                         f"{len(group)} branches")
    return _Slice.apply(x, comm, group, root, dim)
