"""RankMap: which physical slot (and so which node) runs each logical rank. Pure arithmetic.

Layouts, decompositions and the runtime speak *logical* ranks (``Sharding``: row-major, replicas
innermost). The cluster has *physical* ranks: slot ``p`` of the launcher (or torchrun's RANK),
on node ``p // ranks_per_node``. A ``RankMap`` maps one to the other.

The family is the *local stride* ``s`` (``s`` divides the world ``W``)::

    logical  l = a * s + b        (b = l % s, a = l // s)
    physical p = b * (W // s) + a

``s = 1`` is the identity ("block": nodes hold contiguous logical ranges, as before). Under
stride ``s`` the logical ranks ``{b + s * a}`` with consecutive ``a`` share a node: the mesh axis
whose logical stride is ``s`` (e.g. the sample axis of ``Channel(S, s)``, whose gradient
allreduce is the heaviest traffic of a wide layer) becomes node-local, and the innermost axes
(stride 1) spread over nodes instead.

SUPER's topology-aware placement (``autopar.decomp.branch``): the branch decompositions
``Branch(D, G, R)`` and ``HeadGroups(D, G, R, ffn)`` number their ranks
``l = (d * G + g) * R + x``, the branch axis inside the sample axis. Under block placement
(stride 1) the G x R ranks of one sample block are neighbours, so the i-th rank of every branch
shares a node: the *interleaved* placement, where the branch-boundary collectives (the join's
all-reduce) stay inside a node and only the gradient all-reduces of each branch's weights
(over its D ranks) cross nodes. Stride ``G * R`` is the *branch-contiguous* placement (each
branch's data-parallel ranks share nodes; the joins cross them). The placement search
(``autopar.solve.placement``) prices both, on the intra- and inter-node links of the profile,
and keeps the faster.

The runtime applies a placement by relabeling at process-group init: the process in physical
slot ``p`` joins the group as rank ``logical(p)`` (``autopar.runtime.launch``), so everything
it sees afterwards is logical and nothing else changes. No torch import here: the runtime
imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import PlacementError


@dataclass(frozen=True)
class RankMap:
    """Logical rank -> physical rank by local stride ``local_stride`` (1: identity)."""

    world: int
    local_stride: int = 1

    def __post_init__(self) -> None:
        w, s = int(self.world), int(self.local_stride)
        if w < 1:
            raise PlacementError(f"placement needs a world size >= 1, got {self.world}",
                                 "give a positive number of ranks")
        if s < 1 or w % s:
            raise PlacementError(f"local stride {self.local_stride} does not divide world size {w}",
                                 f"use a divisor of {w} (1 = block placement), or --placement search")
        object.__setattr__(self, "world", w)
        object.__setattr__(self, "local_stride", s)

    @staticmethod
    def identity(world: int) -> "RankMap":
        return RankMap(world, 1)

    @property
    def is_identity(self) -> bool:
        """Stride 1 and stride W both map every rank to itself."""
        return self.local_stride in (1, self.world)

    # ---- rank arithmetic ----------------------------------------------------------------
    def physical(self, logical: int) -> int:
        """Physical slot of logical rank ``logical``."""
        s = self.local_stride
        return (logical % s) * (self.world // s) + logical // s

    def logical(self, physical: int) -> int:
        """Logical rank run by physical slot ``physical`` (the inverse of ``physical``)."""
        q = self.world // self.local_stride
        return (physical % q) * self.local_stride + physical // q

    def node_of(self, logical: int, ranks_per_node: int) -> int:
        return self.physical(logical) // ranks_per_node

    # ---- serialisation ------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"kind": "stride", "local_stride": self.local_stride}

    @staticmethod
    def from_json(obj: dict[str, Any] | None, world: int) -> "RankMap":
        """``None`` (a plan written before placements existed) is the identity."""
        if obj is None:
            return RankMap.identity(world)
        if not isinstance(obj, dict) or obj.get("kind") != "stride" or "local_stride" not in obj:
            raise PlacementError(f"unknown placement {obj!r}",
                                 'expected {"kind": "stride", "local_stride": S}; re-plan')
        return RankMap(world, int(obj["local_stride"]))

    def __str__(self) -> str:
        return "block" if self.local_stride == 1 else f"stride({self.local_stride})"


def branch_role(placement: RankMap, decisions) -> str:
    """What ``placement`` means for the branch decompositions among ``decisions`` (values with
    ``groups`` and ``replicas``, i.e. ``Branch`` / ``HeadGroups``): "interleaved" (block: each
    sample block's branch ranks share a node), "branch-contiguous" (stride G x R), or ""."""
    roles = set()
    for d in decisions:
        g, r = getattr(d, "groups", None), getattr(d, "replicas", None)
        if g is None or r is None or d.kind not in ("branch", "head_groups"):
            continue
        if placement.is_identity:
            roles.add("interleaved")
        elif placement.local_stride == g * r:
            roles.add("branch-contiguous")
    return "/".join(sorted(roles))


def branch_contiguous(world: int, groups: int, replicas: int = 1) -> RankMap:
    """The placement that puts each branch's data-parallel ranks together (stride G x R) for a
    branch decomposition of ``groups`` x ``replicas``; block placement is the interleaved one."""
    return RankMap(world, groups * replicas)


def candidate_strides(world: int, ranks_per_node: int) -> list[int]:
    """Local strides worth trying besides the identity: ``1 < s <= W // ranks_per_node`` with
    ``s`` dividing ``W``, restricted to the ladder of powers of each prime factor of ``W``
    times the others' full powers below it (for a power of two: 2, 4, 8, ...); at most
    ``log2(W)`` strides. Empty on one node (every placement prices the same)."""
    w, r = int(world), int(ranks_per_node)
    if r < 1 or w <= r:
        return []
    top = w // r
    return [s for s in _ladder(w) if 1 < s <= top]


def _ladder(n: int) -> list[int]:
    """Divisors of ``n`` built by multiplying in its prime factors one at a time, smallest
    first: for 1024 -> 2, 4, ..., 1024; for 96 = 2^5 * 3 -> 2, 4, 8, 16, 32, 96 (so every
    stride that is a product of the axis sizes of a power-of-two mesh is present)."""
    out, m, d = [], n, 2
    primes = []
    while d * d <= m:
        while m % d == 0:
            primes.append(d)
            m //= d
        d += 1
    if m > 1:
        primes.append(m)
    acc = 1
    for p in primes:
        acc *= p
        out.append(acc)
    return out
