"""Differentiable execution of a planned redistribution (``autopar.decomp.redistribute``).

Legend: a *dim* is a tensor dimension; an *axis* is a mesh axis. ``comm.rank`` and the ranks in
a step are mesh-local (indices into the comm's ranks); the local tensor between steps holds the
rank's valid data (``DistSpec.bounds_at``), padded only between ``Pad`` and ``Unpad``.

Each step runs as one autograd Function whose backward is the exact adjoint of its forward,
under autopar's gradient convention (``autopar.runtime.comm``: each rank back-propagates its
own share, the gradient of a replicated value is the sum of the replicas' shares)::

    AllReduce      y = sum_g x               backward: all-reduce
    ReduceScatter  y = (sum_g x)[my block]   backward: all-gather
    AllGather      y = concat_g x            backward: reduce-scatter
    AllToAll       y[box] += x_sender[box]   backward: the reverse exchange, added into the
                                             sender's block
    Slice          y = x[my box]             backward: zero-fill and place
    ToPartial      y = x on coordinate 0, else 0   (self-adjoint)
    Pad / Unpad    zero-extend / narrow      (each the other's adjoint)

gloo reduce-scatters and all-gathers only along dim 0 into a concatenated buffer of equal
chunks (environment notes): the dim is moved to the front and uneven blocks zero-padded to the
largest; the padding is dropped after the collective. ``Comm`` members used: ``rank``,
``world``, ``group(ranks)`` (mesh-local), ``ensure_partitions``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from ..decomp.distspec import DistSpec
from ..decomp.layout import Layout
from .comm import all_gather_along as _ag
from .comm import reduce_scatter_along as _rs
from ..decomp.redistribute import (AllGather, AllReduce, AllToAll, Pad, ReduceScatter, Slice,
                                   Step, ToPartial, Transfer, Unpad, plan_redistribution,
                                   transfer_bytes, transfer_plan, valid_shape)

__all__ = ["redistribute", "redistribute_spec", "run_steps", "Transfer",
           "transfer_plan", "transfer_bytes"]

def _local_index(box, my_bounds):
    """Local index of global ``box`` in a block whose valid data starts at ``my_bounds``."""
    return tuple(slice(s - ms, s - ms + e) for (s, e), (ms, _) in zip(box, my_bounds))


def _my_group(groups: Sequence[tuple[int, ...]], me: int) -> tuple[int, ...]:
    for g in groups:
        if me in g:
            return g
    raise RuntimeError(f"rank {me} is in no group of {groups}")


def _all_reduce(x: torch.Tensor, comm, group: tuple[int, ...]) -> torch.Tensor:
    y = x.contiguous().clone()
    if len(group) > 1 and y.numel():
        dist.all_reduce(y, group=comm.group(group))
    return y


def _exchange(x: torch.Tensor, transfers: Sequence[Transfer], my_in_bounds, my_out_bounds,
              out_shape, comm, reverse: bool) -> torch.Tensor:
    """Run a transfer list forward (src->dst) or reversed (gradients dst->src, accumulated)."""
    me, world = comm.rank, comm.world
    if not reverse:
        sends = [t for t in transfers if t.src_rank == me]
        recvs = [t for t in transfers if t.dst_rank == me]
        send_to, recv_from = (lambda t: t.dst_rank), (lambda t: t.src_rank)
        in_b, out_b = my_in_bounds, my_out_bounds
    else:
        sends = [t for t in transfers if t.dst_rank == me]
        recvs = [t for t in transfers if t.src_rank == me]
        send_to, recv_from = (lambda t: t.src_rank), (lambda t: t.dst_rank)
        in_b, out_b = my_out_bounds, my_in_bounds
    y = torch.zeros(tuple(out_shape), dtype=x.dtype, device=x.device)
    remote = any(t.src_rank != t.dst_rank for t in transfers)  # global: every rank agrees
    for t in sends:                                            # local pieces
        if send_to(t) == me:
            y[_local_index(t.box, out_b)] += x[_local_index(t.box, in_b)]
    if not remote:
        return y
    send_chunks: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for t in sends:
        q = send_to(t)
        if q != me:
            send_chunks[q].append(x[_local_index(t.box, in_b)].reshape(-1))
    in_splits = [sum(c.numel() for c in chunks) for chunks in send_chunks]
    recv_by_rank: list[list[Transfer]] = [[] for _ in range(world)]
    for t in recvs:
        q = recv_from(t)
        if q != me:
            recv_by_rank[q].append(t)
    out_splits = [sum(math.prod(e for _, e in t.box) for t in ts) for ts in recv_by_rank]
    flat_in = torch.cat([c for chunks in send_chunks for c in chunks]) if sum(in_splits) else \
        torch.zeros(0, dtype=x.dtype, device=x.device)
    flat_out = torch.empty(sum(out_splits), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(flat_out, flat_in.contiguous(), out_splits, in_splits,
                           group=comm.group(range(comm.world)))
    off = 0
    for q in range(world):
        for t in recv_by_rank[q]:
            n = math.prod(e for _, e in t.box)
            y[_local_index(t.box, out_b)] += flat_out[off:off + n].reshape([e for _, e in t.box])
            off += n
    return y


# ---- one step, both directions ----------------------------------------------------------------
def _narrow(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    return x.narrow(dim, 0, n).contiguous()


def _extend(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = n
    y = x.new_zeros(shape)
    y.narrow(dim, 0, x.shape[dim]).copy_(x)
    return y


def _forward(st: Step, x: torch.Tensor, comm) -> torch.Tensor:
    me = comm.rank
    s, d = st.src, st.dst
    if isinstance(st, Unpad):
        return _narrow(x, st.dim, s.bounds_at(me)[st.dim][1])
    if isinstance(st, Pad):
        return _extend(x, st.dim, d.shape_at(me)[st.dim])
    if isinstance(st, Slice):
        return x[_local_index(d.bounds_at(me), s.bounds_at(me))].contiguous()
    if isinstance(st, ToPartial):
        return x.clone() if _my_group(st.groups, me)[0] == me else torch.zeros_like(x)
    if isinstance(st, AllReduce):
        return _all_reduce(x, comm, _my_group(st.groups, me))
    if isinstance(st, ReduceScatter):
        g = _my_group(st.groups, me)
        return _rs(x, st.dim, comm, g, [d.bounds_at(k)[st.dim][1] for k in g], valid_shape(d, me))
    if isinstance(st, AllGather):
        g = _my_group(st.groups, me)
        return _ag(x, st.dim, comm, g, [s.bounds_at(k)[st.dim][1] for k in g], valid_shape(d, me))
    if isinstance(st, AllToAll):
        return _exchange(x, st.transfers, s.bounds_at(me), d.bounds_at(me), valid_shape(d, me),
                         comm, False)
    raise TypeError(f"unknown step {st!r}")


def _adjoint(st: Step, dy: torch.Tensor, comm) -> torch.Tensor:
    me = comm.rank
    s, d = st.src, st.dst
    dy = dy.contiguous()
    if isinstance(st, Unpad):
        return _extend(dy, st.dim, s.shape_at(me)[st.dim])
    if isinstance(st, Pad):
        return _narrow(dy, st.dim, d.bounds_at(me)[st.dim][1])
    if isinstance(st, Slice):
        dx = dy.new_zeros(valid_shape(s, me))
        dx[_local_index(d.bounds_at(me), s.bounds_at(me))] = dy
        return dx
    if isinstance(st, ToPartial):
        return dy.clone() if _my_group(st.groups, me)[0] == me else torch.zeros_like(dy)
    if isinstance(st, AllReduce):
        return _all_reduce(dy, comm, _my_group(st.groups, me))
    if isinstance(st, ReduceScatter):      # adjoint of "sum, keep my block": all-gather
        g = _my_group(st.groups, me)
        return _ag(dy, st.dim, comm, g, [d.bounds_at(k)[st.dim][1] for k in g], valid_shape(s, me))
    if isinstance(st, AllGather):          # adjoint of "concatenate": reduce-scatter
        g = _my_group(st.groups, me)
        return _rs(dy, st.dim, comm, g, [s.bounds_at(k)[st.dim][1] for k in g], valid_shape(s, me))
    if isinstance(st, AllToAll):
        return _exchange(dy, st.transfers, s.bounds_at(me), d.bounds_at(me), valid_shape(s, me),
                         comm, True)
    raise TypeError(f"unknown step {st!r}")


class _StepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step, comm):
        ctx.step, ctx.comm = step, comm
        return _forward(step, x.contiguous(), comm)

    @staticmethod
    def backward(ctx, dy):
        return _adjoint(ctx.step, dy, ctx.comm), None, None


# ---- entry points ---------------------------------------------------------------------------
def _ensure_groups(steps: Sequence[Step], comm) -> None:
    """Create the process groups the steps use (collective: every rank runs the same plan)."""
    parts = [st.groups for st in steps if isinstance(st, (AllReduce, ReduceScatter, AllGather))]
    if parts:
        comm.ensure_partitions(parts)


def run_steps(x: torch.Tensor, steps: Sequence[Step], comm) -> torch.Tensor:
    """Run planned ``steps`` on this rank's local block ``x`` (differentiable)."""
    _ensure_groups(steps, comm)
    for st in steps:
        x = _StepFn.apply(x, st, comm)
    return x


