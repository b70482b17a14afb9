"""Sharding: how one tensor (or parameter) is spread over the ranks, as DTensor says it: one
placement per named mesh axis. Pure arithmetic, no process group.

Vocabulary: a tensor *dim* is an axis of a tensor (0 = N samples, 1 = C channels, 2.. = spatial
D/H/W); a mesh *axis* is one factor of the process grid. ``Sharding(placements, sizes, names)``
gives each mesh axis, outermost first, its size and its placement (``autopar.decomp.distspec``):
``Shard(d)`` (dim d split over the axis), ``Partial("sum")`` (ranks along it hold addends),
``Replicate()``, and the members DTensor lacks (``PaddedShard``, ``HaloShard``, ``SegmentShard``).

A decomposition states its placements without the world size: the mesh's last axis,
``replica``, holds ``Replicate()`` and takes what is left of the world, R = P / prod(sizes).
Bound to a world (``mesh(world)``, ``placements_on(world)``, ``to_spec``, the plan file) that
axis is explicit: ``Sample(4)`` at world 8 is the mesh (N:4, replica:2) with placements
(Shard(0), Replicate()). Ranks map onto the mesh row-major (``autopar.decomp.mesh``)::

    rank = ((c_0 * s_1 + c_1) * s_2 + c_2 ...) * R + r

so spatial neighbours (inner axes) are nearby ranks, which keeps halo traffic within a node, and
the replica axis (the group that shares one block, e.g. a filter-parallel group) is innermost.
These are *logical* ranks; which node each runs on is the plan's rank map
(``autopar.decomp.rankmap``).

Normal form (so equal distributions compare equal): axes of size 1 and trailing ``Replicate()``
axes (they merge into the replica axis, in the same rank order) are dropped, ``HaloShard(d, 0,
0)`` is ``Shard(d)``; axis names are
labels and do not take part in equality. By default a Shard axis is named after its dim: N, C,
then ``d<dim>`` (a spatial name needs the tensor's rank: ``named_for(ndim)`` names dims 2.. D/H/W
counted from the last, as ``dim_name`` does everywhere, and the plan file and printed plans state
placements named so); a Partial axis is ``partial``, a Replicate axis ``rep<i>``. A dim is split by one axis at
most, and there is one Partial axis at most.

Uneven blocks: a dim of extent n split into p parts gives block i the extent ``n // p + (1 if
i < n % p else 0)`` starting at ``i * (n // p) + min(i, n % p)`` (the rule of
``torch.tensor_split``; DTensor's ``Shard`` uses ``torch.chunk``, see ``distspec``), so
remainders are handled wherever a block is at least one element.

Parameters: a parameter's ``Sharding`` is stated on its layer's mesh (``ParamShard`` in
``autopar.decomp.base``): ``Shard(param dim)`` (or ``SegmentShard`` for a fused q|k|v weight)
on the axes that split it, ``Replicate()`` on the others; ranks holding the same shard (equal
coordinates on the splitting axes) sum their gradients.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .distspec import (DIM_PLACEMENTS, DistSpec, HaloShard, PaddedShard, Partial, Placement,  # noqa: F401
                       Replicate, SegmentShard, Shard, block_extent, block_start, owned_placement,
                       parse_placement)
from .mesh import Mesh

#: name of the implicit innermost axis (Replicate(), the rest of the world)
REPLICA_AXIS = "replica"


@dataclass(frozen=True)
class Sharding:
    """One placement per mesh axis (outermost first) with the axis sizes; the innermost
    ``replica`` axis (Replicate(), the rest of the world) is implicit. ``Sharding()`` = whole on
    every rank."""

    placements: tuple = ()
    sizes: tuple[int, ...] = ()
    names: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        ps, ss = tuple(_halo_free(p) for p in self.placements), tuple(int(s) for s in self.sizes)
        names = tuple(str(n) for n in self.names) or tuple(_default_name(p, i) for i, p in enumerate(ps))
        if not (len(ps) == len(ss) == len(names)):
            raise ValueError(f"Sharding needs one size and one name per placement: {ps}, {ss}, {names}")
        for p, s in zip(ps, ss):
            if not isinstance(p, (Shard, Replicate, Partial, PaddedShard, SegmentShard)) and \
                    not isinstance(p, DIM_PLACEMENTS):
                raise ValueError(f"Sharding: {p!r} is not a placement")
            if s < 1:
                raise ValueError(f"Sharding axis sizes must be >= 1: {ss}")
        keep = [i for i, s in enumerate(ss) if s > 1]
        while keep and isinstance(ps[keep[-1]], Replicate):
            keep.pop()
        ps, ss, names = (tuple(ps[i] for i in keep), tuple(ss[i] for i in keep),
                         tuple(names[i] for i in keep))
        dims = [p.dim for p in ps if isinstance(p, DIM_PLACEMENTS)]
        if len(set(dims)) != len(dims):
            raise ValueError(f"Sharding splits one dim on two axes: {_axes_str(ps, ss, names)}")
        if sum(isinstance(p, Partial) for p in ps) > 1:
            raise ValueError(f"Sharding has two Partial axes: {_axes_str(ps, ss, names)}")
        if len(set(names)) != len(names):
            raise ValueError(f"Sharding axis names repeat: {names}")
        object.__setattr__(self, "placements", ps)
        object.__setattr__(self, "sizes", ss)
        object.__setattr__(self, "names", names)

    # ---- constructors -------------------------------------------------------------------
    @staticmethod
    def of(*axes: tuple) -> "Sharding":
        """From ``(placement, size)`` or ``(placement, size, name)`` per axis, outermost first:
        ``Sharding.of((Shard(0), 2), (Partial(), 4))``."""
        return Sharding(tuple(a[0] for a in axes), tuple(a[1] for a in axes),
                        tuple(a[2] for a in axes) if axes and all(len(a) > 2 for a in axes) else ())

    def with_placements(self, placements: Sequence) -> "Sharding":
        """The same mesh axes (sizes, names) with other placements (a parameter's on its layer's
        mesh)."""
        return Sharding(tuple(placements), self.sizes, self.names)

    def owned(self) -> "Sharding":
        """The blocks the ranks hold: every ``HaloShard`` as its ``Shard`` (same axes). What a
        transition compares and moves: into a HaloShard input it is a transition into its owned
        block, the halo being the consuming layer's own exchange (priced in its fwd_comm_s)."""
        if not any(isinstance(p, HaloShard) for p in self.placements):
            return self
        return Sharding(tuple(owned_placement(p) for p in self.placements), self.sizes, self.names)

    def halo(self, dim: int) -> tuple[int, int]:
        """(lo, hi) halo widths read along ``dim`` (0, 0 unless a ``HaloShard`` splits it)."""
        a = self.axis_of_dim(dim)
        p = self.placements[a] if a is not None else None
        return (p.halo_lo, p.halo_hi) if isinstance(p, HaloShard) else (0, 0)

    def without_partial(self) -> "Sharding":
        """The Partial axis resolved (summed): its ranks then hold equal copies, so the axis
        merges into the replicas (it is the innermost but the replica axis)."""
        keep = [i for i, p in enumerate(self.placements) if not isinstance(p, Partial)]
        return Sharding(tuple(self.placements[i] for i in keep), tuple(self.sizes[i] for i in keep),
                        tuple(self.names[i] for i in keep))

    # ---- JSON (the plan file) -------------------------------------------------------------
    def to_json(self, world: int) -> dict:
        """``{"mesh": {"shape": [...], "names": [...]}, "placements": ["Shard(0)", ...]}`` on
        the whole world (the replica axis explicit)."""
        m = self.mesh(world)
        return {"mesh": {"shape": list(m.shape), "names": list(m.names)},
                "placements": [str(p) for p in self.placements_on(world)]}

    @staticmethod
    def from_json(obj) -> "Sharding":
        """Inverse of ``to_json`` (raises ValueError / KeyError / TypeError naming what is wrong;
        the plan loader checks the mesh against the world)."""
        if not isinstance(obj, dict) or "mesh" not in obj or "placements" not in obj:
            raise ValueError('expected {"mesh": {"shape": [...], "names": [...]}, "placements": [...]}')
        mesh = obj["mesh"]
        shape, names = list(mesh["shape"]), [str(n) for n in mesh.get("names") or ()]
        ps = [parse_placement(p) for p in obj["placements"]]
        if len(ps) != len(shape):
            raise ValueError(f"{len(ps)} placements for a mesh of {len(shape)} axes {shape}")
        if names and len(names) != len(shape):
            raise ValueError(f"{len(names)} names for a mesh of {len(shape)} axes {shape}")
        return Sharding(tuple(ps), tuple(int(s) for s in shape), tuple(names))

    # ---- properties ---------------------------------------------------------------------
    @property
    def shard_axes(self) -> tuple[int, ...]:
        """Mesh axes whose placement splits a dim, outermost first."""
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, DIM_PLACEMENTS))

    @property
    def shard_dims(self) -> tuple[int, ...]:
        """Tensor dims split, in the order of their axes."""
        return tuple(self.placements[a].dim for a in self.shard_axes)

    def axis_of_dim(self, dim: int) -> int | None:
        """The mesh axis splitting ``dim`` (None if none)."""
        for a in self.shard_axes:
            if self.placements[a].dim == dim:
                return a
        return None

    def parts_of(self, dim: int) -> int:
        a = self.axis_of_dim(dim)
        return 1 if a is None else self.sizes[a]

    @property
    def num_blocks(self) -> int:
        """Distinct regions of the tensor (product of the splitting axes' sizes)."""
        return math.prod(self.sizes[a] for a in self.shard_axes)

    @property
    def partial_parts(self) -> int:
        """Size of the Partial axis (1 = none)."""
        return math.prod(s for p, s in zip(self.placements, self.sizes) if isinstance(p, Partial))

    @property
    def is_partial(self) -> bool:
        return self.partial_parts > 1

    def replicas(self, world: int) -> int:
        """R = world / prod(sizes): the size of the implicit replica axis."""
        q = math.prod(self.sizes)
        if world % q:
            raise ValueError(f"sharding {self} has {q} ranks per replica, which does not divide world {world}")
        return world // q

    def is_replicated(self) -> bool:
        return not self.placements

    def __str__(self) -> str:
        """E.g. ``(N:2, partial:2)[Shard(0), Partial(sum)]``; ``[Replicate()]`` when whole (the
        replica axis, implicit, is not printed: it needs the world)."""
        return _axes_str(self.placements, self.sizes, self.names)

    # ---- the mesh ---------------------------------------------------------------------------
    def mesh_axes(self, world: int, ndim: int | None = None) -> tuple[tuple[str, int], ...]:
        """(name, size) of each mesh axis on ``world`` ranks: the placements' axes, then
        ``replica`` when R > 1 (or when there is no other axis)."""
        axes = [(self._name(a, ndim), s) for a, s in enumerate(self.sizes)]
        r = self.replicas(world)
        if r > 1 or not axes:
            axes.append((REPLICA_AXIS, r))
        return tuple(axes)

    def _name(self, a: int, ndim: int | None) -> str:
        """Axis ``a``'s name for a tensor of rank ``ndim``: a default-named Shard axis (``d<dim>``)
        named by ``dim_name(dim, ndim)``; any other name kept."""
        p = self.placements[a]
        if ndim is not None and isinstance(p, DIM_PLACEMENTS) and self.names[a] == _default_name(p, a):
            return dim_name(p.dim, ndim)
        return self.names[a]

    def named_for(self, ndim: int | None) -> "Sharding":
        """The same sharding with its default-named axes named for a tensor of rank ``ndim``
        (``dim_name``: dim 2 of a 5-d tensor is D, of a 4-d one H); None: unchanged."""
        if ndim is None:
            return self
        return Sharding(self.placements, self.sizes, tuple(self._name(a, ndim) for a in range(len(self.sizes))))

    def mesh(self, world_or_ranks: "int | Sequence[int]", ndim: int | None = None) -> Mesh:
        """The named mesh on ranks 0..world-1 (or the given ranks, in order)."""
        ranks = tuple(range(world_or_ranks)) if isinstance(world_or_ranks, int) else tuple(world_or_ranks)
        axes = self.mesh_axes(len(ranks), ndim)
        return Mesh(ranks, tuple(s for _, s in axes), tuple(n for n, _ in axes))

    def placements_on(self, world: int, ndim: int | None = None) -> tuple:
        """One placement per axis of ``mesh(world)``."""
        out = list(self.placements)
        if len(out) < len(self.mesh_axes(world, ndim)):
            out.append(Replicate())
        return tuple(out)

    def to_spec(self, shape: Sequence[int], world_or_mesh: "int | Mesh") -> DistSpec:
        """This sharding of a tensor of ``shape`` as a ``DistSpec``: on the world (ranks
        0..P-1) or the given mesh's ranks, in order."""
        ranks = tuple(range(world_or_mesh)) if isinstance(world_or_mesh, int) else world_or_mesh.ranks
        mesh = self.mesh(ranks, len(shape))
        return DistSpec(mesh, self.placements_on(len(ranks), len(shape)), tuple(int(n) for n in shape))

    def placements_str(self, world: int) -> str:
        """E.g. ``[Shard(0), Shard(2), Replicate()]`` (for reports)."""
        return "[" + ", ".join(str(p) for p in self.placements_on(world)) + "]"

    # ---- rank arithmetic ----------------------------------------------------------------
    def axis_coords(self, rank: int, world: int) -> tuple[tuple[int, ...], int]:
        """(coordinate on every axis, replica index) of ``rank``."""
        r = self.replicas(world)
        rep, rest = rank % r, rank // r
        cs = []
        for s in reversed(self.sizes):
            cs.append(rest % s)
            rest //= s
        return tuple(reversed(cs)), rep

    def rank_at(self, axis_coords: Sequence[int], replica: int, world: int) -> int:
        rank = 0
        for s, c in zip(self.sizes, axis_coords):
            rank = rank * s + c
        return rank * self.replicas(world) + replica

    def coords(self, rank: int, world: int) -> tuple[tuple[int, ...], int]:
        """(coordinates on the splitting axes, replica index) of ``rank`` (``partial_index``
        gives the coordinate on the Partial axis)."""
        cs, rep = self.axis_coords(rank, world)
        return tuple(cs[a] for a in self.shard_axes), rep

    def partial_index(self, rank: int, world: int) -> int:
        """Coordinate of ``rank`` on the Partial axis (0 when there is none)."""
        cs, _ = self.axis_coords(rank, world)
        return next((c for c, p in zip(cs, self.placements) if isinstance(p, Partial)), 0)

    def rank_of(self, coords: Sequence[int], replica: int, world: int, partial_index: int = 0) -> int:
        """Inverse of ``coords`` (other Replicate axes at coordinate 0)."""
        full = [0] * len(self.sizes)
        for a, c in zip(self.shard_axes, coords):
            full[a] = c
        for a, p in enumerate(self.placements):
            if isinstance(p, Partial):
                full[a] = partial_index
        return self.rank_at(full, replica, world)

    def block_index(self, rank: int, world: int) -> int:
        """Linear block id of ``rank`` (row-major over the splitting axes): ranks with equal id
        hold the same region (with a Partial axis, different addends of it)."""
        cs, _ = self.coords(rank, world)
        i = 0
        for a, c in zip(self.shard_axes, cs):
            i = i * self.sizes[a] + c
        return i

    def _group(self, axes: tuple[int, ...], rank: int, world: int) -> tuple[int, ...]:
        """Ranks that differ from ``rank`` only along mesh ``axes`` (sorted)."""
        cs, rep = self.axis_coords(rank, world)
        groups = [list(cs)]
        for a in axes:
            groups = [g[:a] + [c] + g[a + 1:] for g in groups for c in range(self.sizes[a])]
        return tuple(sorted(self.rank_at(g, rep, world) for g in groups))

    def axis_group(self, axis: int, rank: int, world: int) -> list[int]:
        """Ranks that differ from ``rank`` only along splitting axis number ``axis`` (an index
        into ``shard_axes``), in coordinate order."""
        return list(self._group((self.shard_axes[axis],), rank, world))

    def split_group(self, dims: Iterable[int], rank: int, world: int) -> list[int]:
        """Ranks that differ from ``rank`` only along the axes splitting tensor ``dims`` (sorted)."""
        dims = set(dims)
        return list(_cached_group(self, tuple(a for a in self.shard_axes if self.placements[a].dim in dims),
                                  rank, world))

    def data_group(self, rank: int, world: int) -> list[int]:
        """Ranks holding different blocks of the tensor with the same replica (and partial)
        index."""
        return list(_cached_group(self, self.shard_axes, rank, world))

    def replica_group(self, rank: int, world: int) -> list[int]:
        r = self.replicas(world)
        base = (rank // r) * r
        return list(range(base, base + r))

    def partial_group(self, rank: int, world: int) -> list[int]:
        """Ranks whose addends sum to ``rank``'s block (same block and replica index)."""
        axes = tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))
        return list(self._group(axes, rank, world)) if axes else [rank]

    def same_shard_group(self, rank: int, world: int) -> list[int]:
        """Ranks holding the same local piece as ``rank`` (equal coordinates on every axis that
        is not Replicate): a parameter's gradient group."""
        axes = tuple(a for a, p in enumerate(self.placements) if isinstance(p, Replicate))
        cs, _ = self.axis_coords(rank, world)
        r = self.replicas(world)
        out = []
        for g in self._group(axes, rank, world):
            out.extend(range(g - g % r, g - g % r + r))
        return sorted(out)

    # ---- shapes -----------------------------------------------------------------------------
    def block_bounds(self, shape: Sequence[int], block: int, world: int) -> tuple[tuple[int, int], ...]:
        """Per dim (start, extent) of linear block id ``block`` for a tensor of ``shape``."""
        cs = []
        for a in reversed(self.shard_axes):
            cs.append(block % self.sizes[a])
            block //= self.sizes[a]
        bounds = [(0, int(n)) for n in shape]
        for a, c in zip(self.shard_axes, reversed(cs)):
            d, p = self.placements[a].dim, self.sizes[a]
            n = int(shape[d])
            bounds[d] = (block_start(n, p, c), block_extent(n, p, c))
        return tuple(bounds)

    def local_bounds(self, shape: Sequence[int], rank: int, world: int) -> tuple[tuple[int, int], ...]:
        return self.block_bounds(shape, self.block_index(rank, world), world)

    def local_shape(self, shape: Sequence[int], rank: int, world: int) -> tuple[int, ...]:
        return tuple(e for _, e in self.local_bounds(shape, rank, world))

    def max_local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Largest block's shape (block 0 is always the largest)."""
        out = list(int(n) for n in shape)
        for a in self.shard_axes:
            d = self.placements[a].dim
            out[d] = block_extent(int(shape[d]), self.sizes[a], 0)
        return tuple(out)

    def max_local_operand_shape(self, shape: Sequence[int], out_rank: int) -> tuple[int, ...]:
        """``max_local_shape`` of an operand that broadcasts against an output of ``out_rank``
        dims (numpy rule: trailing dims line up; a dim the operand lacks is not split)."""
        shift = out_rank - len(shape)
        if shift == 0:
            return self.max_local_shape(shape)
        out = list(int(n) for n in shape)
        for a in self.shard_axes:
            d = self.placements[a].dim
            if 0 <= d - shift < len(out):
                out[d - shift] = block_extent(out[d - shift], self.sizes[a], 0)
        return tuple(out)

    def min_local_extent(self, shape: Sequence[int]) -> int:
        """Smallest extent of any split dim in any block (0 means some rank holds nothing)."""
        ext = [int(shape[self.placements[a].dim]) // self.sizes[a] for a in self.shard_axes]
        return min(ext) if ext else min((int(n) for n in shape), default=1)

    def fits(self, shape: Sequence[int], world: int) -> str | None:
        """None if legal for ``shape`` at ``world``; else the reason."""
        q = math.prod(self.sizes)
        if world % q:
            if self.is_partial:
                return f"{self.num_blocks} blocks x {self.partial_parts} partial do not divide world size {world}"
            return f"{q} blocks do not divide world size {world}"
        for a in self.shard_axes:
            d, p = self.placements[a].dim, self.sizes[a]
            if d >= len(shape):
                return f"splits dim {d} of a {len(shape)}-d tensor"
            if int(shape[d]) < p:
                return f"dim {d} has extent {shape[d]} < {p} parts"
        return None


def _halo_free(p):
    """``HaloShard(d, 0, 0)`` reads nothing beyond its block: it is ``Shard(d)``."""
    return Shard(p.dim) if isinstance(p, HaloShard) and not (p.halo_lo or p.halo_hi) else p


def _default_name(p, i: int) -> str:
    """An axis' name when none is given: the tensor's rank is not known here, so no guess
    (``dim_name(dim)``: N, C, ``d<dim>``); ``named_for(ndim)`` names spatial dims."""
    if isinstance(p, DIM_PLACEMENTS):
        return dim_name(p.dim)
    if isinstance(p, Partial):
        return "partial"
    return f"rep{i}"


def _axes_str(ps, ss, names) -> str:
    if not ps:
        return "[Replicate()]"
    return ("(" + ", ".join(f"{n}:{s}" for n, s in zip(names, ss)) + ")["
            + ", ".join(str(p) for p in ps) + "]")


#: names of the spatial dims of a tensor with 1, 2 or 3 of them (the last dims: W; H, W; D, H, W)
SPATIAL_NAMES = {1: ("W",), 2: ("H", "W"), 3: ("D", "H", "W")}


def dim_name(dim: int, ndim: int | None = None) -> str:
    """The one naming of tensor dims: 0 N, 1 C, then the spatial dims of an ``ndim``-d tensor
    (``SPATIAL_NAMES``: dim 2 is D of a 5-d tensor, H of a 4-d one, W of a 3-d one); ``d<dim>``
    when the rank is not known (None) or has no spatial names."""
    if dim < 2:
        return "NC"[dim]
    names = SPATIAL_NAMES.get(ndim - 2) if ndim is not None else None
    return names[dim - 2] if names and dim - 2 < len(names) else f"d{dim}"


@functools.lru_cache(maxsize=65536)
def _cached_group(sharding: Sharding, axes: tuple[int, ...], rank: int, world: int) -> tuple[int, ...]:
    """Cached: pricing asks for the same groups many times at large world sizes."""
    return sharding._group(axes, rank, world)


def overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...] | None:
    """Intersection of two boxes given as per-dim (start, extent); None when empty."""
    out = []
    for (s0, e0), (s1, e1) in zip(a, b):
        lo, hi = max(s0, s1), min(s0 + e0, s1 + e1)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def loss_sharding_for(out: Sharding, batch: int, world: int) -> Sharding:
    """The sharding the loss is computed in: the output's if it splits only samples (and holds
    no partial sum), else the widest sample split that divides the world and the batch."""
    if not out.is_partial and all(d == 0 for d in out.shard_dims) and \
            all(isinstance(p, Shard) for p in out.placements):
        return out
    p = max(d for d in range(1, world + 1) if world % d == 0 and d <= batch)
    return Sharding.of((Shard(0), p))


def from_splits(splits: Sequence[Sequence[int]], partial: int = 1) -> Sharding:
    """The sharding of the previous plan schema's ``[[dim, parts], ...]`` (+ a partial-sum axis
    of ``partial`` between the splits and the replicas): ``Shard(dim)`` per pair, then
    ``Partial()``. Used only to migrate old plan files (``autopar.artifacts``)."""
    axes = [(Shard(int(d)), int(p)) for d, p in splits]
    if int(partial) < 1 or any(p < 1 for _, p in axes):
        raise ValueError(f"parts must be >= 1: {list(splits)}, partial {partial}")
    return Sharding.of(*axes, (Partial(), int(partial)))
