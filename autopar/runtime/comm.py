"""Process groups and differentiable collectives for the runtime.

``Comm`` knows this rank, the world, the device, and the process groups the plan needs
(created collectively, in one deterministic order, by ``Comm.ensure_partitions``). Every
collective here is an autograd Function whose backward is the exact adjoint of its forward, as
the gradient convention of ``autopar.decomp.base`` requires:

* ``all_reduce_sum``: forward y = sum_g x; backward dx = sum_g dy.
* ``redistribute`` (now in ``autopar.runtime.redistribute``, re-exported here because generated
  code imports it from this module): move a tensor from one Layout to another by the planned
  steps of ``autopar.decomp.redistribute``; each step's backward is its adjoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..decomp.layout import Layout
# moved to ``runtime.redistribute`` / ``decomp.redistribute``; re-exported for generated code
from .redistribute import (Transfer, local_slice, redistribute, transfer_bytes,  # noqa: F401
                           transfer_plan)


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
