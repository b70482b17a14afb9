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

Between different meshes (``redistribute_across``): the meshes' ``ranks`` are the comm's
ranks; the steps on one mesh run on that mesh's ranks as above (mesh-local, through a view of
the comm), and ``MeshSend`` runs as point-to-point messages, one per (sender, receiver) pair
(its boxes concatenated in transfer order), every receive and send posted before any is waited
on. Its adjoint sends each receiver's gradient boxes back to their sender, added into the
sender's gradient (a box sent to several replicas gets the sum of their shares, as AllToAll).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from ..decomp.distspec import DistSpec
from ..decomp.sharding import Sharding
from ..decomp.mesh import Mesh
from ..errors import AutoparError
from .comm import all_gather_along as _ag
from .comm import reduce_scatter_along as _rs
from ..decomp.redistribute import (AllGather, AllReduce, AllToAll, MeshSend, Pad, ReduceScatter,
                                   Slice, Step, ToPartial, Transfer, Unpad, plan_redistribution,
                                   transfer_bytes, transfer_plan, valid_shape)
from ..decomp.transition import plan_layouts

__all__ = ["redistribute", "redistribute_spec", "redistribute_across", "run_steps", "Transfer",
           "transfer_plan", "transfer_bytes", "RedistributionError"]

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


def redistribute(x: torch.Tensor, src: Sharding, dst: Sharding, shape: Sequence[int],
                 comm) -> torch.Tensor:
    """Move local block ``x`` of a tensor of global ``shape`` from sharding ``src`` to ``dst``
    (the planned steps of ``autopar.decomp.transition.plan_layouts``: between the owned
    blocks, none into a ``HaloShard`` over the same blocks)."""
    if src.owned() == dst.owned():
        return x
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


# ---- between different meshes (Mesh-to-mesh) --------------------------------------------------
class RedistributionError(AutoparError):
    """A redistribution that cannot run as asked (names the specs, the rank and what to do)."""


class _OnMesh:
    """The comm seen from one mesh: ``rank``/``world`` mesh-local, groups mapped to the comm's
    ranks (``Mesh.ranks``), for the steps that run on that mesh."""

    def __init__(self, comm, mesh: Mesh) -> None:
        self.comm, self.mesh = comm, mesh
        self.rank, self.world = mesh.index_of(comm.rank), mesh.size
        self.device = comm.device

    def group(self, ranks: Sequence[int]):
        return self.comm.group([self.mesh.ranks[i] for i in ranks])


def _ordered(st: Step) -> bool:
    """The process groups order members by rank: a collective that places blocks by position
    needs each group's ranks increasing in coordinate order (the whole mesh's, for AllToAll)."""
    ranks = st.src.mesh.ranks
    if isinstance(st, AllToAll):
        return list(ranks) == sorted(ranks)
    if isinstance(st, (ReduceScatter, AllGather)):
        return all([ranks[i] for i in g] == sorted(ranks[i] for i in g) for g in st.groups)
    return True


def _move_boxes(x: torch.Tensor | None, st: MeshSend, comm, dtype, reverse: bool) -> torch.Tensor | None:
    """Run ``st``'s transfers forward (src -> dst, values) or reversed (dst -> src, gradients);
    ``x``: this rank's block on the sending side (None off it). Returns the block on the
    receiving side, added up from the boxes (None off it)."""
    me = comm.rank
    ins, outs = (st.dst, st.src) if reverse else (st.src, st.dst)
    sender = (lambda t: t.dst_rank) if reverse else (lambda t: t.src_rank)
    receiver = (lambda t: t.src_rank) if reverse else (lambda t: t.dst_rank)
    y = None
    if me in outs.mesh.ranks:
        y = torch.zeros(valid_shape(outs, outs.mesh.index_of(me)), dtype=dtype, device=comm.device)
        ob = outs.local_bounds(me)
    ib = ins.local_bounds(me) if me in ins.mesh.ranks else None
    outgoing: dict[int, list[torch.Tensor]] = {}
    incoming: dict[int, list[Transfer]] = {}
    for t in st.transfers:
        s, r = sender(t), receiver(t)
        if s == me and r == me:
            y[_local_index(t.box, ob)] += x[_local_index(t.box, ib)]
        elif s == me:
            outgoing.setdefault(r, []).append(x[_local_index(t.box, ib)].reshape(-1))
        elif r == me:
            incoming.setdefault(s, []).append(t)
    bufs = {q: torch.empty(sum(math.prod(e for _, e in t.box) for t in ts), dtype=dtype, device=comm.device)
            for q, ts in incoming.items()}
    msgs = {q: torch.cat(chunks).contiguous() for q, chunks in outgoing.items()}
    reqs = [dist.irecv(bufs[q], src=comm.ranks[q]) for q in sorted(bufs)]
    reqs += [dist.isend(msgs[q], dst=comm.ranks[q]) for q in sorted(msgs)]
    for req in reqs:
        req.wait()
    for q, ts in incoming.items():
        off = 0
        for t in ts:
            n = math.prod(e for _, e in t.box)
            y[_local_index(t.box, ob)] += bufs[q][off:off + n].reshape([e for _, e in t.box])
            off += n
    return y


