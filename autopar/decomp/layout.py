"""Layout: how one tensor is spread over the ranks of the world. Pure arithmetic, no process group.

Vocabulary: a tensor *dim* is an axis of a tensor (0 = N samples, 1 = C channels, 2.. = spatial
D/H/W); a mesh *axis* is one factor of the process grid. A ``Layout`` is a tuple of splits
``((dim, parts), ...)``, outermost mesh axis first, and an optional *partial-sum* axis of size
``partial`` (ranks along it hold addends of the value; 1 = none). With world size P and
Q = prod(parts), the remaining factor R = P / (Q * partial) is *replication*; it is the
innermost mesh axis. Ranks map onto the grid row-major::

    rank = (((c_0 * p_1 + c_1) * p_2 + c_2 ...) * partial + k) * R + r     (k = partial index)

so spatial neighbours (inner axes) are nearby ranks, which keeps halo traffic within a node, and
the replica axis (the group that shares one block, e.g. a filter-parallel group) is innermost.
These are *logical* ranks; which node each runs on is the plan's placement
(``autopar.decomp.placement``: block placement keeps the innermost axes node-local, a local
stride another axis).

A dim of extent n split into p parts gives block i the extent ``n // p + (1 if i < n % p else
0)`` starting at ``i * (n // p) + min(i, n % p)`` (the rule of ``torch.tensor_split``), so
remainders are handled wherever a block is at least one element.

``Layout.to_spec`` gives the same distribution as a ``DistSpec`` on a ``Mesh``
(``autopar.decomp.distspec``): one mesh axis per split (``Shard(dim)``), then ``Partial(sum)``,
then ``Replicate()`` for the replicas, in exactly the rank order above.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

# the block rule lives with the placements; re-exported here, where most callers look for it
from .distspec import DistSpec, Partial, Replicate, Shard, block_extent, block_start  # noqa: F401
from .mesh import Mesh


@dataclass(frozen=True)
class Layout:
    """Splits of a tensor over the mesh: ``((dim, parts), ...)``, outermost first; () = replicated;
    ``partial`` > 1: a partial-sum axis of that size between the splits and the replicas."""

    splits: tuple[tuple[int, int], ...] = ()
    partial: int = 1

    def __post_init__(self) -> None:
        if int(self.partial) < 1:
            raise ValueError(f"Layout partial must be >= 1: {self.partial}")
        object.__setattr__(self, "partial", int(self.partial))
        dims = [d for d, _ in self.splits]
        if len(set(dims)) != len(dims):
            raise ValueError(f"Layout splits one dim twice: {self.splits}")
        if any(p < 1 for _, p in self.splits):
            raise ValueError(f"Layout parts must be >= 1: {self.splits}")
        # Normalise away trivial splits so that equal distributions compare equal.
        clean = tuple((int(d), int(p)) for d, p in self.splits if p > 1)
        object.__setattr__(self, "splits", clean)

    # ---- constructors -------------------------------------------------------------------
    @staticmethod
    def replicate() -> "Layout":
        return Layout(())

    @staticmethod
    def of(*splits: tuple[int, int]) -> "Layout":
        return Layout(tuple(splits))

    @staticmethod
    def from_json(obj) -> "Layout":
        """Reads both forms: ``[[dim, parts], ...]`` and ``{"splits": [...], "partial": p}``."""
        if isinstance(obj, dict):
            return Layout(tuple((int(d), int(p)) for d, p in obj.get("splits", ())),
                          int(obj.get("partial", 1)))
        return Layout(tuple((int(d), int(p)) for d, p in obj))

    def to_json(self):
        """The list of [dim, parts] pairs (the old form) unless there is a partial axis."""
        pairs = [[d, p] for d, p in self.splits]
        if self.partial == 1:
            return pairs
        return {"splits": pairs, "partial": self.partial}

    # ---- properties ---------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return math.prod(p for _, p in self.splits)

    def parts_of(self, dim: int) -> int:
        for d, p in self.splits:
            if d == dim:
                return p
        return 1

    def replicas(self, world: int) -> int:
        """R = world / (blocks * partial)."""
        q = self.num_blocks * self.partial
        if world % q:
            what = f"{self.num_blocks} blocks x {self.partial} partial" if self.partial > 1 else \
                f"{q} blocks"
            raise ValueError(f"layout {self} has {what}, which does not divide world {world}")
        return world // q

    def is_replicated(self) -> bool:
        return not self.splits and self.partial == 1

    def __str__(self) -> str:
        names = {0: "N", 1: "C"}
        parts = [f"{names.get(d, f'[{d}]')}{p}" for d, p in self.splits]
        if self.partial > 1:
            parts.append(f"P{self.partial}")
        return "x".join(parts) if parts else "R"

    # ---- rank arithmetic ----------------------------------------------------------------
    def coords(self, rank: int, world: int) -> tuple[tuple[int, ...], int]:
        """(block coordinates per split, replica index) of ``rank`` (``partial_index`` gives
        the coordinate on the partial axis)."""
        r = self.replicas(world)
        rep = rank % r
        rest = rank // r // self.partial
        cs = []
        for _, p in reversed(self.splits):
            cs.append(rest % p)
            rest //= p
        return tuple(reversed(cs)), rep

    def partial_index(self, rank: int, world: int) -> int:
        """Coordinate of ``rank`` on the partial-sum axis (0 when there is none)."""
        return (rank // self.replicas(world)) % self.partial

    def rank_of(self, coords: Sequence[int], replica: int, world: int, partial_index: int = 0) -> int:
        rank = 0
        for (_, p), c in zip(self.splits, coords):
            rank = rank * p + c
        return (rank * self.partial + partial_index) * self.replicas(world) + replica

    def block_index(self, rank: int, world: int) -> int:
        """Linear block id of ``rank`` (ranks with equal id hold the same region; with a
        partial axis they hold different addends of it)."""
        return rank // (self.replicas(world) * self.partial)

    def axis_group(self, axis: int, rank: int, world: int) -> list[int]:
        """Ranks that differ from ``rank`` only along split ``axis`` (in coordinate order)."""
        cs, rep = self.coords(rank, world)
        k = self.partial_index(rank, world)
        out = []
        for c in range(self.splits[axis][1]):
            cc = list(cs)
            cc[axis] = c
            out.append(self.rank_of(cc, rep, world, k))
        return out

    def split_group(self, dims: Iterable[int], rank: int, world: int) -> list[int]:
        """Ranks that differ from ``rank`` only along the splits of tensor ``dims`` (sorted)."""
        return list(_split_group(self, tuple(sorted(set(dims))), rank, world))

    def _split_group_uncached(self, dims: tuple[int, ...], rank: int, world: int) -> tuple[int, ...]:
        dims = set(dims)
        axes = [i for i, (d, _) in enumerate(self.splits) if d in dims]
        cs, rep = self.coords(rank, world)
        k = self.partial_index(rank, world)
        groups = [list(cs)]
        for a in axes:
            groups = [g[:a] + [c] + g[a + 1:] for g in groups for c in range(self.splits[a][1])]
        return tuple(sorted(self.rank_of(g, rep, world, k) for g in groups))

    def data_group(self, rank: int, world: int) -> list[int]:
        """Ranks holding different blocks of the tensor with the same replica (and partial)
        index."""
        return self.split_group([d for d, _ in self.splits], rank, world)

    def replica_group(self, rank: int, world: int) -> list[int]:
        r = self.replicas(world)
        base = (rank // r) * r
        return list(range(base, base + r))

    def partial_group(self, rank: int, world: int) -> list[int]:
        """Ranks whose addends sum to ``rank``'s block (same block and replica index)."""
        r = self.replicas(world)
        base = self.block_index(rank, world) * r * self.partial + rank % r
        return [base + k * r for k in range(self.partial)]

    def block_bounds(self, shape: Sequence[int], block: int, world: int) -> tuple[tuple[int, int], ...]:
        """Per dim (start, extent) of linear block id ``block`` for a tensor of ``shape``."""
        rank = block * self.replicas(world) * self.partial
        cs, _ = self.coords(rank, world)
        bounds = [(0, int(n)) for n in shape]
        for (d, p), c in zip(self.splits, cs):
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
        for d, p in self.splits:
            out[d] = block_extent(int(shape[d]), p, 0)
        return tuple(out)

    def max_local_operand_shape(self, shape: Sequence[int], out_rank: int) -> tuple[int, ...]:
        """``max_local_shape`` of an operand that broadcasts against an output of ``out_rank``
        dims (numpy rule: trailing dims line up; a dim the operand lacks is not split)."""
        shift = out_rank - len(shape)
        if shift == 0:
            return self.max_local_shape(shape)
        out = list(int(n) for n in shape)
        for d, p in self.splits:
            if 0 <= d - shift < len(out):
                out[d - shift] = block_extent(out[d - shift], p, 0)
        return tuple(out)

    def min_local_extent(self, shape: Sequence[int]) -> int:
        """Smallest extent of any split dim in any block (0 means some rank holds nothing)."""
        ext = [int(shape[d]) // p for d, p in self.splits]
        return min(ext) if ext else min((int(n) for n in shape), default=1)

    def fits(self, shape: Sequence[int], world: int) -> str | None:
        """None if legal for ``shape`` at ``world``; else the reason."""
        q = self.num_blocks
        if world % (q * self.partial):
            if self.partial > 1:
                return f"{q} blocks x {self.partial} partial do not divide world size {world}"
            return f"{q} blocks do not divide world size {world}"
        for d, p in self.splits:
            if d >= len(shape):
                return f"splits dim {d} of a {len(shape)}-d tensor"
            if int(shape[d]) < p:
                return f"dim {d} has extent {shape[d]} < {p} parts"
        return None

    # ---- DTensor view ---------------------------------------------------------------------
    def mesh_axes(self, world: int, ndim: int | None = None) -> tuple[tuple[str, int], ...]:
        """(name, size) of each mesh axis: one per split, then "P" (partial), then "rep"."""
        axes = [(dim_name(d, ndim), p) for d, p in self.splits]
        if self.partial > 1:
            axes.append(("P", self.partial))
        r = self.replicas(world)
        if r > 1 or not axes:
            axes.append(("rep", r))
        return tuple(axes)

    def placements(self, world: int, ndim: int | None = None) -> tuple:
        """One DTensor-style placement per mesh axis of ``mesh_axes``."""
        out = [Shard(d) for d, _ in self.splits]
        if self.partial > 1:
            out.append(Partial())
        if len(out) < len(self.mesh_axes(world, ndim)):
            out.append(Replicate())
        return tuple(out)

    def to_spec(self, shape: Sequence[int], world_or_mesh: "int | Mesh") -> "DistSpec":
        """This layout as a ``DistSpec``: the world (ranks 0..P-1) or the given mesh's ranks,
        in order, reshaped to ``mesh_axes``."""
        ranks = tuple(range(world_or_mesh)) if isinstance(world_or_mesh, int) else world_or_mesh.ranks
        axes = self.mesh_axes(len(ranks), len(shape))
        mesh = Mesh(ranks, tuple(s for _, s in axes), tuple(n for n, _ in axes))
        return DistSpec(mesh, self.placements(len(ranks), len(shape)), tuple(int(n) for n in shape))

    def placements_str(self, world: int) -> str:
        """E.g. ``[Shard(0), Shard(2), Replicate()]`` (for reports)."""
        return "[" + ", ".join(str(p) for p in self.placements(world)) + "]"


def dim_name(dim: int, ndim: int | None = None) -> str:
    """N, C, then the spatial dims D/H/W (the last ``ndim - 2`` of them); else ``d<dim>``."""
    if dim == 0:
        return "N"
    if dim == 1:
        return "C"
    spatial = "DHW"
    if ndim is None:
        ndim = 4 if dim < 4 else 5
    k = dim - 2 + (3 - (ndim - 2))
    if ndim <= 5 and 0 <= k < 3:
        return spatial[k]
    return f"d{dim}"


@functools.lru_cache(maxsize=65536)
def _split_group(layout: Layout, dims: tuple[int, ...], rank: int, world: int) -> tuple[int, ...]:
    """Cached: pricing asks for the same groups many times at large world sizes."""
    return layout._split_group_uncached(dims, rank, world)


def overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...] | None:
    """Intersection of two boxes given as per-dim (start, extent); None when empty."""
    out = []
    for (s0, e0), (s1, e1) in zip(a, b):
        lo, hi = max(s0, s1), min(s0 + e0, s1 + e1)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def loss_layout_for(out: Layout, batch: int, world: int) -> Layout:
    """The layout the loss is computed in: the output's if it splits only samples (and holds no
    partial sum), else the widest sample split that divides the world and the batch."""
    if out.partial == 1 and all(d == 0 for d, _ in out.splits):
        return out
    p = max(d for d in range(1, world + 1) if world % d == 0 and d <= batch)
    return Layout(((0, p),))
