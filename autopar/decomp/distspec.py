"""Placements of a tensor on a mesh, in DTensor's vocabulary, and the arithmetic they imply.

Legend: a *dim* is a tensor dimension; an *axis* is a mesh axis (``autopar.decomp.mesh``).
``DistSpec(mesh, placements, shape)`` gives one placement per mesh axis:

* ``Shard(d)``      dim d is split over the axis by the ``torch.tensor_split`` rule of
                    ``block_extent/block_start``; several axes may shard the same dim,
                    outermost first, each splitting the block the outer ones left (as DTensor);
* ``Replicate()``   every rank along the axis holds the same block;
* ``Partial("sum")`` ranks along the axis hold addends: the value is their sum;
* ``PaddedShard(d, padded)`` dim d (valid extent n = shape[d]) is padded to ``padded``, a
                    multiple of the axis size p, and cut into equal blocks of b = padded / p;
                    block c holds valid elements [c*b, min(n, (c+1)*b)) first, then zeros. The
                    only axis that splits dim d (checked);
* ``HaloShard(d, lo, hi)`` owns dim d's block as ``Shard(d)`` and reads ``lo``/``hi`` more
                    elements of its neighbours (a spatially split convolution's input);
* ``SegmentShard(d, (n_0, n_1, ...))`` dim d is segments (fused q|k|v) each split on its own;
                    a parameter's placement (not one box, so no ``DistSpec``).

Uneven blocks need no placement of their own: every split follows the ``torch.tensor_split``
rule (the first ``n % p`` blocks one element longer). DTensor's ``Shard`` splits by
``torch.chunk`` instead (5 over 4: 2,1,1,1 here, 2,2,1,0 there), so an uneven ``Shard`` maps onto
DTensor only where both rules give the same blocks (``runtime.dtensor.to_dtensor`` checks).

Why not ``torch.distributed.tensor``'s own placement classes: autopar's are pure (importable and
testable without torch or a process group), serialise to JSON for plan files, and include the
padded shard DTensor lacks. They are named and printed like DTensor's (``Shard(0)``,
``Replicate()``, ``Partial(sum)``) so a plan reads at once, and ``to_torch()`` converts
Shard/Replicate/Partial to DTensor's objects (torch imported only then).

Ranks: ``DistSpec`` methods take *global* ranks (members of ``mesh.ranks``); ``*_at(index)``
take mesh-local indices. ``local_bounds`` is the valid data (global start, extent) per dim;
``local_shape`` adds the padding of a padded shard.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .mesh import Mesh


def block_extent(n: int, parts: int, index: int) -> int:
    """Extent of block ``index`` when ``n`` elements are split into ``parts`` blocks (the rule
    of ``torch.tensor_split``: the first ``n % parts`` blocks get one more)."""
    return n // parts + (1 if index < n % parts else 0)


def block_start(n: int, parts: int, index: int) -> int:
    """First element of block ``index`` when ``n`` elements are split into ``parts`` blocks."""
    return index * (n // parts) + min(index, n % parts)


# ---- placements ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """Dim ``dim`` split over the axis by the tensor_split rule."""

    dim: int

    def __str__(self) -> str:
        return f"Shard({self.dim})"

    def block(self, n: int, parts: int, index: int) -> tuple[int, int]:
        """(start, extent) of block ``index`` of ``n`` elements: start = i*(n//p) + min(i, n%p),
        extent = n//p + (i < n%p)."""
        return block_start(n, parts, index), block_extent(n, parts, index)

    def to_torch(self):
        from torch.distributed.tensor.placement_types import Shard as TShard
        return TShard(self.dim)


@dataclass(frozen=True)
class Replicate:
    """Every rank along the axis holds the same block."""

    def __str__(self) -> str:
        return "Replicate()"

    def to_torch(self):
        from torch.distributed.tensor.placement_types import Replicate as TReplicate
        return TReplicate()


@dataclass(frozen=True)
class Partial:
    """Ranks along the axis hold addends of the value (only ``sum``: gloo has no PREMUL_SUM)."""

    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce != "sum":
            raise ValueError(f"Partial({self.reduce}): only 'sum' is supported")

    def __str__(self) -> str:
        return f"Partial({self.reduce})"

    def to_torch(self):
        from torch.distributed.tensor.placement_types import Partial as TPartial
        return TPartial(self.reduce)


@dataclass(frozen=True)
class PaddedShard:
    """Dim ``dim`` padded to ``padded`` and cut into equal blocks of ``padded / parts``."""

    dim: int
    padded: int

    def __str__(self) -> str:
        return f"PaddedShard({self.dim}, {self.padded})"

    def block_len(self, parts: int) -> int:
        return self.padded // parts

    def block(self, n: int, parts: int, index: int) -> tuple[int, int]:
        """(start, valid extent) of block ``index``: b = padded/p, start = min(i*b, n),
        extent = max(0, min(n, (i+1)*b) - i*b)."""
        b = self.block_len(parts)
        start = min(index * b, n)
        return start, max(0, min(n, (index + 1) * b) - index * b)

    def to_torch(self):
        raise ValueError(f"{self}: DTensor has no padded shard")


@dataclass(frozen=True)
class HaloShard:
    """Dim ``dim`` split by the tensor_split rule (the *owned* block, as ``Shard``), each block
    read with ``halo_lo`` elements of its lower neighbour and ``halo_hi`` of its upper one (cut
    at the tensor's ends): what a spatially split convolution or pooling reads. The owned block
    is what the rank holds and what redistribution moves (``owned()``: a transition into a
    HaloShard is one into its Shard, priced and planned as such); the halo is exchanged inside
    the layer (``runtime.layers.halo``) and priced in the layer's own forward communication.
    ``autopar.decomp.spatial`` states it on the input of each split window op: per split dim
    the widest halo any block reads on each side (``geometry.halo_widths``); a block may read
    less (uneven blocks, strides), so the exact per-block window stays the geometry's, which
    checks it against these widths (``geometry.plan_halo``). ``HaloShard(d, 0, 0)`` is
    ``Shard(d)`` (``Sharding``'s normal form)."""

    dim: int
    halo_lo: int = 0
    halo_hi: int = 0

    def __post_init__(self) -> None:
        if self.halo_lo < 0 or self.halo_hi < 0:
            raise ValueError(f"HaloShard halo widths must be >= 0: {self.halo_lo}, {self.halo_hi}")

    def __str__(self) -> str:
        return f"HaloShard({self.dim}, {self.halo_lo}, {self.halo_hi})"

    def block(self, n: int, parts: int, index: int) -> tuple[int, int]:
        """The owned block: as ``Shard.block``."""
        return block_start(n, parts, index), block_extent(n, parts, index)

    def owned(self) -> Shard:
        """The owned block's placement: ``Shard(dim)``."""
        return Shard(self.dim)

    def read_block(self, n: int, parts: int, index: int) -> tuple[int, int]:
        """(start, extent) read with the halo: [s - lo, s + e + hi) cut to [0, n)."""
        s, e = self.block(n, parts, index)
        lo, hi = max(0, s - self.halo_lo), min(n, s + e + self.halo_hi)
        return lo, hi - lo

    def to_torch(self):
        raise ValueError(f"{self}: DTensor has no halo'd shard (its owned block is Shard({self.dim}))")


@dataclass(frozen=True)
class SegmentShard:
    """Dim ``dim`` is the concatenation of segments of lengths ``segments`` (a fused q|k|v
    weight), each split over the axis on its own by the tensor_split rule; a rank holds its
    block of every segment, in segment order (rank c of p: rows ``[q_c | k_c | v_c]``). Not one
    box: ``rows`` lists the global indices a rank holds. One segment is ``Shard(dim)``."""

    dim: int
    segments: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", tuple(int(n) for n in self.segments))
        if any(n < 0 for n in self.segments):
            raise ValueError(f"SegmentShard segment lengths must be >= 0: {self.segments}")

    def __str__(self) -> str:
        return f"SegmentShard({self.dim}, {'|'.join(str(n) for n in self.segments)})"

    def rows(self, n: int, parts: int, index: int) -> list[int]:
        """Global indices along ``dim`` held by block ``index`` of ``parts``, in local order."""
        if sum(self.segments) != n:
            raise ValueError(f"segments {self.segments} do not add up to extent {n} of dim {self.dim}")
        rows, base = [], 0
        for m in self.segments:
            s0 = base + block_start(m, parts, index)
            rows.extend(range(s0, s0 + block_extent(m, parts, index)))
            base += m
        return rows

    def to_torch(self):
        raise ValueError(f"{self}: DTensor has no segmented shard")


Placement = Shard | Replicate | Partial | PaddedShard | HaloShard | SegmentShard
SPLITS = (Shard, PaddedShard, HaloShard)
#: placements that split a dim (a segmented shard is not one box: ``DistSpec`` refuses it)
DIM_PLACEMENTS = (Shard, PaddedShard, HaloShard, SegmentShard)

_PARSE = [(re.compile(r"Shard\((\d+)\)$"), lambda m: Shard(int(m[1]))),
          (re.compile(r"Replicate\(\)$"), lambda m: Replicate()),
          (re.compile(r"Partial\((\w*)\)$"), lambda m: Partial(m[1] or "sum")),
          (re.compile(r"PaddedShard\((\d+),\s*(\d+)\)$"), lambda m: PaddedShard(int(m[1]), int(m[2]))),
          (re.compile(r"HaloShard\((\d+),\s*(\d+),\s*(\d+)\)$"),
           lambda m: HaloShard(int(m[1]), int(m[2]), int(m[3]))),
          (re.compile(r"SegmentShard\((\d+),\s*(\d+(?:\|\d+)*)\)$"),
           lambda m: SegmentShard(int(m[1]), tuple(int(n) for n in m[2].split("|"))))]


def owned_placement(p: Placement) -> Placement:
    """What a rank holds under ``p``: a ``HaloShard``'s owned block (``Shard``), else ``p``."""
    return p.owned() if isinstance(p, HaloShard) else p


def parse_placement(text: str) -> Placement:
    """Inverse of ``str`` on a placement (the JSON form)."""
    for pat, make in _PARSE:
        m = pat.match(text.strip())
        if m:
            return make(m)
    raise ValueError(f"not a placement: {text!r}")


def placements_str(placements: Sequence[Placement]) -> str:
    return "[" + ", ".join(str(p) for p in placements) + "]"


# ---- DistSpec -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DistSpec:
    """A tensor of global ``shape`` placed on ``mesh``: one placement per mesh axis."""

    mesh: Mesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", tuple(self.placements))
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        problem = self.covers()
        if problem:
            raise ValueError(f"DistSpec {placements_str(self.placements)} of shape {self.shape} "
                             f"on {self.mesh}: {problem}")

    def covers(self) -> str | None:
        """None when the placements fit the mesh and the shape; else the reason."""
        if len(self.placements) != self.mesh.ndim:
            return f"{len(self.placements)} placements for {self.mesh.ndim} mesh axes"
        padded_dims = set()
        for a, p in enumerate(self.placements):
            if isinstance(p, SegmentShard):
                return f"axis {a}: {p} is not one box (a parameter's placement, not a DistSpec's)"
            if isinstance(p, SPLITS) and not 0 <= p.dim < len(self.shape):
                return f"axis {a} splits dim {p.dim} of a {len(self.shape)}-d tensor"
            if isinstance(p, PaddedShard):
                n, parts = self.shape[p.dim], self.mesh.shape[a]
                if p.padded % parts:
                    return f"{p}: padded extent {p.padded} is not a multiple of axis size {parts}"
                if p.padded < n:
                    return f"{p}: padded extent {p.padded} < valid extent {n}"
                padded_dims.add(p.dim)
        for d in padded_dims:
            if sum(isinstance(p, SPLITS) and p.dim == d for p in self.placements) > 1:
                return f"dim {d} has a padded shard and another split"
        return None

    def __str__(self) -> str:
        return placements_str(self.placements)

    # ---- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"mesh": self.mesh.to_json(), "placements": [str(p) for p in self.placements],
                "shape": list(self.shape)}

    @staticmethod
    def from_json(obj: dict) -> "DistSpec":
        return DistSpec(Mesh.from_json(obj["mesh"]),
                        tuple(parse_placement(p) for p in obj["placements"]), tuple(obj["shape"]))

    # ---- properties -----------------------------------------------------------------------
    @property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, Partial))

    @property
    def is_partial(self) -> bool:
        return bool(self.partial_axes)

    @property
    def padded_axes(self) -> tuple[int, ...]:
        return tuple(a for a, p in enumerate(self.placements) if isinstance(p, PaddedShard))

    def owned(self) -> "DistSpec":
        """The blocks the ranks hold: every ``HaloShard`` as its ``Shard`` (what redistribution
        moves; the halo is the consuming layer's own exchange)."""
        if not any(isinstance(p, HaloShard) for p in self.placements):
            return self
        return DistSpec(self.mesh, tuple(owned_placement(p) for p in self.placements), self.shape)

    def with_placement(self, axis: int, placement: Placement) -> "DistSpec":
        ps = list(self.placements)
        ps[axis] = placement
        return DistSpec(self.mesh, tuple(ps), self.shape)

    def to_torch(self) -> list:
        """DTensor placements (raises for a padded shard)."""
        return [p.to_torch() for p in self.placements]

    # ---- per-rank arithmetic (mesh-local index) -------------------------------------------
    def bounds_at(self, index: int) -> tuple[tuple[int, int], ...]:
        """Valid data of mesh-local ``index``: global (start, extent) per dim."""
        cs = self.mesh.coords_of_index(index)
        bounds = [(0, n) for n in self.shape]
        for a, p in enumerate(self.placements):
            if isinstance(p, SPLITS):
                s, e = bounds[p.dim]
                bs, be = p.block(e, self.mesh.shape[a], cs[a])
                bounds[p.dim] = (s + bs, be)
        return tuple(bounds)

    def shape_at(self, index: int) -> tuple[int, ...]:
        """Local tensor shape of mesh-local ``index`` (valid extents; padded dims padded)."""
        out = [e for _, e in self.bounds_at(index)]
        for a in self.padded_axes:
            p = self.placements[a]
            out[p.dim] = p.block_len(self.mesh.shape[a])
        return tuple(out)

    def piece_key(self, index: int) -> tuple[int, ...]:
        """Ranks with equal keys hold the same local tensor (coords off the Replicate axes)."""
        cs = self.mesh.coords_of_index(index)
        return tuple(-1 if isinstance(p, Replicate) else c for c, p in zip(cs, self.placements))

    def partial_key(self, index: int) -> tuple[int, ...]:
        cs = self.mesh.coords_of_index(index)
        return tuple(cs[a] for a in self.partial_axes)

    # ---- per-rank arithmetic (global rank) ------------------------------------------------
    def local_bounds(self, rank: int) -> tuple[tuple[int, int], ...]:
        return self.bounds_at(self.mesh.index_of(rank))

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return self.shape_at(self.mesh.index_of(rank))


