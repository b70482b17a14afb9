"""Process groups and differentiable collectives for the runtime.

``Comm`` knows this rank, the world, the device, and the process groups the plan needs
(created collectively, in one deterministic order, by ``Comm.ensure_partitions``). Every
collective here is an autograd Function whose backward is the exact adjoint of its forward, as
the gradient convention of ``autopar.decomp.base`` requires:

* ``all_reduce_sum``: forward y = sum_g x; backward dx = sum_g dy.
* ``reduce_scatter_dim``: forward sum over a group and keep my slice of a dim; backward the
  all-gather of the gradient.

Redistribution between layouts is ``autopar.runtime.redistribute``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..decomp.sharding import Sharding


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

    def grad_group(self, ranks: Sequence[int]) -> Any:
        """The process group on which the gradient all-reduces of mesh-local ``ranks`` run
        (``GradSync``): the twin of ``group(ranks)`` that ``create_groups`` makes beside it, so
        the all-reduces launched asynchronously during backward, at points that may differ
        between ranks, never interleave with the synchronous collectives of forward and
        backward on a shared group (gloo matches collectives of a group by their order: a
        different order on two ranks hangs, or sums the wrong tensors). ``group(ranks)`` itself
        where no twin was made (a ``Comm`` used without ``create_groups``/``ensure_partitions``)."""
        key = tuple(sorted(ranks))
        glob = tuple(sorted(self.ranks[r] for r in key))
        g = _GRAD_GROUPS.get(glob)
        return g if g is not None else self.group(ranks)

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


# Newer torch names the dim-0 collectives *_single (the *_tensor names are deprecated there).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


#: process groups of this process, by sorted global ranks (``create_groups``)
_GROUPS: dict[tuple[int, ...], Any] = {}
#: their twins for gradient synchronisation (``Comm.grad_group``), the whole world's included
_GRAD_GROUPS: dict[tuple[int, ...], Any] = {}


def create_groups(groups: Sequence[Sequence[int]]) -> None:
    """Create the process group of every global rank list in ``groups`` not created yet, and
    its twin for gradient synchronisation (``Comm.grad_group``); the whole world's twin once.
    Collective over the default group: every process calls it with the same lists (members or
    not, as ``new_group`` requires); they are created in sorted order. Lists of one rank need no
    group, the whole world none but its twin."""
    size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if size > 1 and tuple(range(size)) not in _GRAD_GROUPS:
        _GRAD_GROUPS[tuple(range(size))] = dist.new_group(list(range(size)))
    for g in sorted({tuple(sorted(int(r) for r in g)) for g in groups}):
        if 1 < len(g) < size and g not in _GROUPS:
            _GROUPS[g] = dist.new_group(list(g))
            _GRAD_GROUPS[g] = dist.new_group(list(g))


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


def local_slice(full: torch.Tensor, layout: Sharding, comm) -> torch.Tensor:
    """This rank's block of a full tensor (no communication; for inputs and validation)."""
    b = layout.local_bounds(full.shape, comm.rank, comm.world)
    return full[tuple(slice(s, s + e) for s, e in b)]



def assemble(local: torch.Tensor, layout: Sharding, shape: Sequence[int], comm: Comm,
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


# ---- collectives along one dim (gloo: dim 0, equal chunks) ------------------------------------
def reduce_scatter_along(x: torch.Tensor, dim: int, comm, group: tuple[int, ...], extents: Sequence[int],
        out_shape: Sequence[int]) -> torch.Tensor:
    """Sum over ``group`` and keep my block of ``dim`` (block i has ``extents[i]``)."""
    me = group.index(comm.rank)
    m = max(extents)
    if len(group) == 1:
        return x.clone()
    if m == 0 or x.numel() == 0:           # every member knows: nothing to reduce
        return x.new_zeros(tuple(out_shape))
    xt = x.movedim(dim, 0)
    buf = xt.new_zeros((len(group) * m,) + tuple(xt.shape[1:]))
    off = 0
    for i, e in enumerate(extents):
        buf[i * m:i * m + e] = xt[off:off + e]
        off += e
    out = xt.new_empty((m,) + tuple(xt.shape[1:]))
    _reduce_scatter(out, buf, group=comm.group(group))
    return out[:extents[me]].movedim(0, dim).contiguous()


def all_gather_along(x: torch.Tensor, dim: int, comm, group: tuple[int, ...], extents: Sequence[int],
        out_shape: Sequence[int]) -> torch.Tensor:
    """Concatenate every member's block of ``dim`` (block i has ``extents[i]``)."""
    m = max(extents)
    if len(group) == 1:
        return x.clone()
    if m == 0 or math.prod(out_shape) == 0:
        return x.new_zeros(tuple(out_shape))
    xt = x.movedim(dim, 0)
    if xt.shape[0] < m:
        xt = torch.cat([xt, xt.new_zeros((m - xt.shape[0],) + tuple(xt.shape[1:]))])
    buf = xt.new_empty((len(group) * m,) + tuple(xt.shape[1:]))
    _all_gather(buf, xt.contiguous(), group=comm.group(group))
    if any(e != m for e in extents):
        buf = torch.cat([buf[i * m:i * m + e] for i, e in enumerate(extents)])
    return buf.movedim(0, dim).contiguous()


# Channel and channel+filter parallelism reduce-scatter a partial sum over the channel group
# inside a layer (``autopar.decomp.channel_filter``): forward reduce-scatter, backward the
# adjoint all-gather of the output gradient ("sum, then keep my slice" -> "gather every slice,
# then give it to everyone"). The i-th slice belongs to the i-th smallest rank of ``ranks``.
class _ReduceScatterDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, comm, ranks, extents):
        ctx.args = (dim, comm, ranks, extents)
        shape = list(x.shape)
        shape[dim] = extents[ranks.index(comm.rank)]
        return reduce_scatter_along(x, dim, comm, ranks, extents, shape)

    @staticmethod
    def backward(ctx, dy):
        dim, comm, ranks, extents = ctx.args
        shape = list(dy.shape)
        shape[dim] = sum(extents)
        return all_gather_along(dy, dim, comm, ranks, extents, shape), None, None, None, None


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