class _MeshSendFn(torch.autograd.Function):
    """``x``: this rank's block on the source mesh, or an empty token off it; returns the block
    on the destination mesh, or an empty token off it (the token carries the autograd edge)."""

    @staticmethod
    def forward(ctx, x, step, comm):
        ctx.step, ctx.comm = step, comm
        ctx.dtype, ctx.in_src = x.dtype, comm.rank in step.src.mesh.ranks
        y = _move_boxes(x.contiguous() if ctx.in_src else None, step, comm, x.dtype, False)
        return y if y is not None else x.new_zeros(0)

    @staticmethod
    def backward(ctx, dy):
        st, comm = ctx.step, ctx.comm
        in_dst = comm.rank in st.dst.mesh.ranks
        dx = _move_boxes(dy.contiguous() if in_dst else None, st, comm, ctx.dtype, True)
        return (dx if ctx.in_src else dy.new_zeros(0)), None, None


def redistribute_across(x: torch.Tensor | None, src: DistSpec, dst: DistSpec, comm,
                        dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """Move a tensor from ``src`` to ``dst`` whose meshes may differ (a stage to the next, a
    sub-mesh to the world and back; ``plan_redistribution``). The meshes' ranks are ``comm``'s
    (mesh-local) ranks; on the whole world, the torch.distributed ranks.

    ``x``: this rank's local tensor under ``src`` (``src.local_shape``), None on a rank off the
    source mesh. Returns this rank's local tensor under ``dst``; on a rank of the source mesh
    off the destination an empty tensor (shape (0,)) that carries the autograd edge; None on a
    rank of neither. ``dtype``: of the received blocks on ranks without ``x`` (default: torch's
    default dtype); every rank must agree.

    Who calls: every rank of the two meshes; every process of ``comm`` as well when a step runs
    a collective on one mesh (the source is Partial, or the two meshes have the same ranks: its
    process groups are created here, collectively, the first time). Differentiable: under grad
    mode every rank of both meshes runs backward through its result (a rank off the destination
    adds ``y.sum()``, zero, to its loss) with ``x`` requiring grad on the source ranks, since the
    gradient boxes travel back point to point.
    """
    me = comm.rank
    for m in (src.mesh, dst.mesh):
        if max(m.ranks) >= comm.world:
            raise RedistributionError(f"{m} names rank {max(m.ranks)} but the comm has {comm.world} ranks",
                                      "give meshes of the comm's ranks (the world's by default)")
    steps = plan_redistribution(src, dst)
    for st in steps:
        if not _ordered(st):
            raise RedistributionError(
                f"{type(st).__name__} of {st.src} -> {st.dst} on {st.src.mesh}: the mesh's ranks do not "
                f"increase along the axis, and process groups order members by rank",
                "lay the mesh's ranks in increasing order (Mesh(sorted ranks, ...)), or run the move with "
                "redistribute_spec on a Comm of the mesh")
    parts = []
    for st in steps:
        if isinstance(st, (AllReduce, ReduceScatter, AllGather, AllToAll)):
            r = st.src.mesh.ranks
            parts.append([[r[i] for i in g] for g in st.groups] + [list(r)])
    if parts:
        comm.ensure_partitions(parts)
    in_src, in_dst = me in src.mesh.ranks, me in dst.mesh.ranks
    if not (in_src or in_dst):
        return None
    if in_src:
        if x is None or tuple(x.shape) != src.local_shape(me):
            raise RedistributionError(
                f"rank {me} of {src.mesh} passed {None if x is None else tuple(x.shape)} for {src} of "
                f"{src.shape}", f"pass its local tensor of shape {src.local_shape(me)}")
    else:
        x = torch.zeros(0, dtype=dtype or torch.get_default_dtype(), device=comm.device,
                        requires_grad=torch.is_grad_enabled())
    for st in steps:
        if isinstance(st, MeshSend):
            x = _MeshSendFn.apply(x, st, comm)
        elif me in st.src.mesh.ranks:
            x = _StepFn.apply(x, st, _OnMesh(comm, st.src.mesh))
    return x
