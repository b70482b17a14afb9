"""Mesh: the ranks a tensor or a decomposition lives on, laid over named axes. Pure, no torch.

Legend: a *dim* is a tensor dimension (0 = N, 1 = C, 2.. = D/H/W); an *axis* is a factor of
the mesh. ``Mesh(ranks, shape, names)`` lays ``ranks`` row-major over ``shape``::

    ranks[i] sits at coords c with  i = ((c_0 * s_1 + c_1) * s_2 + c_2) ...

so the last axis varies fastest (its groups are nearby ranks). ``i`` is the *mesh-local* index
of a rank (its position in ``ranks``, the rank a ``Comm`` on this mesh sees); the ``ranks``
themselves are global ranks. Sub-meshes (``slice``, ``split``) keep global ranks, so every
decomposition and every tensor placement can name the same processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Mesh:
    """Global ``ranks`` laid row-major over ``shape``; one name per axis."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "names", tuple(str(n) for n in self.names))
        if not self.shape:
            raise ValueError("Mesh needs at least one axis (use shape (1,) for one rank)")
        if any(s < 1 for s in self.shape):
            raise ValueError(f"Mesh axis sizes must be >= 1: shape {self.shape}")
        if len(self.names) != len(self.shape):
            raise ValueError(f"Mesh has {len(self.shape)} axes but {len(self.names)} names: "
                             f"{self.names}")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"Mesh axis names repeat: {self.names}")
        if math.prod(self.shape) != len(self.ranks):
            raise ValueError(f"Mesh shape {self.shape} holds {math.prod(self.shape)} ranks but "
                             f"{len(self.ranks)} were given")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"Mesh ranks repeat: {self.ranks}")
        if any(r < 0 for r in self.ranks):
            raise ValueError(f"Mesh ranks must be >= 0: {self.ranks}")

    # ---- constructors ---------------------------------------------------------------------
    @staticmethod
    def world(n: int, name: str = "world") -> "Mesh":
        """Ranks 0..n-1 on one axis."""
        return Mesh(tuple(range(int(n))), (int(n),), (name,))

    def to_json(self) -> dict:
        return {"ranks": list(self.ranks), "shape": list(self.shape), "names": list(self.names)}

    @staticmethod
    def from_json(obj: dict) -> "Mesh":
        return Mesh(tuple(obj["ranks"]), tuple(obj["shape"]), tuple(obj["names"]))

    # ---- properties -----------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis(self, name_or_index: int | str) -> int:
        """Axis index of a name (or an index, checked)."""
        if isinstance(name_or_index, str):
            if name_or_index not in self.names:
                raise ValueError(f"mesh {self} has no axis named {name_or_index!r}")
            return self.names.index(name_or_index)
        a = int(name_or_index)
        if not 0 <= a < self.ndim:
            raise ValueError(f"mesh {self} has no axis {a}")
        return a

    def __str__(self) -> str:
        axes = "x".join(f"{n}{s}" for n, s in zip(self.names, self.shape))
        lo, hi = (min(self.ranks), max(self.ranks)) if self.ranks else (0, 0)
        contiguous = self.ranks == tuple(range(lo, hi + 1))
        return f"Mesh({axes} on {'ranks %d..%d' % (lo, hi) if contiguous else list(self.ranks)})"

    # ---- rank arithmetic ------------------------------------------------------------------
    def index_of(self, rank: int) -> int:
        """Mesh-local index of global ``rank``."""
        try:
            return self.ranks.index(int(rank))
        except ValueError:
            raise ValueError(f"rank {rank} is not on {self}") from None

    def coords_of_index(self, index: int) -> tuple[int, ...]:
        cs = []
        for s in reversed(self.shape):
            cs.append(index % s)
            index //= s
        return tuple(reversed(cs))

    def index_at(self, coords: Sequence[int]) -> int:
        if len(coords) != self.ndim:
            raise ValueError(f"{len(coords)} coords for a {self.ndim}-axis mesh")
        i = 0
        for c, s in zip(coords, self.shape):
            if not 0 <= c < s:
                raise ValueError(f"coords {tuple(coords)} outside mesh shape {self.shape}")
            i = i * s + int(c)
        return i

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of global ``rank``."""
        return self.coords_of_index(self.index_of(rank))

    def rank_at(self, coords: Sequence[int]) -> int:
        """Global rank at ``coords``."""
        return self.ranks[self.index_at(coords)]

    def axis_group(self, rank: int, axis: int | str) -> tuple[int, ...]:
        """Global ranks that differ from ``rank`` only along ``axis``, in coordinate order."""
        a = self.axis(axis)
        cs = list(self.coords(rank))
        out = []
        for c in range(self.shape[a]):
            cs[a] = c
            out.append(self.rank_at(cs))
        return tuple(out)

    def partition(self, axes: Iterable[int | str]) -> tuple[tuple[int, ...], ...]:
        """Every group of global ranks that vary along ``axes`` only (each sorted; sorted)."""
        axes = sorted({self.axis(a) for a in axes})
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(self.ranks):
            cs = self.coords_of_index(i)
            key = tuple(c for a, c in enumerate(cs) if a not in axes)
            groups.setdefault(key, []).append(r)
        return tuple(sorted(tuple(sorted(g)) for g in groups.values()))

    # ---- sub-meshes -----------------------------------------------------------------------
    def slice(self, axis: int | str, index: int) -> "Mesh":
        """The sub-mesh at ``index`` along ``axis`` (that axis removed; a 1-axis mesh keeps a
        size-1 axis)."""
        a = self.axis(axis)
        if not 0 <= index < self.shape[a]:
            raise ValueError(f"index {index} outside axis {self.names[a]} of size {self.shape[a]}")
        ranks = tuple(r for i, r in enumerate(self.ranks) if self.coords_of_index(i)[a] == index)
        if self.ndim == 1:
            return Mesh(ranks, (1,), self.names)
        return Mesh(ranks, self.shape[:a] + self.shape[a + 1:], self.names[:a] + self.names[a + 1:])

    def split(self, axis: int | str) -> list["Mesh"]:
        """The sub-meshes along ``axis``, one per index."""
        a = self.axis(axis)
        return [self.slice(a, i) for i in range(self.shape[a])]

    def reshape(self, shape: Sequence[int], names: Sequence[str]) -> "Mesh":
        """The same ranks, in the same order, over another shape."""
        return Mesh(self.ranks, tuple(shape), tuple(names))

    def overlaps(self, other: "Mesh") -> bool:
        """True when the two meshes share a rank."""
        return bool(set(self.ranks) & set(other.ranks))
