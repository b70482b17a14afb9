"""Sharded data parallelism (FSDP / ZeRO) chosen per planning unit (``decomp.fsdp``), run on
torch's FSDP2 (``runtime.fsdp``): a plan-level strategy on top of the native data-parallel plan.

Units. A planning unit is a block: the module path up to an element of a ``ModuleList`` /
``Sequential`` (``transformer.h.3``); parameters outside every block (embeddings, final norm,
head) form the root unit, which ``fully_shard(model)`` holds. A unit's parameters are read from
the layer graph (qualified names and shapes); its compute is the sum of its layers' priced
forward and backward (transitions into them included) under the native plan.

Choice. Each unit is data parallel or one of ``decomp.fsdp.candidates(world)`` (ZeRO-2, ZeRO-3 with
reshard; ZeRO-1 needs gradient accumulation, which a plan does not carry yet). Units are ranked by
their parameter bytes; the assignments tried are "the j largest at ZeRO-3, the next k at ZeRO-2,
the rest data parallel" for every j, k (a grid of at most ``MAX_TRIES``), each priced by
``decomp.fsdp.schedule`` (two streams, prefetch of one unit) and ``step_peak_bytes``. Prices are
stated against the native plan's own prediction: a sharded candidate's step is the native step
plus ``schedule(assignment) - schedule(all data parallel)``, its memory the native memory less the
units' data-parallel resident bytes plus the assignment's (so the all-data-parallel assignment
prices exactly as the native plan). An assignment over the memory limit takes activation
checkpointing on the fewest units that make it fit (``_Pricer.with_ac``: ``decomp.fsdp``'s
"Activation checkpointing", greedy by bytes saved per second added, each unit's forward run
again in backward). The fastest assignment that fits the memory limit is offered (without a
limit: the fastest, which never checkpoints; the chooser sets it against every other candidate).

ZeRO-1 (torch's ``ZeroRedundancyOptimizer`` over DDP, ``decomp.fsdp``) is plan-wide: every unit
and the root, over the native plan whose every unit's gradient group is the world. It is its own
candidate (``zero1``), listed with its price beside the per-unit assignment, so that the
chooser sets it against the others; its step is priced as above with ``zero1_step_s`` (the
optimizer on the largest partition, one broadcast per tensor) after backward.

Tensor parallelism + sharding (torchtitan's 2-D, ``tensor_layout``): on a (data, tensor) mesh of
``world / tp`` x ``tp`` ranks (the tensor axis innermost: inside a node), for every ``tp`` > 1
dividing the world and the ranks of a node, the layers DTensor's styles run on the user's untouched
module are pinned to Megatron's split and the rest to ``sample(world / tp)`` (each tensor group
computes them whole on its block of samples): an MLP pair -- a linear (+ elementwise) layer of
weight (F, E) whose output only a linear layer of weight (E, F) reads -- as ``filter(s, tp)`` then
``row_parallel(s, tp)`` (DTensor ``ColwiseParallel`` then ``RowwiseParallel``), and an attention
layer with four separate projections (q, k, v, out) as ``head(s, tp)`` (colwise q / k / v,
rowwise out). A fused q/k/v projection (one ``nn.Linear`` of 3E outputs, the shipped GPT's) is not
head-parallel on DTensor's styles (its contiguous shard is not a head block) and stays whole on the
tensor group; so do embeddings, norms and the head. The model is re-planned (``Offer.replan``)
with those pins, then priced by the same per-unit assignments as above with every unit's data axis
the mesh's ``dp = world / tp``: its parameters as one tensor rank holds them (``find_units``:
memory params / (tp dp)), sharding collectives on the data axis' link (ranks ``c_t, c_t + tp, ..``),
the tensor-parallel collectives inside the layers' own prices (intra-node). Offered when the
kinds allow a tensor kind (``head``, ``filter`` or ``row_parallel``; None: all).

Forcing ZeRO-1: ``kinds`` naming ``zero1`` (plan-level, like ``sharded``) offers the ZeRO-1
candidate alone, forced (the chooser takes it whatever it costs).

plan.json: when chosen, ``runtime`` is ``{"expected": "fsdp", ..., "sharded": {"axis": "dp",
"mesh": {"dp": P} or {"dp": P / tp, "tp": tp}, "tp_styles": {module: "colwise" | "rowwise"}, "units":
{path: decision or null}, "root": decision}}`` (a decision's ``ac``: the unit is checkpointed) (which units are sharded on which axis, and the
DTensor style of each tensor-parallel module), and the candidate is listed among every alternative.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from ...artifacts import PlanHooks
from ...cost.native import choose_runtime, native_choice
from ...cost.table import evaluate
from ...decomp.ir import BATCH_NORM
from ...decomp.fsdp import (DDP_ZERO, Sharded, TiedUnitsError, UnitComm, UnitParams, UnitTime, ac_order, candidates,
                            recompute_times, schedule, step_peak_bytes, unit_comm, unit_of, zero1_step_s)
from ...errors import AutoparError
from ...profile.optimizer import optimizer_step_s
from .registry import Candidate, memory_fit, register_strategy

NAME = "sharded"
MAX_TRIES = 400
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Units:
    """A table's units in execution order (the root first), their parameters, and per layer the
    index of its segment: consecutive layers of one unit (the root appears twice in a model whose
    head follows its blocks)."""
    names: tuple[str, ...]
    params: tuple[UnitParams, ...]
    segments: tuple[tuple[int, tuple[int, ...]], ...]   # (unit index, layer indices) in order
    groups: tuple[int, ...] = ()                        # per unit: its data axis (gradient group size)


def find_units(table, choice) -> Units:
    """The units of ``table`` under ``choice``: each parameter as rank 0 holds it under its
    layer's decision (``ParamShard.local_shape``; the whole parameter under data parallelism) and
    the size of its gradient group (the ranks holding the same shard: the unit's data axis)."""
    graph = table.graph
    world = table.ctx.world
    qual: dict[str, tuple[tuple[int, ...], int, int]] = {}
    order: list[str] = [""]
    layer_unit: list[str] = []
    last = ""
    for l, lay in enumerate(graph.layers):
        mods = [op.module for op in lay.ops if op.module]
        u = unit_of(mods[0]) if mods else (unit_of(lay.module) if lay.module else last)
        dec = table.layers[l].choices[choice[l]]
        for op in lay.ops:
            for role, q in op.param_names.items():
                if q in qual:
                    continue
                sh = dec.layer_param_shard(lay, op, role)
                shape = tuple(int(x) for x in sh.local_shape(op.params[role], 0, world))
                qual[q] = (shape, _ITEMSIZE.get(op.dtype, 4), len(sh.grad_group(0, world)))
        if u not in order:
            order.append(u)
        layer_unit.append(u)
        last = u
    by_unit: dict[str, list] = {u: [] for u in order}
    for q, v in qual.items():
        u = unit_of(q.rsplit(".", 1)[0]) if "." in q else ""
        by_unit[u if u in by_unit else ""].append(v)
    params = tuple(UnitParams(u or "<root>", tuple(s for s, _, _ in by_unit[u]),
                              max((i for _, i, _ in by_unit[u]), default=4)) for u in order)
    groups = tuple(min((g for _, _, g in by_unit[u]), default=1) for u in order)
    segs: list[tuple[int, list[int]]] = []
    for li in table.topo:
        k = order.index(layer_unit[li])
        if segs and segs[-1][0] == k:
            segs[-1][1].append(li)
        else:
            segs.append((k, [li]))
    return Units(tuple(order), params, tuple((k, tuple(ls)) for k, ls in segs), groups)


def _segment_times(table, choice, units: Units) -> list[UnitTime]:
    table.ensure_edges()
    fwd = [0.0] * len(table.layers)
    bwd = [0.0] * len(table.layers)
    for l, lo in enumerate(table.layers):
        c = lo.costs[choice[l]]
        fwd[l] += c.fwd_s
        bwd[l] += c.bwd_s
    for e in table.edges:
        fwd[e.dst] += e.fwd_s[choice[e.src]][choice[e.dst]]
        bwd[e.dst] += e.bwd_s[choice[e.src]][choice[e.dst]]
    return [UnitTime(sum(fwd[l] for l in ls), sum(bwd[l] for l in ls)) for _, ls in units.segments]


def _segment_inputs(table, choice, units: Units) -> list[float]:
    """I_i of each stretch (``decomp.fsdp``, "Activation checkpointing"): the per-rank bytes of the
    distinct values its layers read that layers outside it produce, each as the reading layer's
    decision places it (``in_placement``, largest block)."""
    graph = table.graph
    edges = graph.edges()
    out = []
    for _, ls in units.segments:
        inside = set(ls)
        seen: dict[str, float] = {}
        for u, v, value in edges:
            if v in inside and u not in inside and value not in seen:
                lay = graph.layers[v]
                dec = table.layers[v].choices[choice[v]]
                shape = dec.in_placement(lay, value).max_local_shape(graph.value_shape(value))
                n = 1
                for x in shape:
                    n *= int(x)
                seen[value] = float(n * lay.itemsize)
        out.append(sum(seen.values()))
    return out


@dataclass(frozen=True)
class Priced:
    assignment: tuple[Sharded | None, ...]      # per unit (units.names order), ``ac`` set where checkpointed
    step_time_s: float
    memory_bytes: float


class _Pricer:
    """Prices assignments for one table (module docstring)."""

    def __init__(self, table, choice, native_pred, tp: int = 1):
        ctx = table.ctx
        self.units = find_units(table, choice)
        self.world = ctx.world
        self.tp = tp
        # the data axis each unit's decisions shard over: its gradient group (tp = 1), else the
        # mesh's dp = world / tp for every unit (FSDP2 on the (dp, tp) mesh's data axis)
        self.axis = self.units.groups if tp == 1 else (ctx.world // tp,) * len(self.units.names)
        self.times = _segment_times(table, choice, self.units)
        self.seg_acts = [sum(table.layers[l].costs[choice[l]].activation_bytes for l in ls)
                         for _, ls in self.units.segments]
        self.seg_inputs = _segment_inputs(table, choice, self.units)
        self.seg_units = [k for k, _ in self.units.segments]
        prof = ctx.profile
        self.k = float(ctx.optimizer_state_per_param)
        # a unit's data axis: its gradient group, of g ranks; rank 0's group is ranks 0, w/g, ...
        # (the sample axis is outermost) unless g is the world; its link from CostContext.level
        self.levels = {g: ctx.level(range(0, ctx.world, ctx.world // g))
                       for g in set(self.units.groups) | set(self.axis) if g > 1}
        self.coll = lambda kind, p, n: prof.collective_time_s(kind, p, n, self.levels.get(p, "inter"))  # noqa: E731
        opt = lambda n, by: optimizer_step_s(prof, n, by) or 0.0  # noqa: E731
        self.opt = opt
        self.native = native_pred
        self.comm_cache: dict = {}
        dp = (None,) * len(self.units.names)
        self.dp_sched = self._schedule(dp)
        self.dp_mem = self._memory(dp)

    def _comm(self, u: int, s: Sharded | None) -> UnitComm:
        key = (u, s)
        if key not in self.comm_cache:
            self.comm_cache[key] = unit_comm(self.units.params[u], s, self.coll, self.opt,
                                             world_dp=self.units.groups[u])
        return self.comm_cache[key]

    def _schedule(self, a) -> float:
        fixed = 0.0
        z1 = [s for s in a if s is not None and s.engine == DDP_ZERO]
        if z1:
            fixed = zero1_step_s(self.units.params, z1[0].dp, self.coll, self.opt)
        comms, seen = [], set()
        for k, _ in self.units.segments:
            c = self._comm(k, dataclasses.replace(a[k], ac=False) if a[k] is not None and a[k].ac else a[k])
            if k in seen:     # the root's second segment (the head): its collectives already counted
                comms.append(UnitComm(0.0, 0, 0.0, 0.0))
            else:
                comms.append(c)
                seen.add(k)
        # a unit's gradient is complete when backward reaches its first segment: move the first
        # segment's collectives there (it is the one issued last in backward) -- already so
        times = recompute_times(self.times, a, self.seg_units) if any(s is not None and s.ac for s in a) else self.times
        return schedule(times, comms, fixed).step_time_s

    def _memory(self, a) -> float:
        """Parameters, gradients, optimizer state and activations at the step's peak
        (``step_peak_bytes``); the native prediction's other bytes are added by ``price``."""
        return step_peak_bytes(self.units.params, a, self.k, self.seg_units, self.seg_acts,
                               segment_inputs=self.seg_inputs).total_bytes

    def price(self, a) -> Priced:
        t = float(self.native.step_time_s) + self._schedule(a) - self.dp_sched
        m = float(self.native.memory_per_rank_bytes) - self.dp_mem + self._memory(a)
        return Priced(tuple(a), t, m)

    def with_ac(self, a, limit: float | None) -> Priced:
        """``a`` priced, with activation checkpointing on the fewest units that make it fit
        ``limit`` (``decomp.fsdp``, "Choosing": the shortest prefix of ``ac_order`` that fits,
        by bisection); ``a`` itself when it fits or no unit can take AC; AC on every unit that
        can when none fits (the least memory)."""
        p = self.price(a)
        if limit is None or p.memory_bytes <= limit:
            return p
        can = [u for u, s in enumerate(a) if u != 0 and s is not None and s.engine != DDP_ZERO]
        order = ac_order(can, self.seg_units, self.seg_acts, self.seg_inputs, self.times)
        if not order:
            return p

        def take(m: int) -> Priced:
            on = set(order[:m])
            return self.price(tuple(dataclasses.replace(s, ac=True) if u in on else s for u, s in enumerate(a)))
        lo, hi = 0, len(order)          # take(lo) does not fit; find the least m that does
        best = take(hi)
        if best.memory_bytes > limit:
            return best
        while hi - lo > 1:
            mid = (lo + hi) // 2
            q = take(mid)
            if q.memory_bytes <= limit:
                hi, best = mid, q
            else:
                lo = mid
        return best

    def zero1(self):
        """The plan-wide ZeRO-1 assignment, or None when a unit's gradient group is not the world
        (a plan that shards a parameter already: DDP runs the user's module replicated)."""
        if self.tp > 1 or any(g != self.world for g in self.units.groups) or self.world < 2:
            return None
        return (Sharded(1, False, self.world, engine=DDP_ZERO),) * len(self.units.names)

    def assignments(self):
        n = len(self.units.names)
        zs = [{s.level: s for s in candidates(g, self.tp)} if g > 1 else {} for g in self.axis]
        rank = sorted(range(n), key=lambda u: -self.units.params[u].whole_bytes())
        step = max(1, int((n + 1) ** 2 / MAX_TRIES) + 1) if (n + 1) ** 2 > MAX_TRIES else 1
        js = sorted(set(list(range(0, n + 1, step)) + [n]))
        for j in js:
            for k in sorted(set(list(range(0, n - j + 1, step)) + [n - j])):
                a: list = [None] * n
                for u in rank[:j]:
                    a[u] = zs[u].get(3)
                for u in rank[j:j + k]:
                    a[u] = zs[u].get(2)
                yield tuple(a)


def _batch_norm_problem(table) -> str | None:
    """FSDP2 runs the user's module on each rank's B/world samples: a training batch norm then
    normalises over exactly those samples. That is the plan's function only under local statistics
    with one group per rank (what DDP computes); any other semantics is refused, naming it."""
    bns = [(lay, op) for lay in table.graph.layers for op in lay.ops
           if op.kind == BATCH_NORM and op.attrs.get("training", True)]
    if not bns:
        return None
    ctx = table.ctx
    bn, world, batch = ctx.batch_norm, ctx.world, ctx.batch_size
    if bn is not None and bn.local and batch % world == 0 and bn.group == batch // world:
        return None
    lay = bns[0][0]
    return (f"batch norm {lay.module or lay.name} under {bn} statistics: FSDP2 computes each rank's "
            f"{batch // max(world, 1)} samples' statistics (--batch-norm local with the default group)")


def _fastest(pricer: "_Pricer", limit: float | None) -> Priced | None:
    """The fastest assignment that fits ``limit`` (none fitting: the one of least memory), each
    with activation checkpointing where it needs it to fit (``_Pricer.with_ac``); None when no
    unit can be sharded."""
    best = None
    for a in pricer.assignments():
        if all(s is None for s in a):
            continue
        p = pricer.with_ac(a, limit)
        fits = limit is None or p.memory_bytes <= limit
        key = (not fits, p.step_time_s if fits else p.memory_bytes)
        if best is None or key < best[0]:
            best = (key, p)
    return None if best is None else best[1]


def fitting_step_s(table, choice, req, memory_limit_bytes: float) -> float | None:
    """The step seconds of the sharded candidate this strategy would offer, legal and within
    ``memory_limit_bytes``, when the solver's plan is ``choice`` (a plan over the limit, so the
    state-sharding candidate over it is legal), or None when it offers none that fits.
    ``planner.solve`` asks it before the memory-limited ILP: when no plan that fits the limit can
    beat this (a lower bound, ``solve.elimination.limited_lower_bound_s``), that ILP is not run.
    A data-parallel plan over the native choice that fits displaces the one over ``choice``
    (``offer``), so its figure is the answer then."""
    if (table.ctx.world < 2 or req.constrained or _batch_norm_problem(table) is not None
            or tied_across_units(table.graph) is not None):
        return None
    kinds = req.options.kinds
    if kinds and (NAME not in kinds or ZERO1 in kinds):
        return None
    nat = native_choice(table)
    if nat is not None:
        _, nat_pred = choose_runtime(table, nat, evaluate, None)
        p = _fastest(_Pricer(table, tuple(nat), nat_pred), memory_limit_bytes)
        if p is not None and p.memory_bytes <= memory_limit_bytes:
            return p.step_time_s
        if tuple(nat) == tuple(choice):
            return None
    p = _fastest(_Pricer(table, tuple(choice), evaluate(table, list(choice))), memory_limit_bytes)
    return p.step_time_s if p is not None and p.memory_bytes <= memory_limit_bytes else None


def tied_across_units(graph) -> TiedUnitsError | None:
    """The first parameter shared by two units (tied weights, marked by the tracer in the
    op's ``tied`` roles) as the error the run time would raise (``runtime.fsdp.check_tied``),
    or None: FSDP2 cannot shard one tensor from two units, so the strategy offers nothing and
    says why, naming both (a tie inside one unit or the root, GPT's wte / head, is fine)."""
    for lay in graph.layers:
        for op in lay.ops:
            for role in op.attrs.get("tied", ()):
                q = op.param_names.get(role)
                if not q:
                    continue
                owner = unit_of(q.rsplit(".", 1)[0]) if "." in q else ""
                mod = op.module or lay.module or ""
                user = unit_of(mod)
                if user != owner:
                    return TiedUnitsError.naming(q, owner, f"{mod}.{role}" if mod else role, user)
    return None


TENSOR_KINDS = ("head", "filter", "row_parallel")
ZERO1 = "zero1"


@dataclass(frozen=True)
class TensorLayout:
    """The tensor-parallel half of a TP + sharding plan (module docstring): ``pins`` (CLI form,
    the last winning) that pin Megatron's split where DTensor's styles run it and
    ``sample(world / tp)`` elsewhere, and ``styles``: module path -> DTensor style."""
    tp: int
    pins: tuple[str, ...]
    styles: tuple[tuple[str, str], ...]


def tensor_layout(graph, world: int, tp: int) -> TensorLayout | str:
    """The layout of ``graph`` on a (world / tp, tp) mesh, or why there is none (module
    docstring): MLP pairs (weights (F, E) then (E, F), the first layer's output read by the
    second alone) and attention layers of four separate projections."""
    s = world // tp
    prod = graph.producer()
    readers: dict[int, set[int]] = {}
    for lay in graph.layers:
        for v in lay.inputs:
            if v in prod:
                readers.setdefault(prod[v], set()).add(lay.index)
    out_v = graph.output

    def linear(lay, kinds):
        lin = [op for op in lay.ops if op.kind == "linear"]
        if len(lin) != 1 or not {op.kind for op in lay.ops} <= kinds or not lin[0].module:
            return None
        w = lin[0].params.get("weight")
        return (lin[0], tuple(int(x) for x in w)) if w is not None and len(w) == 2 else None
    pins, styles, fused = [f"*=sample({s})"], [], []
    for lay in graph.layers:
        mods = [op.module for op in lay.ops if op.module]
        if not mods or not unit_of(mods[0]):
            continue                               # the root's layers: whole on the tensor group
        if any(op.kind == "attention" for op in lay.ops):
            lin = [op for op in lay.ops if op.kind == "linear"]
            if len(lin) == 4 and len({op.module for op in lin}) == 4:
                pins.append(f"{lay.name}=head({s},{tp})")
                styles += [(op.module, "colwise") for op in lin[:3]] + [(lin[3].module, "rowwise")]
            else:
                fused.append(lay.module or lay.name)
            continue
        a = linear(lay, {"linear", "unary"})
        if a is None or out_v in (op.name for op in lay.ops):
            continue
        rd = readers.get(lay.index, set())
        if len(rd) != 1:
            continue
        nxt = graph.layers[next(iter(rd))]
        b = linear(nxt, {"linear"})
        if b is None:
            continue
        (op_a, (f_out, e_in)), (op_b, (e_out, f_in)) = a, b
        if f_out != f_in or e_in != e_out or f_out % tp:
            continue
        pins += [f"{lay.name}=filter({s},{tp})", f"{nxt.name}=row_parallel({s},{tp})"]
        styles += [(op_a.module, "colwise"), (op_b.module, "rowwise")]
    if not styles:
        why = "no layer DTensor's styles run tensor-parallel on the user's module"
        if fused:
            why += f" (attention {fused[0]} projects q/k/v fused: its contiguous shard is not a head block)"
        return why
    return TensorLayout(tp, tuple(pins), tuple(styles))


def describe(names, a) -> str:
    if a and all(s is not None and s.engine == DDP_ZERO for s in a):
        return f"all {len(a)} units ZeRO-1 (DDP + ZeroRedundancyOptimizer over dp{a[0].dp})"
    n3 = sum(1 for s in a if s is not None and s.level == 3)
    n2 = sum(1 for s in a if s is not None and s.level == 2)
    nac = sum(1 for s in a if s is not None and s.ac)
    tp = max((s.tp for s in a if s is not None), default=1)
    mesh = f" on (dp {a[0].dp if a[0] else '?'} x tp {tp})" if tp > 1 else ""
    ac = f", activation checkpointing on {nac}" if nac else ""
    return f"{n3} unit(s) ZeRO-3, {n2} ZeRO-2, {len(a) - n3 - n2} data parallel of {len(a)}{mesh}{ac}"


@register_strategy
class ShardedDataParallel:
    name = NAME
    priority = 2
    kinds = {NAME: "sharded data parallelism (FSDP2 ZeRO-2/3 per unit, ZeRO-1, TP + sharding) among the "
                   "candidates (a --kinds list without it leaves it out)",
             ZERO1: "ZeRO-1 (DDP + ZeroRedundancyOptimizer) alone, forced"}

    def offer(self, base):
        table = base.table
        label = "sharded data parallel (FSDP2)"
        if table.ctx.world < 2:
            return (Candidate(NAME, label, illegal="one rank: nothing to shard", priority=self.priority),)
        kinds = base.req.options.kinds
        if kinds and NAME not in kinds and ZERO1 not in kinds:
            return (Candidate(NAME, label, priority=self.priority,
                              illegal=f"--kinds {','.join(kinds)} leaves out {NAME}"),)
        if base.req.constrained:
            return (Candidate(NAME, label, priority=self.priority,
                              illegal="layers pinned or filtered: the ILP's plan is kept"),)
        why_bn = _batch_norm_problem(table)
        if why_bn is not None:
            return (Candidate(NAME, label, priority=self.priority, illegal=why_bn),)
        tied = tied_across_units(table.graph)
        if tied is not None:
            return (Candidate(NAME, label, priority=self.priority, illegal=f"{type(tied).__name__}: {tied}"),)
        out = []
        nat = native_choice(table)
        if kinds and ZERO1 in kinds:          # ZeRO-1 asked for: offered alone, forced
            if nat is None:
                return (Candidate(NAME, "ZeRO-1", priority=self.priority, forced=True,
                                  illegal="--kinds zero1: no native data-parallel plan to run ZeRO-1 over"),)
            _, nat_pred = choose_runtime(table, nat, evaluate, None)
            return (dataclasses.replace(self._zero1(base, tuple(nat), nat_pred), forced=True),)
        if nat is not None:
            _, nat_pred = choose_runtime(table, nat, evaluate, None)
            out.append(self._best(base, tuple(nat), nat_pred, "fsdp", f"{label} over the native data-parallel plan"))
            out.append(self._zero1(base, tuple(nat), nat_pred))
        out.extend(self._tensor(base))
        sol = tuple(base.solution.choice)
        if nat is None or sol != tuple(nat):
            # sharding the state the ILP's plan replicates (each parameter over its gradient group);
            # priced, not yet executable: FSDP2 runs the user's module, the op-by-op runtime has no
            # sharded state (``execute`` refuses it, naming why). Offered only where no executable
            # candidate fits the memory limit, so that a plan that runs is never displaced by it.
            c = self._best(base, sol, base.prediction, "fsdp+traced",
                           "sharded state over the ILP's plan (priced; not executable yet)")
            runnable = [x for x in out if x.illegal is None and memory_fit(x.prediction, base.memory_limit_bytes) is None]
            if memory_fit(base.prediction, base.memory_limit_bytes) is None or runnable:
                c = dataclasses.replace(c, illegal="not executable yet; offered only when no executable plan fits "
                                                   "the memory limit")
            out.append(c)
        return tuple(c for c in out if c is not None)

    def _tensor(self, base) -> list:
        """TP + sharding candidates, one per tensor axis (module docstring)."""
        o = base.req.options
        table = base.table
        world, rpn = table.ctx.world, int(base.loaded.ranks_per_node)
        if base.replan is None or (o.kinds and not set(TENSOR_KINDS) & set(o.kinds)):
            return []
        out = []
        for tp in [t for t in range(2, min(world, rpn) + 1) if world % t == 0 and world // t > 1]:
            label = f"tensor parallel x sharded (DTensor tp {tp} + FSDP2 dp {world // tp})"
            lay = tensor_layout(base.graph, world, tp)
            if isinstance(lay, str):
                out.append(Candidate(NAME, label, illegal=lay, priority=self.priority))
                continue
            sub = dataclasses.replace(o, kinds=("sample", "replicate") + TENSOR_KINDS, pins=lay.pins, write=False,
                                      out_dir=None, pipeline="off", microbatches=None, schedule=None,
                                      stage_data=None, memory_limit_bytes=None)
            try:
                res = base.replan(base.loaded.model_file, sub, PlanHooks(profile=base.loaded.profile, graph=base.graph))
            except AutoparError as e:
                out.append(Candidate(NAME, label, illegal=f"{type(e).__name__}: {e}", priority=self.priority))
                continue
            choice = tuple(res.solution.choice)
            names = {lay_.name: lay_.index for lay_ in res.table.graph.layers}
            off = [pin for pin in lay.pins[1:] if str(res.table.layers[names[pin.split("=")[0]]].choices[
                choice[names[pin.split("=")[0]]]]) != pin.split("=", 1)[1]]
            if off:
                out.append(Candidate(NAME, label, illegal=f"the re-plan did not keep pin {off[0]}", priority=self.priority))
                continue
            pred = evaluate(res.table, list(choice))
            pricer = _Pricer(res.table, choice, pred, tp=tp)
            p = _fastest(pricer, base.memory_limit_bytes)
            if p is None:
                out.append(Candidate(NAME, label, illegal="no unit has parameters to shard", priority=self.priority))
                continue
            c = self._candidate(dataclasses.replace(base, table=res.table), choice, pred, "fsdp", label, pricer, p)
            out.append(dataclasses.replace(c, detail=(pricer.units, p, lay)))
        return out

    def _zero1(self, base, choice, pred):
        label = "ZeRO-1 (DDP + ZeroRedundancyOptimizer) over the native data-parallel plan"
        pricer = _Pricer(base.table, choice, pred)
        a = pricer.zero1()
        if a is None:
            return Candidate(NAME, label, priority=self.priority,
                             illegal="a unit's parameters are sharded already (ZeRO-1 runs the module replicated)")
        return self._candidate(base, choice, pred, "fsdp", label, pricer, pricer.price(a))

    def _candidate(self, base, choice, pred, runtime, label, pricer, p):
        what = describe(pricer.units.names, p.assignment)
        return Candidate(NAME, f"{label}: {what}",
                         dataclasses.replace(pred, step_time_s=p.step_time_s, memory_per_rank_bytes=p.memory_bytes),
                         table=base.table, choice=tuple(choice), runtime=runtime,
                         priority=self.priority + (0 if runtime == "fsdp" else 1), detail=(pricer.units, p),
                         note=f"sharded data parallelism chosen: {what}")

    def _best(self, base, choice, pred, runtime: str, label: str):
        pricer = _Pricer(base.table, choice, pred)
        p = _fastest(pricer, base.memory_limit_bytes)
        if p is None:
            return Candidate(NAME, label, illegal="no unit has parameters on more than one rank",
                             priority=self.priority)
        return self._candidate(base, choice, pred, runtime, label, pricer, p)

    def record(self, base, choice) -> dict:
        c = choice.chosen
        if c.strategy != NAME:
            return {}
        units, p = c.detail[:2]
        lay = c.detail[2] if len(c.detail) > 2 else None
        world = base.table.ctx.world
        root = p.assignment[0]
        engines = {s.engine for s in p.assignment if s is not None}
        mesh = {"dp": world} if lay is None else {"dp": world // lay.tp, "tp": lay.tp}
        sharded = {"axis": "dp", "mesh": mesh, "base": "native" if c.runtime == "fsdp" else "ilp",
                   "tp_styles": dict(lay.styles) if lay is not None else {},
                   "engine": DDP_ZERO if engines == {DDP_ZERO} else "fsdp2",
                   "units": {n: (s.to_json() if s is not None else None)
                             for n, s in zip(units.names[1:], p.assignment[1:])},
                   "root": root.to_json() if root is not None else None}
        why = memory_fit(c.prediction, base.memory_limit_bytes)
        return {"runtime": {"expected": c.runtime, "step_time_s": c.step_time_s,
                            "reason": f"{c.label}" + ("" if why is None else f" ({why})"),
                            "sharded": sharded}}
