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
    """One process's view of the mesh a plan runs on: its rank there, the mesh's size, and the
    process groups among the mesh's ranks.

    ``rank`` and ``world`` are *mesh-local* (0 .. world-1): every decomposition, layout and
    transfer plan speaks of them. ``ranks[i]`` is the torch.distributed rank (after the plan's
    placement relabeling) that runs mesh rank ``i``; by default the whole default group, in
    order. A plan therefore runs unchanged on any sub-mesh of the world, e.g. two plans on the
    two halves of a world of 4 (``autopar execute`` of a run set).

    Process groups are created collectively by every process of the default group, in one
    sorted order (``create_groups``; gloo's ``use_local_synchronization`` hangs here on
    overlapping groups, measured with torch 2.13), and kept per process by their global ranks.
    A plan on the whole world creates its groups itself (``ensure_partitions``); plans on
    sub-meshes get theirs created up front, for every plan of the run at once, by
    ``create_groups`` (``autopar.execute``).
    """

    rank: int
    world: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.ranks = tuple(int(r) for r in self.ranks) or tuple(range(self.world))
        if len(self.ranks) != self.world or len(set(self.ranks)) != self.world:
            raise ValueError(f"a mesh of {self.world} ranks needs {self.world} distinct global ranks, "
                             f"got {list(self.ranks)}")
        if list(self.ranks) != sorted(self.ranks):
            raise ValueError(f"mesh ranks must increase (group rank order is mesh order), got "
                             f"{list(self.ranks)}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"mesh rank {self.rank} outside a mesh of {self.world}")
        self._default: bool | None = None

    @staticmethod
    def from_env(device: torch.device | None = None, ranks: Sequence[int] | None = None) -> "Comm":
        """This process on the whole default group, or on the mesh of global ``ranks``."""
        if dist.is_available() and dist.is_initialized():
            me, size = dist.get_rank(), dist.get_world_size()
        else:
            me, size = 0, 1
        mesh = tuple(int(r) for r in ranks) if ranks is not None else tuple(range(size))
        if me not in mesh:
            raise ValueError(f"process {me} is not in the mesh {list(mesh)}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if (
                dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")
        return Comm(mesh.index(me), len(mesh), device, ranks=mesh)

    @property
    def is_default_group(self) -> bool:
        """True when the mesh is the whole default group (collectives need no group)."""
        if self._default is None:
            size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            self._default = self.ranks == tuple(range(size))
        return self._default

    def global_rank(self, local: int) -> int:
        return self.ranks[local]

    def ensure_partitions(self, partitions: Sequence[Sequence[Sequence[int]]]) -> None:
        """The process group of every mesh-local rank list of every partition, and of the whole
        mesh. On the whole default group this creates them (collective: every rank calls it
        with the same partitions); on a sub-mesh they must exist already (``create_groups``
        by every process of the world), else a named error."""
        wanted = self.global_groups(partitions)
        if self.is_default_group:
            create_groups(wanted)
            return
        missing = [g for g in wanted if g not in _GROUPS]
        if missing:
            raise RuntimeError(f"process groups {missing[:3]} of a plan on the sub-mesh "
                               f"{list(self.ranks)} were not created; every process of the world "
                               f"must call autopar.runtime.comm.create_groups with the groups of "
                               f"every plan first")

    def global_groups(self, partitions: Sequence[Sequence[Sequence[int]]]) -> list[tuple[int, ...]]:
        """Global rank tuples of the groups ``partitions`` (mesh-local) need, the whole mesh's
        included when it is not the default group."""
        out = {tuple(sorted(self.ranks[r] for r in g)) for part in partitions for g in part
               if 1 < len(g) < self.world}
        if self.world > 1 and not self.is_default_group:
            out.add(tuple(sorted(self.ranks)))
        return sorted(out)

    def group(self, ranks: Sequence[int]) -> Any:
        """The process group of mesh-local ``ranks`` (None: the default group)."""
        key = tuple(sorted(ranks))
        if len(key) == self.world and self.is_default_group:
            return None
        glob = tuple(sorted(self.ranks[r] for r in key))
        if glob not in _GROUPS:
            raise RuntimeError(f"process group of mesh ranks {key} (global {glob}) was not created; "
                               f"the plan's partitions are incomplete (a bug in a decomposition's "
                               f"partitions())")
        return _GROUPS[glob]

    @property
    def mesh_group(self) -> Any:
        """The group of the whole mesh (None when it is the default group)."""
        return self.group(range(self.world))

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.mesh_group)

    def all_reduce_(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """In-place all-reduce over the whole mesh (SUM unless ``op``)."""
        if self.world > 1:
            dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=self.mesh_group)
        return t


#: process groups of this process, by sorted global ranks (``create_groups``)
_GROUPS: dict[tuple[int, ...], Any] = {}


def create_groups(groups: Sequence[Sequence[int]]) -> None:
    """Create the process group of every global rank list in ``groups`` not created yet.
    Collective over the default group: every process calls it with the same lists (members or
    not, as ``new_group`` requires); they are created in sorted order. Lists of one rank and the
    whole world need no group."""
    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for g in sorted({tuple(sorted(int(r) for r in g)) for g in groups}):
        if 1 < len(g) < size and g not in _GROUPS:
            _GROUPS[g] = dist.new_group(list(g))


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
    return comm.all_reduce_(full)
