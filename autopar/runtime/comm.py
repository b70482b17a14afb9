"""Process groups and differentiable collectives for the runtime.

``Comm`` knows this rank, the world, the device, and the process groups the plan needs
(created collectively, in one deterministic order, by ``Comm.ensure_partitions``). Every
collective here is an autograd Function whose backward is the exact adjoint of its forward, as
the gradient convention of ``autopar.decomp.base`` requires:

* ``all_reduce_sum``: forward y = sum_g x; backward dx = sum_g dy.
* ``redistribute``: move a tensor from one Layout to another with one all-to-all (local copies
  where a rank already holds the data); backward sends gradients back the same way and adds
  them into the sender's block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..decomp.layout import Layout, overlap


@dataclass
class Comm:
    rank: int
    world: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict[tuple[int, ...], Any] = field(default_factory=dict)

    @staticmethod
    def from_env(device: torch.device | None = None) -> "Comm":
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if (
                dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")
        return Comm(rank, world, device)

    def ensure_partitions(self, partitions: Sequence[Sequence[Sequence[int]]]) -> None:
        """Create a process group for every rank list of every partition (collective call).

        All ranks must call this with the same partitions; groups are created in sorted order so
        that every rank issues the same sequence of ``new_group`` calls.
        """
        wanted = sorted({tuple(sorted(g)) for part in partitions for g in part
                         if 1 < len(g) < self.world})
        for ranks in wanted:
            if ranks not in self.groups:
                self.groups[ranks] = dist.new_group(list(ranks))

    def group(self, ranks: Sequence[int]) -> Any:
        key = tuple(sorted(ranks))
        if len(key) == self.world:
            return None  # the default group
        if key not in self.groups:
            raise RuntimeError(f"process group {key} was not created; the plan's partitions are "
                               f"incomplete (a bug in a decomposition's partitions())")
        return self.groups[key]


# ---------------------------------------------------------------------------------------------
# all_reduce_sum
# ---------------------------------------------------------------------------------------------
class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Comm, ranks: tuple[int, ...]):
        ctx.comm, ctx.ranks = comm, ranks
        y = x.clone()
        if len(ranks) > 1:
            dist.all_reduce(y, group=comm.group(ranks))
        return y

    @staticmethod
    def backward(ctx, dy):
        dx = dy.contiguous().clone()
        if len(ctx.ranks) > 1:
            dist.all_reduce(dx, group=ctx.comm.group(ctx.ranks))
        return dx, None, None


def all_reduce_sum(x: torch.Tensor, comm: Comm, ranks: Sequence[int]) -> torch.Tensor:
    """Sum ``x`` over ``ranks`` (differentiable; backward sums the gradients likewise)."""
    ranks = tuple(sorted(ranks))
    if len(ranks) <= 1:
        return x
    return _AllReduceSum.apply(x, comm, ranks)


# ---------------------------------------------------------------------------------------------
# redistribute
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transfer:
    src_rank: int
    dst_rank: int
    box: tuple[tuple[int, int], ...]   # global (start, extent) per dim


def _sender(src: Layout, block: int, dst_rank: int, world: int) -> int:
    """The rank that sends source ``block`` to ``dst_rank``: itself if it holds the block, else
    the replica chosen by ``dst_rank % replicas`` (spreads the load over replicas)."""
    r = src.replicas(world)
    if src.block_index(dst_rank, world) == block:
        return dst_rank
    return block * r + dst_rank % r


def transfer_plan(src: Layout, dst: Layout, shape: Sequence[int], world: int) -> list[Transfer]:
    """Every (sender, receiver, box) needed to move a tensor of global ``shape`` from ``src`` to
    ``dst``. Pure arithmetic: every rank computes the same list."""
    out: list[Transfer] = []
    for q in range(world):
        qbox = dst.local_bounds(shape, q, world)
        for b in range(src.num_blocks):
            bbox = src.block_bounds(shape, b, world)
            ov = overlap(qbox, bbox)
            if ov is None:
                continue
            out.append(Transfer(_sender(src, b, q, world), q, ov))
    return out


def transfer_bytes(src: Layout, dst: Layout, shape: Sequence[int], world: int,
                   itemsize: int) -> tuple[float, float]:
    """(max bytes any rank sends to others, max bytes any rank receives) for a redistribution."""
    sent = [0.0] * world
    recv = [0.0] * world
    for t in transfer_plan(src, dst, shape, world):
        if t.src_rank != t.dst_rank:
            n = math.prod(e for _, e in t.box) * itemsize
            sent[t.src_rank] += n
            recv[t.dst_rank] += n
    return max(sent), max(recv)


def _local_index(box, my_bounds):
    return tuple(slice(s - ms, s - ms + e) for (s, e), (ms, _) in zip(box, my_bounds))


def _exchange(x: torch.Tensor, plan: list[Transfer], my_in_bounds, my_out_bounds, out_shape,
              comm: Comm, reverse: bool) -> torch.Tensor:
    """Run a transfer plan forward (src->dst) or reversed (gradients dst->src, accumulated)."""
    me, world = comm.rank, comm.world
    if not reverse:
        sends = [t for t in plan if t.src_rank == me]
        recvs = [t for t in plan if t.dst_rank == me]
        send_to, recv_from = (lambda t: t.dst_rank), (lambda t: t.src_rank)
        in_b, out_b = my_in_bounds, my_out_bounds
    else:
        sends = [t for t in plan if t.dst_rank == me]
        recvs = [t for t in plan if t.src_rank == me]
        send_to, recv_from = (lambda t: t.src_rank), (lambda t: t.dst_rank)
        in_b, out_b = my_out_bounds, my_in_bounds
    y = torch.zeros(out_shape, dtype=x.dtype, device=x.device)
    remote = any(t.src_rank != t.dst_rank for t in plan)  # global: every rank agrees
    # local pieces
    for t in sends:
        if send_to(t) == me:
            y[_local_index(t.box, out_b)] += x[_local_index(t.box, in_b)]
    if not remote:
        return y
    send_chunks = [[] for _ in range(world)]
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
    dist.all_to_all_single(flat_out, flat_in.contiguous(), out_splits, in_splits)
    off = 0
    for q in range(world):
        for t in recv_by_rank[q]:
            n = math.prod(e for _, e in t.box)
            piece = flat_out[off:off + n].reshape([e for _, e in t.box])
            y[_local_index(t.box, out_b)] += piece
            off += n
    return y


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src: Layout, dst: Layout, shape: tuple[int, ...], comm: Comm):
        plan = transfer_plan(src, dst, shape, comm.world)
        in_b = src.local_bounds(shape, comm.rank, comm.world)
        out_b = dst.local_bounds(shape, comm.rank, comm.world)
        ctx.saved = (plan, in_b, out_b, comm)
        return _exchange(x.contiguous(), plan, in_b, out_b, [e for _, e in out_b], comm, False)

    @staticmethod
    def backward(ctx, dy):
        plan, in_b, out_b, comm = ctx.saved
        dx = _exchange(dy.contiguous(), plan, in_b, out_b, [e for _, e in in_b], comm, True)
        return dx, None, None, None, None


def redistribute(x: torch.Tensor, src: Layout, dst: Layout, shape: Sequence[int],
                 comm: Comm) -> torch.Tensor:
    """Move local block ``x`` of a tensor of global ``shape`` from layout ``src`` to ``dst``."""
    if src == dst:
        return x
    return _Redistribute.apply(x, src, dst, tuple(int(s) for s in shape), comm)


def local_slice(full: torch.Tensor, layout: Layout, comm: Comm) -> torch.Tensor:
    """This rank's block of a full tensor (no communication; for inputs and validation)."""
    b = layout.local_bounds(full.shape, comm.rank, comm.world)
    return full[tuple(slice(s, s + e) for s, e in b)]


def assemble(local: torch.Tensor, layout: Layout, shape: Sequence[int], comm: Comm,
             mode: str) -> torch.Tensor:
    """Rebuild the full tensor on every rank (validation only, not differentiable).

    ``mode="value"``: replicas hold equal values, replica 0's copy is used; ``mode="sum"``:
    replicas hold partial sums (gradients under the sum convention) and are added.
    """
    full = torch.zeros(tuple(shape), dtype=local.dtype, device=local.device)
    _, rep = layout.coords(comm.rank, comm.world)
    if mode == "sum" or rep == 0:
        b = layout.local_bounds(shape, comm.rank, comm.world)
        full[tuple(slice(s, s + e) for s, e in b)] += local.detach()
    if comm.world > 1:
        dist.all_reduce(full)
    return full
