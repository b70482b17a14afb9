"""The decomposition protocol and its one registry.

A decomposition is a small frozen value (``Sample(parts=4)``, ``Replicate()``...) chosen per layer.
Its class owns, in one module:

* legality: ``candidates(layer, ctx)`` lists the legal instances for a layer, ``check`` says why
  an instance is illegal (plan-time, with the layer and the reason);
* layouts: ``in_placement(layer, value)`` and ``out_placement(layer)`` say how activations enter and
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
``register`` also routes ``candidates``, ``check`` and ``cost`` through the placement search's
memo (``price_once``): when ``ctx.cost_memo`` is a dict, a result priced under one rank
placement is reused under another whenever every group the pricing asked ``ctx.level`` about
is on the same kind of link under both, so a search over placements prices each choice once
plus once per placement that actually moves one of its groups across nodes.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Iterable

from .ir import Layer, OpSpec
from .sharding import Replicate, SegmentShard, Shard, Sharding, block_extent, block_start
from .rankmap import RankMap
from .bn import layer_problem


@dataclass(frozen=True, eq=False)
class ParamShard:
    """How one parameter is held by each rank: its placements on its layer's mesh
    (``sharding``, a ``Sharding``): ``Shard(param dim)`` on each axis that splits it (by the
    ``tensor_split`` rule), ``SegmentShard`` for a fused weight, ``Replicate()`` on the other
    axes. ``ParamShard()``: the whole parameter on every rank. Ranks with equal coordinates on
    the splitting axes hold the same shard and SUM their gradients (``grad_group``): for a
    whole parameter, the world.

    A *segmented* shard (``SegmentShard(d, (n_q, n_k, n_v))``, a fused q|k|v weight): dim d is
    the concatenation of segments of these lengths, each split on its own; a rank holds its
    block of every segment, in segment order (rank c of p holds rows ``[q_c | k_c | v_c]``).
    Such a shard is no box: ``local_bounds`` refuses it, ``index`` gives the indices for every
    kind of shard.
    """

    sharding: Sharding = field(default_factory=Sharding)

    def __eq__(self, other) -> bool:
        """Same placements on the same axes, names included: two layers' meshes of equal sizes
        are one mesh only when their axes are named alike (tied parameters, ``cost.table``)."""
        return type(other) is type(self) and (self.sharding, self.sharding.names) == \
            (other.sharding, other.sharding.names)

    def __hash__(self) -> int:
        return hash((self.sharding, self.sharding.names))

    @staticmethod
    def on(mesh: Sharding, dims: tuple[tuple[int, int], ...] = (), segments: tuple[int, ...] = ()) -> "ParamShard":
        """The parameter on the axes of ``mesh`` (a layer's sharding: only its axis sizes and
        names are used): ``dims`` pairs a parameter dim with the mesh axis that splits it;
        ``segments`` (more than one) make the first pair a ``SegmentShard``."""
        ps: list = [Replicate()] * len(mesh.sizes)
        for i, (d, axis) in enumerate(dims):
            ps[axis] = SegmentShard(d, tuple(segments)) if i == 0 and len(segments) > 1 else Shard(d)
        return ParamShard(mesh.with_placements(ps))

    @property
    def dims(self) -> tuple[tuple[int, int], ...]:
        """(parameter dim, mesh axis) of each axis that splits it; () when whole."""
        sh = self.sharding
        return tuple((sh.placements[a].dim, a) for a in sh.shard_axes)

    @property
    def segments(self) -> tuple[int, ...]:
        """The segment lengths of a segmented shard, else ()."""
        return next((p.segments for p in self.sharding.placements if isinstance(p, SegmentShard)), ())

    def shard_coords(self, rank: int, world: int) -> tuple[int, ...]:
        cs, _ = self.sharding.coords(rank, world)
        return cs

    def local_bounds(self, shape, rank: int, world: int) -> tuple[tuple[int, int], ...]:
        if len(self.segments) > 1:
            raise ValueError(f"a segmented shard ({self.segments}) is not one box: use ParamShard.index")
        return self.sharding.local_bounds(shape, rank, world)

    def index(self, shape, rank: int, world: int) -> tuple:
        """What to index a full tensor with to get ``rank``'s shard (``full[index]``, also as
        an assignment target): slices, and a list of indices on a segmented dim."""
        if len(self.segments) <= 1:
            return tuple(slice(s, s + e) for s, e in self.local_bounds(shape, rank, world))
        sh = self.sharding
        idx: list = [slice(None)] * len(shape)
        for a, c in zip(sh.shard_axes, self.shard_coords(rank, world)):
            p, n = sh.placements[a], int(shape[sh.placements[a].dim])
            if isinstance(p, SegmentShard):
                idx[p.dim] = p.rows(n, sh.sizes[a], c)
            else:
                s0 = block_start(n, sh.sizes[a], c)
                idx[p.dim] = slice(s0, s0 + block_extent(n, sh.sizes[a], c))
        return tuple(idx)

    def local_shape(self, shape, rank: int, world: int) -> tuple[int, ...]:
        if len(self.segments) > 1:
            idx = self.index(shape, rank, world)
            return tuple(len(i) if isinstance(i, list) else len(range(*i.indices(int(n))))
                         for i, n in zip(idx, shape))
        return tuple(e for _, e in self.local_bounds(shape, rank, world))

    def grad_group(self, rank: int, world: int) -> list[int]:
        """Ranks holding the same shard as ``rank`` (their gradients are summed)."""
        if not self.dims:
            return list(range(world))
        return self.sharding.same_shard_group(rank, world)


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
    # the latency part of grad_sync_s per gradient group, ((group signature, s, s if in the
    # last bucket), ...): the runtime all-reduces a bucket's gradients of one group as ONE
    # collective, so a bucket pays each group's latency once, not once per layer; the last
    # bucket, which the step waits for, at the blocking in-situ latency
    # (``cost.table.bucket_allreduce_s``, ``cost.primitives.grad_latencies_s``)
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
    """What pricing needs besides the layer: the profile, the world, the placement.

    ``placement`` maps the logical ranks pricing speaks of to physical slots, and so to nodes
    (``autopar.decomp.rankmap``); None is the identity (nodes hold contiguous rank ranges).
    Pricing asks about links only through ``level`` and ``worst_level`` and never reads
    ``placement`` itself: the placement search's memo (``price_once``) relies on it.
    """

    profile: Any                      # autopar.profile.Profile
    world: int
    ranks_per_node: int
    optimizer_state_per_param: float = 1.0   # SGD with momentum: 1 copy; Adam: 2
    batch_size: int = 1
    prefer_exact: bool = True
    max_candidates: int = 8
    spec_log: list | None = None      # when a list, every exact shape the pricing asked for
    key_log: list | None = None       # when a list, the exact measurements that priced ops
    placement: RankMap | None = None
    # plan-wide batch-norm statistics (``autopar.decomp.bn.BatchNormStats``); None = global
    batch_norm: Any = None
    level_log: set | None = None      # when a set, every group of <= ranks_per_node ranks that
                                      # level() was asked about (sorted tuples; larger groups
                                      # cross nodes under every placement), and every partition
                                      # worst_level() was (tuples of such tuples)
    cost_memo: dict | None = None     # when a dict, pricing results shared across placements
                                      # (``price_once``); contexts that share it must differ
                                      # in nothing but the placement
    # the model's output value when its loss is one cross-entropy over the output's last dim
    # (the vocabulary-parallel loss of ``tensor_parallel.vocab.VocabHead`` is possible); None else
    loss_output: str | None = None
    # every local compute time is multiplied by this: the machine's usual speed against the
    # one the profile's kernels are stated at (``profile.history``); 1.0 prices as measured
    speed_factor: float = 1.0
    # price every op as run inside the user's module (``runtime.native``), not op by op:
    # ``cost.primitives.runtime_overhead_s(..., native=True)``
    native_runtime: bool = False

    def __post_init__(self) -> None:
        if self.placement is None:
            self.placement = RankMap.identity(self.world)
        elif self.placement.world != self.world:
            raise ValueError(f"placement for world {self.placement.world} used at world {self.world}")

    @property
    def ranks_on_node(self) -> int:
        return max(1, min(self.world, self.ranks_per_node))

    def level(self, ranks: Iterable[int]) -> str:
        """"intra" when every rank is on one node under the placement, else "inter"."""
        rpn = self.ranks_per_node
        if not isinstance(ranks, (range, list, tuple)):
            ranks = list(ranks)
        if self.level_log is not None and 1 < len(ranks) <= rpn:
            self.level_log.add(tuple(sorted(ranks)))
        if self.placement.is_identity:   # fast path: nodes hold contiguous rank ranges
            if isinstance(ranks, range):
                lo, hi = (ranks.start, ranks[-1]) if len(ranks) else (0, 0)
            else:
                if not ranks:
                    return "intra"
                lo, hi = min(ranks), max(ranks)
            return "intra" if lo // rpn == hi // rpn else "inter"
        if len(ranks) > rpn:             # more ranks than one node holds
            return "inter"
        if not len(ranks):
            return "intra"
        return "intra" if _one_node(self.placement, rpn, tuple(ranks)) else "inter"

    def worst_level(self, groups: Iterable[Iterable[int]]) -> str:
        """"inter" if any of ``groups`` (e.g. one partition's, running side by side) crosses
        nodes, else "intra". ``level_log`` records the partition as one entry (a tuple of
        groups), unless its answer cannot depend on the placement."""
        groups = groups if isinstance(groups, tuple) else tuple(tuple(sorted(g)) for g in groups)
        if self.level_log is not None and any(1 < len(g) <= self.ranks_per_node for g in groups):
            self.level_log.add(groups)      # one entry for the partition (price_once resolves it)
        return "inter" if _any_crosses(self.placement, self.ranks_per_node, groups) else "intra"


@functools.lru_cache(maxsize=4096)
def _any_crosses(placement: RankMap, ranks_per_node: int, groups: tuple) -> bool:
    """Cached: pricing asks about the same few partitions many times."""
    for g in groups:
        if not g:
            continue
        if placement.is_identity:
            if min(g) // ranks_per_node != max(g) // ranks_per_node:
                return True
        elif len(g) > ranks_per_node or not _one_node(placement, ranks_per_node, tuple(g)):
            return True
    return False


@functools.lru_cache(maxsize=65536)
def _one_node(placement: RankMap, ranks_per_node: int, ranks: tuple[int, ...]) -> bool:
    """Cached: pricing asks about the same few groups many times at large world sizes."""
    node = placement.node_of(ranks[0], ranks_per_node)
    return all(placement.node_of(r, ranks_per_node) == node for r in ranks[1:])


class Decomposition:
    """Base of every decomposition value type (subclasses are frozen dataclasses)."""

    kind: ClassVar[str] = ""
    #: Op kinds this decomposition can execute (others make the layer illegal under it).
    supported_ops: ClassVar[frozenset[str]] = frozenset()
    #: Kept by the cost table's pruner whatever its price (the data-parallel baselines, so
    #: that the plan space of every run contains pure data parallelism and pure replication).
    always_kept: ClassVar[bool] = False
    #: Name of this class's single-method series in the strong-scaling sweep (``autopar.sweep``;
    #: "" for none), and which of its candidates belong to it.
    scaling_series: ClassVar[str] = ""

    def in_scaling_series(self) -> bool:
        return True

    # ---- layouts -------------------------------------------------------------------------
    def in_placement(self, layer: Layer, value: str) -> Sharding:
        raise NotImplementedError

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        """Sharding of ``value`` (one of ``layer.outputs``; default the main ``layer.output``) as
        the layer leaves it."""
        raise NotImplementedError

    def param_shard(self, op: OpSpec, role: str) -> ParamShard:
        return ParamShard()

    def layer_param_shard(self, layer: Layer, op: OpSpec, role: str) -> ParamShard:
        """``param_shard`` for a decomposition that needs the whole unit to decide (branch
        parallelism: which branch an op belongs to); by default ``param_shard(op, role)``."""
        return self.param_shard(op, role)

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
        const = [op.name for op in layer.ops if op.attrs.get("constant")]
        if const:
            return (f"{const[0]} is made from constants or parameters only: it is computed whole "
                    f"on every rank (replicate)")
        return None

    def bn_placement(self, layer: Layer, op: OpSpec) -> Sharding:
        """Sharding of the input of batch norm ``op`` (whose samples a rank holds); a layer input's
        ``in_placement``, otherwise ``out_placement`` (transparent ops after an anchor)."""
        v = op.inputs[0]
        return self.in_placement(layer, v) if v in layer.inputs else self.out_placement(layer)

    # ---- cost ----------------------------------------------------------------------------
    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        raise NotImplementedError

    # ---- runtime -------------------------------------------------------------------------
    def run(self, comm: Any, layer: Layer, op: OpSpec, inputs: list[Any],
            params: dict[str, Any], buffers: dict[str, Any]) -> Any:
        """Run ``op`` of ``layer`` on this rank's local tensors (``comm``: the runtime's
        ``Comm`` of the plan's mesh; ``params``/``buffers`` by qualified name). The run-time
        half is not here: it is the function registered for this class (or the nearest base
        class) in ``RUNNERS`` by ``autopar.runtime.layers``, which the runtime imports and
        planning never does. A decomposition defined outside autopar (``tests/toys``) may
        override this method with its run-time half instead."""
        return runner_of(type(self))(self, comm, layer, op, inputs, params, buffers)

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

#: the run-time halves: decomposition class -> ``fn(dec, comm, layer, op, inputs, params,
#: buffers)``, filled by ``autopar.runtime.layers`` (``runs``); empty in a planning process
RUNNERS: dict[type, Any] = {}


def runs(cls: type) -> Any:
    """Decorator of ``autopar.runtime.layers``: ``fn`` is the run-time half of ``cls`` and of
    its subclasses that register none of their own."""
    def deco(fn):
        RUNNERS[cls] = fn
        return fn
    return deco


def runner_of(cls: type) -> Any:
    """The run-time half registered for ``cls`` or its nearest base class (``RUNNERS``)."""
    for c in cls.__mro__:
        fn = RUNNERS.get(c)
        if fn is not None:
            return fn
    raise NotImplementedError(f"no run-time half for decomposition {cls.__name__}: the runtime registers "
                              "them (import autopar.runtime); a new one goes in autopar.runtime.layers, "
                              "or overrides run")


def register(cls: type[Decomposition]) -> type[Decomposition]:
    """Class decorator: add a decomposition to the one registry, keyed by ``cls.kind``, with
    its ``candidates``, ``check`` and ``cost`` routed through ``price_once``."""
    if not cls.kind:
        raise TypeError(f"{cls.__name__} has no kind")
    if cls.kind in REGISTRY and REGISTRY[cls.kind] is not cls:
        raise TypeError(f"decomposition kind {cls.kind!r} registered twice")
    chk = inspect.getattr_static(cls, "check")
    if not getattr(chk, "_bn_checked", False):
        cls.check = _with_bn_check(chk)
    for name in ("candidates", "check", "cost"):
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, classmethod):
            if not getattr(attr.__func__, "_price_once", False):
                setattr(cls, name, classmethod(price_once(attr.__func__, name)))
        elif not getattr(attr, "_price_once", False):
            setattr(cls, name, price_once(attr, name))
    REGISTRY[cls.kind] = cls
    return cls


def _with_bn_check(fn):
    """``check`` followed, when legal, by the plan's batch-norm statistics (``decomp.bn``):
    under local statistics every rank must hold whole groups of samples at each batch norm."""
    @functools.wraps(fn)
    def check(obj, layer, ctx):
        why = fn(obj, layer, ctx)
        if why is None:
            why = layer_problem(layer, lambda op: obj.bn_placement(layer, op), getattr(ctx, "batch_norm", None))
        return why
    check._bn_checked = True
    return check


def price_once(fn, name: str):
    """Wrap ``fn(obj, layer, ctx)`` (``candidates``, ``check`` or ``cost``) with ``ctx.cost_memo``.

    Without a memo it is ``fn``. With one, the result is kept per (name, obj, layer) together
    with the link level of every group of at most ``ranks_per_node`` ranks the call asked
    ``ctx.level`` about (larger groups cross nodes under any placement). Pricing depends on the
    placement only through those answers, and the groups asked depend only on earlier answers,
    so when every recorded group has the same level under ``ctx.placement`` the computation
    would repeat itself: the kept result is returned (with the exact-measurement keys and
    shapes it logged, replayed into ``ctx.key_log`` / ``ctx.spec_log``).
    """
    @functools.wraps(fn)
    def memoized(obj, layer, ctx):
        memo = getattr(ctx, "cost_memo", None)
        if memo is None:
            return fn(obj, layer, ctx)
        key = (name, fn, obj, id(layer))     # fn: a subclass method calling super() has its own entry
        hit = memo_lookup(memo, ctx, memo.get(key))
        if hit is not None:
            _, _, value, keys, specs = hit
            if keys and ctx.key_log is not None:
                ctx.key_log.extend(keys)
            if specs and ctx.spec_log is not None:
                ctx.spec_log.extend(specs)
            return list(value) if isinstance(value, list) else value
        n_keys = len(ctx.key_log) if ctx.key_log is not None else 0
        n_specs = len(ctx.spec_log) if ctx.spec_log is not None else 0
        value, groups, levels = record_levels(memo, ctx, lambda: fn(obj, layer, ctx))
        keys = list(ctx.key_log[n_keys:]) if ctx.key_log is not None else []
        specs = list(ctx.spec_log[n_specs:]) if ctx.spec_log is not None else []
        memo.setdefault(key, []).append((groups, levels, list(value) if isinstance(value, list) else value,
                                         keys, specs))
        return value
    memoized._price_once = True
    return memoized


def memo_lookup(memo: dict, ctx: CostContext, entries):
    """The first of ``entries`` (tuples starting ``groups, levels``) whose every recorded group
    has the same link level under ``ctx.placement``, or None; its groups are added to an
    enclosing call's ``ctx.level_log`` (that call depends on them too)."""
    if not entries:
        return None
    known = _levels_known(memo, ctx)
    for entry in entries:
        groups, levels = entry[0], entry[1]
        if all((known.get(g) or _level_into(known, ctx, g)) == lv for g, lv in zip(groups, levels)):
            if ctx.level_log is not None:
                ctx.level_log.update(groups)
            return entry
    return None


def record_levels(memo: dict, ctx: CostContext, compute):
    """``(compute(), groups, levels)``: the groups whose link level ``compute`` asked about
    (``ctx.level_log``) and their levels under ``ctx.placement``, also passed on to an
    enclosing call's log."""
    outer = ctx.level_log
    ctx.level_log = set()
    try:
        value = compute()
        asked = ctx.level_log
    finally:
        ctx.level_log = outer
    if outer is not None:
        outer |= asked
    groups = tuple(asked)
    known = _levels_known(memo, ctx)
    return value, groups, tuple(known.get(g) or _level_into(known, ctx, g) for g in groups)


def _levels_known(memo: dict, ctx: CostContext) -> dict:
    """The memo's group -> level answers under ``ctx``'s placement (a dict lookup is ~20x
    cheaper than ``ctx.level``, and a table asks about the same few groups many times)."""
    return memo.setdefault(("levels", ctx.placement, ctx.ranks_per_node), {})


def _level_into(known: dict, ctx: CostContext, group: tuple) -> str:
    """The level of a ``level_log`` entry: a group (ints) or a partition (tuple of groups)."""
    saved, ctx.level_log = ctx.level_log, None
    try:
        partition = bool(group) and isinstance(group[0], tuple)
        known[group] = lv = ctx.worst_level(group) if partition else ctx.level(group)
    finally:
        ctx.level_log = saved
    return lv


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