# ---- brute force (tests, validation) ------------------------------------------------------
def _zeros(like: Any, shape: Sequence[int]) -> Any:
    """Zeros of ``like``'s kind (torch tensor or numpy array)."""
    if hasattr(like, "new_zeros"):
        return like.new_zeros(tuple(shape))
    import numpy as np
    return np.zeros(tuple(shape), dtype=like.dtype)


def _index(box: Sequence[tuple[int, int]], origin: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    """Local index of global ``box`` in a tensor whose valid data starts at ``origin``."""
    return tuple(slice(s - o, s - o + e) for (s, e), (o, _) in zip(box, origin))


def scatter(full: Any, spec: DistSpec,
            pieces: Callable[[tuple[int, ...]], Any] | None = None) -> dict[int, Any]:
    """{global rank: local tensor} of ``full`` under ``spec``. On partial axes the ranks with a
    nonzero partial coord hold ``pieces(valid shape)`` (zeros when None) and the rank with all
    partial coords 0 holds ``block - sum(others)``. Replicas (Replicate axes) hold equal copies."""
    made: dict[tuple, Any] = {}
    order = sorted(range(spec.mesh.size), key=lambda i: any(spec.partial_key(i)), reverse=True)
    for i in order:                      # addends first, then the rest of each sum
        key = spec.piece_key(i)
        if key in made:
            continue
        b = spec.bounds_at(i)
        local = _zeros(full, spec.shape_at(i))
        valid = tuple(slice(0, e) for _, e in b)
        if any(spec.partial_key(i)):
            if pieces is not None:
                local[valid] = pieces(tuple(e for _, e in b))
        else:
            local[valid] = full[tuple(slice(s, s + e) for s, e in b)]
            for k, other in made.items():
                if _same_but_partial(spec, k, key):
                    local[valid] -= other[valid]
        made[key] = local
    return {r: _copy(made[spec.piece_key(i)]) for i, r in enumerate(spec.mesh.ranks)}


def _copy(x: Any) -> Any:
    return x.clone() if hasattr(x, "clone") else x.copy()


def _same_but_partial(spec: DistSpec, k1: tuple, k2: tuple) -> bool:
    pa = set(spec.partial_axes)
    return all(a in pa or x == y for a, (x, y) in enumerate(zip(k1, k2)))


def gather(locals_: dict[int, Any], spec: DistSpec) -> Any:
    """The full tensor: each distinct local's valid data placed and summed over partial axes
    (one replica per Replicate axis)."""
    first = next(iter(locals_.values()))
    full = _zeros(first, spec.shape)
    seen = set()
    for i, r in enumerate(spec.mesh.ranks):
        key = spec.piece_key(i)
        if key in seen:
            continue
        seen.add(key)
        b = spec.bounds_at(i)
        full[tuple(slice(s, s + e) for s, e in b)] += locals_[r][tuple(slice(0, e) for _, e in b)]
    return full