def redistribute_spec(x: torch.Tensor, src: DistSpec, dst: DistSpec, comm) -> torch.Tensor:
    """Move local block ``x`` from ``src`` to ``dst`` (both on the comm's ranks)."""
    if src.mesh.size != comm.world:
        raise ValueError(f"spec on {src.mesh} run by a comm of {comm.world} ranks")
    return run_steps(x, plan_redistribution(src, dst), comm)


def redistribute(x: torch.Tensor, src: Layout, dst: Layout, shape: Sequence[int],
                 comm) -> torch.Tensor:
    """Move local block ``x`` of a tensor of global ``shape`` from layout ``src`` to ``dst``
    (the planned steps of ``autopar.decomp.transition.plan_layouts``)."""
    if src == dst:
        return x
    from ..decomp.transition import plan_layouts
    return run_steps(x, plan_layouts(src, dst, tuple(int(s) for s in shape), comm.world), comm)


def local_piece(full: torch.Tensor, spec: DistSpec, comm) -> torch.Tensor:
    """This rank's local tensor of ``full`` under ``spec`` (padding zero; on partial axes the
    whole value at coordinate 0, zeros elsewhere). No communication."""
    i = comm.rank
    b = spec.bounds_at(i)
    local = full.new_zeros(spec.shape_at(i))
    if not any(spec.partial_key(i)):
        local[tuple(slice(0, e) for _, e in b)] = full[tuple(slice(s, s + e) for s, e in b)]
    return local
