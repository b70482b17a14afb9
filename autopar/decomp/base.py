"""The decomposition protocol and its one registry.

A decomposition is a small frozen value (``Sample(parts=4)``, ``Replicate()``...) chosen per layer.
Its class owns, in one module:

* legality: ``candidates(layer, ctx)`` lists the legal instances for a layer, ``check`` says why
  an instance is illegal (plan-time, with the layer and the reason);
* layouts: ``in_layout(layer, value)`` and ``out_layout(layer)`` say how activations enter and
  leave the layer, ``param_shard(op, role)`` how each parameter is split; transitions between
  neighbours follow from the layouts (``autopar.decomp.transition``);
* cost: ``cost(layer, ctx) -> LayerCost``, each formula in the docstring next to its code;
* runtime: ``run(ctx, kind, inputs, params, buffers, attrs, in_shapes, out_shape)`` executes one
  op of the layer on local tensors.

Gradient convention (every decomposition keeps it): each rank r computes a local loss L_r with
``sum_r L_r = L`` (the single-process loss); every transition's backward is its exact adjoint;
therefore the gradient of a parameter is the SUM of local gradients over the ranks that hold the
same shard (``grad_group``). Replicas of a block scale their loss share by 1/replicas.

Register a decomposition with ``@register``; ``autopar.decomp`` imports every module explicitly.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Iterable

from .ir import Layer, OpSpec
from .layout import Layout


@dataclass(frozen=True)
class ParamShard:
    """How one parameter is held by each rank.

    ``mesh`` is a Layout used only for its rank -> coordinate arithmetic (its splits are the
    mesh axes); ``dims`` pairs a parameter dim with the mesh axis (index into ``mesh.splits``)
    that splits it, by the ``tensor_split`` rule. ``dims == ()``: the whole parameter on every
    rank. Ranks with equal coordinates on those axes hold the same shard and SUM their
    gradients (``grad_group``): for a whole parameter, the world.
    """

    mesh: Layout = field(default_factory=Layout)
    dims: tuple[tuple[int, int], ...] = ()

    def shard_coords(self, rank: int, world: int) -> tuple[int, ...]:
        cs, _ = self.mesh.coords(rank, world)
        return tuple(cs[axis] for _, axis in self.dims)

    def local_bounds(self, shape, rank: int, world: int) -> tuple[tuple[int, int], ...]:
        from .layout import block_extent, block_start
        bounds = [(0, int(n)) for n in shape]
        for (d, axis), c in zip(self.dims, self.shard_coords(rank, world)):
            p = self.mesh.splits[axis][1]
            bounds[d] = (block_start(int(shape[d]), p, c), block_extent(int(shape[d]), p, c))
        return tuple(bounds)

    def local_shape(self, shape, rank: int, world: int) -> tuple[int, ...]:
        return tuple(e for _, e in self.local_bounds(shape, rank, world))

    def grad_group(self, rank: int, world: int) -> list[int]:
        """Ranks holding the same shard as ``rank`` (their gradients are summed)."""
        if not self.dims:
            return list(range(world))
        me = self.shard_coords(rank, world)
        return [q for q in range(world) if self.shard_coords(q, world) == me]


@dataclass(frozen=True)
class LayerCost:
    """Predicted cost of one layer under one decomposition, per rank (the slowest rank)."""

    fwd_compute_s: float = 0.0
    bwd_compute_s: float = 0.0
    fwd_comm_s: float = 0.0           # exposed communication in forward (halo, allgather, ...)
    bwd_comm_s: float = 0.0           # exposed communication in backward
    grad_sync_s: float = 0.0          # gradient allreduce, overlappable with earlier layers' backward
    grad_sync_bytes: float = 0.0      # bytes allreduced per rank for this layer's gradients
    param_bytes: float = 0.0
    grad_bytes: float = 0.0
    optim_bytes: float = 0.0
    activation_bytes: float = 0.0     # saved for backward
    workspace_bytes: float = 0.0      # transient buffers (halos, gathers)
    source: str = "fit"               # what priced the compute: "exact", "fit", "mixed"
    optim_step_s: float = 0.0         # optimizer update of the local parameters (set by the table)
    # the latency part of grad_sync_s per gradient group, ((group signature, s), ...): the
    # runtime all-reduces a bucket's gradients of one group as ONE collective, so a bucket pays
    # each group's latency once, not once per layer (``cost.table.bucket_allreduce_s``)
    grad_sync_latency: tuple = ()

    @property
    def memory_bytes(self) -> float:
        return (self.param_bytes + self.grad_bytes + self.optim_bytes + self.activation_bytes
                + self.workspace_bytes)

    @property
    def fwd_s(self) -> float:
        return self.fwd_compute_s + self.fwd_comm_s

    @property
    def bwd_s(self) -> float:
        return self.bwd_compute_s + self.bwd_comm_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory_bytes"] = self.memory_bytes
        return d


@dataclass
class CostContext:
    """What pricing needs besides the layer: the profile, the world, the placement."""

    profile: Any                      # autopar.calibrate.profile.Profile
    world: int
    ranks_per_node: int
    optimizer_state_per_param: float = 1.0   # SGD with momentum: 1 copy; Adam: 2
    batch_size: int = 1
    prefer_exact: bool = True
    max_candidates: int = 8
    spec_log: list | None = None      # when a list, every exact shape the pricing asked for
    key_log: list | None = None       # when a list, the exact measurements that priced ops

    @property
    def ranks_on_node(self) -> int:
        return max(1, min(self.world, self.ranks_per_node))

    def level(self, ranks: Iterable[int]) -> str:
        """"intra" when every rank is on one node (nodes hold contiguous rank ranges)."""
        if isinstance(ranks, range):
            lo, hi = (ranks.start, ranks[-1]) if len(ranks) else (0, 0)
        else:
            ranks = list(ranks)
            if not ranks:
                return "intra"
            lo, hi = min(ranks), max(ranks)
        return "intra" if lo // self.ranks_per_node == hi // self.ranks_per_node else "inter"


class Decomposition:
    """Base of every decomposition value type (subclasses are frozen dataclasses)."""

    kind: ClassVar[str] = ""
    #: Op kinds this decomposition can execute (others make the layer illegal under it).
    supported_ops: ClassVar[frozenset[str]] = frozenset()

    # ---- layouts -------------------------------------------------------------------------
    def in_layout(self, layer: Layer, value: str) -> Layout:
        raise NotImplementedError

    def out_layout(self, layer: Layer) -> Layout:
        raise NotImplementedError

    def param_shard(self, op: OpSpec, role: str) -> ParamShard:
        return ParamShard()

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        """Process-group partitions of the world that the runtime needs for this layer."""
        return []

    # ---- legality ------------------------------------------------------------------------
    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list["Decomposition"]:
        raise NotImplementedError

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        bad = [op.kind for op in layer.ops if op.kind not in self.supported_ops]
        if bad:
            return f"{self.kind} cannot execute op kind(s) {sorted(set(bad))}"
        return None

    # ---- cost ----------------------------------------------------------------------------
    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        raise NotImplementedError

    # ---- runtime -------------------------------------------------------------------------
    def run(self, ctx: Any, op: str, inputs: list[Any], params: dict[str, Any],
            buffers: dict[str, Any], attrs: dict[str, Any], in_shapes: list[list[int]],
            out_shape: list[int]) -> Any:
        raise NotImplementedError

    # ---- serialisation -------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, tuple) else v
        return d

    def __str__(self) -> str:
        vals = [getattr(self, f.name) for f in fields(self)]  # type: ignore[arg-type]
        inner = ",".join("x".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in vals)
        return f"{self.kind}({inner})" if inner else self.kind


REGISTRY: dict[str, type[Decomposition]] = {}


def register(cls: type[Decomposition]) -> type[Decomposition]:
    """Class decorator: add a decomposition to the one registry, keyed by ``cls.kind``."""
    if not cls.kind:
        raise TypeError(f"{cls.__name__} has no kind")
    if cls.kind in REGISTRY and REGISTRY[cls.kind] is not cls:
        raise TypeError(f"decomposition kind {cls.kind!r} registered twice")
    REGISTRY[cls.kind] = cls
    return cls


def decomposition_from_json(obj: dict[str, Any]) -> Decomposition:
    obj = dict(obj)
    kind = obj.pop("kind")
    if kind not in REGISTRY:
        raise KeyError(f"unknown decomposition kind {kind!r}; known: {sorted(REGISTRY)}")
    cls = REGISTRY[kind]
    kwargs = {}
    for f in fields(cls):  # type: ignore[arg-type]
        v = obj.get(f.name)
        kwargs[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kwargs)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def prod(xs: Iterable[int]) -> int:
    return math.prod(xs)
