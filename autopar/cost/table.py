"""The cost table: every legal decomposition of every layer, priced, and every transition.

``build_cost_table(graph, ctx)`` asks each registered decomposition for its candidates on each
layer, keeps the legal ones (recording why the others are illegal, for explanations), prices
them, and prunes each layer to ``ctx.max_candidates`` (``_pareto``: the widest sample split and
replicate first, so that the pure data-parallel plan stays representable, then the Pareto
front in (time, memory), then the cheapest in time). Edges get the transition price between
the producer's output layout and the consumer's input layout for every pair of choices.

Pricing is done once per distinct layer (``layer_signature``: the layer with its value and
parameter names replaced by positions; ResNet-50's 73 layers have 23 distinct ones) and once
per distinct pair of layouts on an edge (``_edge_prices``: the producer's output layouts and
the consumer's input layouts computed once per choice, each distinct (src, dst, shape) priced
once per table); repeated layers copy their representative's choices and prices and check
only its illegal candidates again, so that the reasons name their own module.

Under the placement search (``ctx.cost_memo``) a distinct layer's options are kept with the
link level of every group its pricing asked about, and a placement that changes none of them
gets them back without walking the candidates (``_layer_options_once``); transitions are
priced only for the tables the search solves (``CostTable.ensure_edges``); the profile's
kernel and collective models answer each distinct question once (``pricing_profile``).

``evaluate(table, choice)`` computes a plan's step time exactly as the ILP models it (the
recurrence is written there); the solver tests compare the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..decomp import REGISTRY
from ..decomp.base import CostContext, Decomposition, LayerCost, memo_lookup, record_levels
from ..decomp.buckets import layer_buckets
from ..decomp.ir import Layer, LayerGraphData, PARAMETRIC, batch_free_layers
from ..decomp.transition import EXACT_WORLD, transition_s
from ..profile.optimizer import optimizer_fixed_s, optimizer_step_s
from .primitives import (StragglerCharge, _samples, comm_interference, grad_reducer_fixed_s, grad_reducer_s,
                         straggler_charge, unsynced_compute_s)
from ..decomp.sharding import loss_sharding_for
from ..errors import IllegalDecomposition


@dataclass
class LayerOptions:
    """A layer's kept choices and their prices; ``illegal`` (str(decomposition) -> reason)
    says why the other candidates cannot run. A repeated layer's reasons are checked again
    under its own name only when read (``_copy_options``): most tables of the placement
    search are only bounded, never shown."""
    layer: Layer
    choices: list[Decomposition]
    costs: list[LayerCost]
    illegal_reasons: dict[str, str] | None = field(default_factory=dict)
    exact_keys: list[list[str]] = field(default_factory=list)  # per choice: exact entries used (read-only: copies of a layer share them)
    illegal_choices: list[Decomposition] = field(default_factory=list, repr=False)
    _check_ctx: Any = field(default=None, repr=False, compare=False)   # reasons still to check

    @property
    def illegal(self) -> dict[str, str]:
        if self.illegal_reasons is None:
            ctx, self._check_ctx = self._check_ctx, None
            self.illegal_reasons = {str(d): d.check(self.layer, ctx) or "illegal"
                                    for d in self.illegal_choices}
        return self.illegal_reasons

    @illegal.setter
    def illegal(self, value: dict[str, str]) -> None:
        self.illegal_reasons, self._check_ctx = value, None

    @property
    def has_params(self) -> bool:
        return any(op.kind in PARAMETRIC and op.params for op in self.layer.ops)


@dataclass
class EdgeOptions:
    src: int
    dst: int
    value: str
    fwd_s: list[list[float]]     # [i][j]: producer choice i, consumer choice j
    bwd_s: list[list[float]]


@dataclass
class CostTable:
    """``edges`` is None while not priced yet (``build_cost_table(..., edges=False)``: the
    placement search bounds most placements from their layer prices alone);
    ``ensure_edges()`` prices them, and the solver and ``evaluate`` call it."""
    graph: LayerGraphData
    ctx: CostContext
    layers: list[LayerOptions]
    edges: list[EdgeOptions] | None
    topo: list[int]              # layer indices in execution order
    buckets: dict[int, int] | None = None   # layer -> gradient bucket (runtime.gradsync.layer_buckets)
    straggle: StragglerCharge | None = None  # the straggler wait in the prices (price_stragglers)

    def ensure_edges(self) -> "CostTable":
        """Price the transitions if ``build_cost_table`` left them out; returns self."""
        if self.edges is None:
            self.edges = _edge_waits(_build_edges(self.graph, self.ctx, self.layers), self.layers, self.straggle)
        return self

    def bucket_of(self) -> dict[int, int]:
        """Gradient buckets as the runtime forms them; without any, one bucket per layer."""
        if self.buckets is not None:
            return self.buckets
        return {l: k for k, l in enumerate(reversed(self.topo))}

    def size(self) -> dict[str, int]:
        self.ensure_edges()
        return {"layers": len(self.layers), "edges": len(self.edges),
                "choices": sum(len(o.choices) for o in self.layers),
                "pairs": sum(len(e.fwd_s) * len(e.fwd_s[0]) for e in self.edges if e.fwd_s)}


def pricing_profile(profile):
    """A shallow copy of ``profile`` whose ``kernel_time_s`` and ``collective_time_s`` answer
    each distinct question once (pricing asks the same kernel of one local shape, and the
    same collective of one size, group and link level, for many candidates, layers and
    placements); the answers are the profile's own."""
    import copy
    if getattr(profile, "_pricing_memo", False) or not hasattr(profile, "collective_time_s"):
        return profile
    prof = copy.copy(profile)
    kernel, collective = profile.kernel_time_s, profile.collective_time_s
    k_memo: dict = {}
    c_memo: dict = {}

    def kernel_time_s(op_class, flops, bytes_moved, spec=None):
        try:
            key = (op_class, flops, bytes_moved,
                   None if spec is None else tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                          for k, v in spec.items())))
            t = k_memo.get(key)
        except TypeError:          # a spec value that does not hash: no memo
            return kernel(op_class, flops, bytes_moved, spec=spec)
        if t is None:
            t = k_memo[key] = kernel(op_class, flops, bytes_moved, spec=spec)
        return t

    def collective_time_s(kind, group_size, nbytes, level="intra"):
        key = (kind, group_size, nbytes, level)
        t = c_memo.get(key)
        if t is None:
            t = c_memo[key] = collective(kind, group_size, nbytes, level)
        return t

    prof.kernel_time_s, prof.collective_time_s = kernel_time_s, collective_time_s
    prof._pricing_memo = True
    prof._collective_impl = collective     # what answers behind the memo (solve.placement reads it)
    return prof


def layer_optimizer_step_s(cost: LayerCost, ctx: CostContext, n_tensors: int = 1) -> float:
    """SGD-with-momentum update of the layer's ``n_tensors`` local parameter tensors: measured
    per tensor and per byte when the profile has ``optimizer_step`` (``profile.optimizer``),
    else ~4 flops and ~5 words per element of the elementwise kernel fit."""
    if cost.param_bytes <= 0:
        return 0.0
    t = optimizer_step_s(ctx.profile, n_tensors, cost.param_bytes)
    if t is None:
        n = cost.param_bytes / 4.0
        t = ctx.profile.kernel_time_s("elementwise", 4.0 * n, 5.0 * cost.param_bytes)
    return t * _optimizer_scale(ctx)


def _optimizer_scale(ctx: CostContext) -> float:
    """What a measured optimizer time is multiplied by: the slowdown of the ranks sharing the
    node and the machine's speed factor (``profile.history``)."""
    return ctx.profile.slowdown(ctx.ranks_on_node) * getattr(ctx, "speed_factor", 1.0)


def _charge_first_layer(opts: list[LayerOptions], topo: list[int] | None, **seconds: float) -> list[LayerOptions]:
    """``opts`` with ``seconds`` (``LayerCost`` field -> seconds) added to every choice of the
    first layer in execution order (``topo``, else the options' order): where a once-a-step
    cost goes so that the ILP, the dynamic program's bounds and ``evaluate`` all count it. A
    new option object for that layer, the others shared."""
    first = (topo or [o.layer.index for o in opts])[0]
    out = list(opts)
    o = out[first]
    out[first] = replace(o, costs=[replace(c, **{f: getattr(c, f) + s for f, s in seconds.items()})
                                   for c in o.costs])
    return out


def _pareto(choices: list[Decomposition], costs: list[LayerCost], cap: int):
    """Keep every choice whose class says ``always_kept`` (sample and replicate: so the data-parallel plan space is inside the
    all-kinds one, whose optimum can then never be worse: at 1024 ranks keeping only some
    sample splits lost ResNet-50 mixes, 27.9 ms against 23.6 ms sample-only), and of the others
    up to ``cap - 2``: the Pareto front in (time, memory), then the next cheapest in time."""
    def t(c: LayerCost) -> float:
        return c.fwd_s + c.bwd_s + c.grad_sync_s
    base = [i for i in range(len(choices)) if type(choices[i]).always_kept]
    n_kept_kinds = sum(1 for cls in REGISTRY.values() if cls.always_kept)
    order = sorted(range(len(choices)), key=lambda i: (t(costs[i]), costs[i].memory_bytes))
    front: list[int] = []          # the Pareto front over all choices, less the kept kinds
    best_mem = math.inf
    for i in order:
        if costs[i].memory_bytes < best_mem - 1e-9:
            best_mem = costs[i].memory_bytes
            if i not in base:
                front.append(i)
    others = (front + [i for i in order if i not in base and i not in front])[:max(cap - n_kept_kinds, 2)]
    keep = base + others
    return [choices[i] for i in keep], [costs[i] for i in keep]


def tied_reason(dec: Decomposition, layer: Layer) -> str:
    """Why ``dec`` is illegal for a layer using a tied parameter (``attrs["tied"]``, marked by
    the tracer: several layers use it); "" when it is not. A tied parameter may be split: the
    runtime holds ONE shard of it per rank, used by every layer and its gradient the sum of
    their uses, so every layer must choose the SAME shard of it. Across layers the ILP enforces
    that (``tied_choice_sets``, ``solve.ilp._add_tied``); within one layer, two uses of the
    parameter that ``dec`` would shard differently make ``dec`` illegal here."""
    seen: dict[str, object] = {}
    for op in layer.ops:
        for role in op.attrs.get("tied", ()):
            q = op.param_names[role]
            sh = dec.layer_param_shard(layer, op, role)
            if seen.setdefault(q, sh) != sh:
                return f"parameter {q} is tied and {dec} would shard its uses in this layer differently"
    return ""


def tied_choice_sets(table: "CostTable") -> list[tuple[str, list[dict[int, list[int]]]]]:
    """For every tied parameter used by several layers of ``table``: (its name, one dict per
    way of holding it, ``ParamShard`` value, whole included, that any kept choice uses:
    {table layer position: the choices of that layer that hold it so}). A plan must pick, in
    every layer using the parameter, a choice of the same dict (``solve.ilp._add_tied``).
    Shards are compared as values, as ``runtime.model.param_shards`` does: two choices that
    cut the same blocks on differently spelled meshes count as different (conservative)."""
    uses: dict[str, dict[int, dict[object, list[int]]]] = {}
    for l, o in enumerate(table.layers):
        for op in o.layer.ops:
            for role in op.attrs.get("tied", ()):
                q = op.param_names[role]
                per = uses.setdefault(q, {}).setdefault(l, {})
                if per:
                    continue                     # one use per layer (tied_reason: all equal)
                for i, d in enumerate(o.choices):
                    per.setdefault(d.layer_param_shard(o.layer, op, role), []).append(i)
    out = []
    for q, by_layer in uses.items():
        if len(by_layer) < 2:
            continue
        shards: list[object] = []
        for per in by_layer.values():
            shards.extend(sh for sh in per if sh not in shards)
        out.append((q, [{l: per.get(sh, []) for l, per in by_layer.items()} for sh in shards]))
    return out


def layer_options(layer: Layer, ctx: CostContext, kinds: list[str] | None = None,
                  prune: bool = True, choice_filter=None) -> LayerOptions:
    choices: list[Decomposition] = []
    costs: list[LayerCost] = []
    keys: list[list[str]] = []
    illegal: dict[str, str] = {}
    illegal_decs: list[Decomposition] = []
    n_params = layer_param_tensors(layer)
    for kind, cls in REGISTRY.items():
        if kinds is not None and kind not in kinds:
            continue
        for dec in cls.candidates(layer, ctx):
            if choice_filter is not None and not choice_filter(dec):
                continue
            why = dec.check(layer, ctx) or tied_reason(dec, layer)
            if why:
                illegal[str(dec)] = why
                illegal_decs.append(dec)
                continue
            saved, ctx.key_log = ctx.key_log, []
            try:
                c = dec.cost(layer, ctx)
                used = sorted(set(ctx.key_log))
            finally:
                ctx.key_log = saved
            choices.append(dec)
            costs.append(c)
            keys.append(used)
    if prune and len(choices) > ctx.max_candidates:
        kept_choices, costs = _pareto(choices, costs, ctx.max_candidates)
        keys = [keys[choices.index(d)] for d in kept_choices]
        choices = kept_choices
    # the optimizer step last, for the kept choices only (``_pareto`` does not read it); one
    # price per local parameter size
    opt_s: dict[float, float] = {}
    for k, c in enumerate(costs):
        t = opt_s.get(c.param_bytes)
        if t is None:
            t = opt_s[c.param_bytes] = layer_optimizer_step_s(c, ctx, n_params)
        costs[k] = replace(c, optim_step_s=t)
    return LayerOptions(layer, choices, costs, illegal, keys, illegal_decs)


def layer_signature(layer: Layer) -> str:
    """What pricing reads of a layer, with names replaced by positions: value names by
    ("in", k) / ("op", k), parameter and buffer names by their op and role. Layers with equal
    signatures have equal candidates and prices (``build_cost_table`` prices one of them)."""
    import json
    names: dict[str, Any] = {v: ["in", k] for k, v in enumerate(layer.inputs)}
    for k, op in enumerate(layer.ops):
        names[op.name] = ["op", k]
        for role, q in op.param_names.items():
            names.setdefault(q, ["p", k, role])
        for role, q in op.buffers.items():
            names.setdefault(q, ["b", k, role])

    def canon(v):
        if isinstance(v, str):
            return names.get(v, v)
        if isinstance(v, dict):
            return {k: canon(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [canon(x) for x in v]
        return v

    ops = [[op.kind, op.target, canon(op.args), canon(op.kwargs), op.out_shape, op.dtype,
            canon(op.inputs), op.in_shapes, sorted(op.params.items()), sorted(op.buffers),
            canon(op.attrs), op.module_type, op.flops_fwd, op.flops_bwd] for op in layer.ops]
    return json.dumps([ops, canon(layer.inputs), canon(layer.output), canon(layer.side_outputs)],
                      sort_keys=True, default=str)


def _copy_options(rep: LayerOptions, layer: Layer, ctx: CostContext) -> LayerOptions:
    """``rep``'s choices and prices for an equal ``layer``; its illegal candidates are checked
    again, when first read (``LayerOptions.illegal``), so that the reasons name ``layer``."""
    return LayerOptions(layer, list(rep.choices), list(rep.costs), None if rep.illegal_choices else {},
                        list(rep.exact_keys), list(rep.illegal_choices),
                        ctx if rep.illegal_choices else None)


def _edge_prices(src: tuple, dst: tuple, shape, item: int, ctx: CostContext,
                 pair_cache: dict, local: dict) -> tuple[list[list[float]], list[list[float]]]:
    """(fwd, bwd) matrices of an edge: each distinct layout pair priced once per table
    (``local``), or once per search (``pair_cache``, placement-independent pairs)."""
    shape = tuple(int(n) for n in shape)
    fwd, bwd = [], []
    for s in src:
        rf, rb = [], []
        for d in dst:
            key = (s, d, shape, item)
            fb = pair_cache.get(key) or local.get(key)
            if fb is None:
                fb = transition_s(s, d, shape, item, ctx)
                if not s.is_partial and not d.is_partial:   # placement-independent (build_cost_table)
                    pair_cache[key] = fb
                else:
                    local[key] = fb
            rf.append(fb[0])
            rb.append(fb[1])
        fwd.append(rf)
        bwd.append(rb)
    return fwd, bwd


def build_cost_table(graph: LayerGraphData, ctx: CostContext, kinds: list[str] | None = None,
                     prune: bool = True, choice_filter=None, edges: bool = True) -> CostTable:
    """``kinds`` restricts the decomposition kinds (layers no input reaches keep ``replicate``);
    ``choice_filter(dec) -> bool`` drops
    individual candidates (e.g. spatial splits with a sample factor, for a spatial-only plan).
    ``edges=False`` leaves the transitions to ``CostTable.ensure_edges`` (the placement search
    prices them only for the placements it solves)."""
    opts = []
    by_sig: dict[str, LayerOptions] = {}
    memo = ctx.cost_memo   # the placement search's (decomp.base.price_once), shared by its tables
    # layers no input reaches (position ids, their embedding, masks) are computed whole under
    # every plan: ``replicate`` stays open to them whatever ``kinds`` says (``--kinds sample``
    # of a GPT is then its data-parallel plan)
    free = batch_free_layers(graph) if kinds is not None and "replicate" not in kinds else frozenset()
    for lay in graph.layers:
        if memo is not None:
            sig = memo.get(("signature", id(lay)))
            if sig is None:
                sig = memo[("signature", id(lay))] = layer_signature(lay)
        else:
            sig = layer_signature(lay)
        lkinds = kinds
        if lay.index in free:
            lkinds, sig = list(kinds) + ["replicate"], sig + "|batch-free"
        rep = by_sig.get(sig)
        if rep is None:
            if memo is not None:
                rep = _layer_options_once(memo, sig, lay, ctx, lkinds, prune, choice_filter)
            else:
                rep = layer_options(lay, ctx, lkinds, prune, choice_filter)
            by_sig[sig] = rep
            opts.append(rep)
        else:
            opts.append(_copy_options(rep, lay, ctx))
    for o in opts:
        if not o.choices:
            reasons = "; ".join(f"{k}: {v}" for k, v in list(o.illegal.items())[:4])
            raise IllegalDecomposition(
                f"layer {o.layer.index} ({o.layer.module or o.layer.name}) has no legal decomposition"
                f" among {kinds or sorted(REGISTRY)} ({reasons})",
                "allow more decomposition kinds, or change the world size or batch size")
    opts = _count_tied_once(opts, ctx)
    opts = _price_loss_move(graph, ctx, opts)
    opts = price_comm_interference(ctx, opts)
    opts = price_grad_reducer(ctx, opts)
    opts = price_optimizer_fixed(ctx, opts)
    opts, charge = price_stragglers(graph, ctx, opts)
    buckets = layer_buckets([(lay.index, lay.param_numel * lay.itemsize) for lay in graph.layers])
    table = CostTable(graph, ctx, opts, None, topo=[lay.index for lay in graph.layers], buckets=buckets,
                      straggle=charge)
    return table.ensure_edges() if edges else table


def _price_loss_move(graph: LayerGraphData, ctx: CostContext, opts: list[LayerOptions]) -> list[LayerOptions]:
    """The move of the model's output into the loss layout, priced in the producing layer's
    choices: the runtime computes the loss where the output splits only samples
    (``decomp.sharding.loss_sharding_for``), so an output split otherwise (``filter`` on a language
    model's head: the M x V logits split by vocabulary) is first redistributed, forward and
    backward, like any transition (``transition_s``). A choice that computes the loss in place
    (``loss_in_place``: ``vocab_head``) prices its own loss. New option objects: the priced
    ones may be shared with repeated layers and other placements."""
    prod = graph.producer()
    li = prod.get(graph.output)
    if li is None:
        return opts
    o = opts[li]
    lay = graph.layers[li]
    shape = tuple(int(n) for n in graph.value_shape(graph.output))
    if not shape:
        return opts
    costs, changed = [], False
    for d, c in zip(o.choices, o.costs):
        if getattr(d, "loss_in_place", False):
            costs.append(c)
            continue
        src = d.out_placement(lay, graph.output)
        dst = loss_sharding_for(src, shape[0], ctx.world)
        if src == dst:
            costs.append(c)
            continue
        f, b = transition_s(src, dst, shape, lay.itemsize, ctx)
        costs.append(replace(c, fwd_comm_s=c.fwd_comm_s + f, bwd_comm_s=c.bwd_comm_s + b))
        changed = True
    if not changed:
        return opts
    out = list(opts)
    out[li] = replace(o, costs=costs)
    return out


def price_comm_interference(ctx: CostContext, opts: list[LayerOptions]) -> list[LayerOptions]:
    """A gradient all-reduce runs behind backward (``evaluate``'s overlap chain), but where the
    ranks and the collective's threads share cores (gloo on a CPU node) it takes compute from
    them: each choice that synchronises gradients adds ``phi`` times its all-reduce's transfer
    time (``grad_sync_s`` less its latency terms, which wait rather than compute) to its
    backward compute, phi the share compute does not hide (``cost.primitives.
    comm_interference``, measured in situ; 0 where not measured, and nothing changes). Every
    solver and ``evaluate`` read the same layer costs. Case: on the 2-core VM, 2 ranks, phi
    about 0.5-1; the data-parallel ResNet-2D at world 2 measured 19.5 ms against 17.7 ms
    predicted with its 8.2 ms of gradient all-reduce fully hidden. New option objects."""
    phi = comm_interference(ctx.profile, ctx.ranks_on_node)
    if phi <= 0.0:
        return opts
    out = []
    for o in opts:
        costs = [replace(c, bwd_compute_s=c.bwd_compute_s + phi * max(0.0, grad_sync_transfer_s(c)))
                 if c.grad_sync_s > 0 else c for c in o.costs]
        out.append(replace(o, costs=costs))
    return out


def layer_param_tensors(layer: Layer) -> int:
    """Parameter tensors of ``layer`` (one gradient each, one reducer hook each)."""
    return sum(len(op.params) for op in layer.ops)


def price_grad_reducer(ctx: CostContext, opts: list[LayerOptions],
                       topo: list[int] | None = None) -> list[LayerOptions]:
    """Each choice that all-reduces gradients adds the reducer's work for its layer's tensors
    and gradient bytes to its backward compute (``cost.primitives.grad_reducer_s``: the hooks
    fire and the copies into the buckets run as backward produces them, delaying the bucket's
    all-reduce), and every choice of the first layer in execution order the step's fixed share
    in forward (``grad_reducer_fixed_s``: one per step, paid by every plan with more than one
    rank, as ``price_stragglers`` charges its closing wait), so that the ILP, the dynamic
    program's bounds and ``evaluate`` all count it. Nothing changes for a profile that did not
    measure the reducer, or at world 1. New option objects."""
    if ctx.world < 2 or not opts or not _samples(ctx.profile).get("grad_reducer"):
        return opts
    out = []
    for o in opts:
        n = layer_param_tensors(o.layer)
        out.append(replace(o, costs=[replace(c, bwd_compute_s=c.bwd_compute_s + grad_reducer_s(ctx, n, c.grad_sync_bytes))
                                     if c.grad_sync_s > 0 else c for c in o.costs]))
    return _charge_first_layer(out, topo, fwd_compute_s=grad_reducer_fixed_s(ctx))


def price_optimizer_fixed(ctx: CostContext, opts: list[LayerOptions],
                          topo: list[int] | None = None) -> list[LayerOptions]:
    """The optimizer step's fixed share (``profile.optimizer.optimizer_fixed_s``: once per
    step, whatever the step updates) added to the update of every choice of the first layer in
    execution order, at the local compute's slowdown, so that the ILP, the dynamic program's
    bounds and ``evaluate`` all count it (the same for every plan, it never changes a choice).
    Nothing changes for a profile that fitted none. New option objects."""
    fixed = optimizer_fixed_s(ctx.profile)
    if fixed <= 0.0 or not opts:
        return opts
    return _charge_first_layer(opts, topo, optim_step_s=fixed * _optimizer_scale(ctx))


def plan_grad_reducer_s(table: "CostTable", choice: list[int]) -> float:
    """The reducer work ``price_grad_reducer`` put into ``choice``'s layer costs: every syncing
    layer's share and the fixed share once."""
    ctx = table.ctx
    costs = [(o.layer, o.costs[i]) for o, i in zip(table.layers, choice)]
    per = sum(grad_reducer_s(ctx, layer_param_tensors(lay), c.grad_sync_bytes) for lay, c in costs if c.grad_sync_s > 0)
    return per + (grad_reducer_fixed_s(ctx) if ctx.world > 1 and costs else 0.0)


def price_stragglers(graph: LayerGraphData, ctx: CostContext, opts: list[LayerOptions],
                     topo: list[int] | None = None) -> tuple[list[LayerOptions], StragglerCharge | None]:
    """The straggler wait (``cost.primitives``, ``StragglerCharge``) added to every choice, and
    its closing wait to every choice of the first layer in execution order (whose backward ends
    the step), so that the ILP, the solvers' bounds and ``evaluate`` all count it; linearised at
    the unsynchronised compute of the pure data-parallel plan (``native_choice``),
    or, where there is none, of the plan of each layer's least compute. New option objects, as
    ``_price_loss_move``. Returns the options and the charge (None: nothing to add)."""
    if ctx.world < 2 or not opts:
        return opts, None
    probe = CostTable(graph, ctx, opts, None, topo=topo or [lay.index for lay in graph.layers])
    dp = native_choice(probe)
    if dp is not None:
        ref = sum(unsynced_compute_s(o.costs[i]) for o, i in zip(opts, dp))
    else:
        ref = sum(min(c.fwd_compute_s + c.bwd_compute_s for c in o.costs) for o in opts)
    charge = straggler_charge(ctx, ref)
    if charge is None:
        return opts, None
    out = [replace(o, costs=[charge.apply(c) for c in o.costs]) for o in opts]
    if charge.closing_s > 0:
        out = _charge_first_layer(out, topo or [lay.index for lay in graph.layers], bwd_comm_s=charge.closing_s)
    return out, charge


def native_choice(table) -> list[int] | None:
    """The pure data-parallel assignment of ``table``: per layer the option ``sample(P)`` over
    the whole world, or ``replicate`` for a batch-free layer; None when a layer has neither."""
    world = table.ctx.world
    if world <= 1:
        return None
    free = batch_free_layers(table.graph)
    out = []
    for lay, o in zip(table.graph.layers, table.layers):
        want = "replicate" if lay.index in free else "sample"
        idx = [i for i, d in enumerate(o.choices)
               if d.kind == want and (want == "replicate" or getattr(d, "parts", None) == world)]
        if not idx:
            return None
        out.append(idx[0])
    return out


def _count_tied_once(opts: list[LayerOptions], ctx: CostContext) -> list[LayerOptions]:
    """A tied parameter is one tensor (one shard per rank, ``tied_choice_sets``): its bytes,
    gradient, optimizer state and gradient all-reduce are priced in the first layer using it
    (in execution order: its gradient is complete when that layer's backward ends, where the
    runtime's bucket all-reduces it), and taken out of every later user's prices: bytes
    exactly, the all-reduce and the optimizer step in proportion to the bytes removed (the
    latency terms go with the last synced byte). Later users get new option objects: the
    priced ones may be shared with repeated layers and other placements."""
    seen: set[str] = set()
    out = list(opts)
    for k, o in enumerate(opts):
        tied = [(op, role) for op in o.layer.ops for role in op.attrs.get("tied", ())]
        later = [(op, role) for op, role in tied if op.param_names[role] in seen]
        seen.update(op.param_names[role] for op, role in tied)
        if not later:
            continue
        costs = []
        for d, c in zip(o.choices, o.costs):
            nbytes = synced = 0.0
            for op, role in later:
                sh = d.layer_param_shard(o.layer, op, role)
                b = math.prod(sh.local_shape(op.params[role], 0, ctx.world)) * o.layer.itemsize
                nbytes += b
                synced += b if len(sh.grad_group(0, ctx.world)) > 1 else 0.0
            keep = max(0.0, c.param_bytes - nbytes)
            frac = keep / c.param_bytes if c.param_bytes else 1.0
            sync_keep = max(0.0, c.grad_sync_bytes - synced)
            sfrac = sync_keep / c.grad_sync_bytes if c.grad_sync_bytes else 1.0
            costs.append(replace(c, param_bytes=keep, grad_bytes=max(0.0, c.grad_bytes - nbytes),
                                 optim_bytes=c.optim_bytes * frac, optim_step_s=c.optim_step_s * frac,
                                 grad_sync_s=c.grad_sync_s * sfrac, grad_sync_bytes=sync_keep,
                                 grad_sync_latency=c.grad_sync_latency if sync_keep else ()))
        out[k] = replace(o, costs=costs)
    return out


def _layer_options_once(memo: dict, sig: str, lay: Layer, ctx: CostContext, kinds, prune,
                        choice_filter) -> LayerOptions:
    """``layer_options`` under the placement search's memo, kept per layer signature with the
    link level of every group its pricing asked about (as ``decomp.base.price_once`` does per
    call): a placement that leaves all those levels as they were gets the same options without
    walking its candidates again."""
    key = ("layer options", sig, tuple(kinds) if kinds is not None else None, prune, id(choice_filter))
    hit = memo_lookup(memo, ctx, memo.get(key))
    if hit is not None:
        _, _, opts, specs = hit
        if specs and ctx.spec_log is not None:
            ctx.spec_log.extend(specs)
        return LayerOptions(lay, list(opts.choices), list(opts.costs), opts.illegal_reasons,
                            list(opts.exact_keys), list(opts.illegal_choices), opts._check_ctx)
    n_specs = len(ctx.spec_log) if ctx.spec_log is not None else 0
    opts, groups, levels = record_levels(memo, ctx, lambda: layer_options(lay, ctx, kinds, prune, choice_filter))
    specs = list(ctx.spec_log[n_specs:]) if ctx.spec_log is not None else []
    memo.setdefault(key, []).append((groups, levels, opts, specs))
    return LayerOptions(lay, list(opts.choices), list(opts.costs), opts.illegal_reasons,
                        list(opts.exact_keys), list(opts.illegal_choices))


def _build_edges(graph: LayerGraphData, ctx: CostContext, opts: list[LayerOptions]) -> list[EdgeOptions]:
    """Every edge's (fwd, bwd) price matrices over its producer's and consumer's choices."""
    memo = ctx.cost_memo
    edges = []
    shapes = {op.name: op.out_shape for lay in graph.layers for op in lay.ops}
    pair_cache: dict = {}
    if memo is not None and ctx.world > max(EXACT_WORLD, ctx.ranks_per_node):
        # transitions between partial-free layouts are then one all-to-all over the world,
        # inter-node under every placement: one price for all the search's tables
        pair_cache = memo.setdefault(("unplanned pairs", ctx.world, ctx.ranks_per_node), {})
    # a choice's layouts depend on the layer alone, not on the placement: kept for the search
    layouts: dict = memo.setdefault(("layouts",), {}) if memo is not None else {}
    edge_cache: dict = {}
    local_pairs: dict = {}

    def out_layouts(u, lay, value):
        k = ("out", id(lay), value, tuple(opts[u].choices))
        r = layouts.get(k)
        if r is None:
            r = layouts[k] = tuple(d.out_placement(lay, value) for d in opts[u].choices)
        return r

    def in_layouts(v, lay, value):
        k = ("in", id(lay), value, tuple(opts[v].choices))
        r = layouts.get(k)
        if r is None:
            r = layouts[k] = tuple(d.in_placement(lay, value) for d in opts[v].choices)
        return r

    for u, v, value in graph.edges():
        lu, lv = graph.layers[u], graph.layers[v]
        shape = shapes[value] if value in shapes else graph.value_shape(value)
        item = lu.itemsize
        src = out_layouts(u, lu, value)
        dst = in_layouts(v, lv, value)
        key = (src, dst, tuple(shape), item)
        if key not in edge_cache:
            edge_cache[key] = _edge_prices(src, dst, shape, item, ctx, pair_cache, local_pairs)
        fwd, bwd = edge_cache[key]
        edges.append(EdgeOptions(u, v, value, [list(r) for r in fwd], [list(r) for r in bwd]))
    return edges


def _edge_waits(edges: list[EdgeOptions], opts: list[LayerOptions],
                charge: StragglerCharge | None) -> list[EdgeOptions]:
    """A transition is a blocking collective too: in forward it ends its producer's stretch
    of compute, in backward its consumer's. Where that phase synchronises nothing of its own
    (priced at ``charge.rate``, ``price_stragglers``), a transition that moves data (price > 0)
    adds the difference between the phase's own wait and that rate: ``wait(t) - rate t``
    (>= 0), t the phase's compute."""
    if charge is None:
        return edges
    import numpy as np

    def extra(costs, phase):
        out = np.zeros(len(costs))
        for i, c in enumerate(costs):
            comm, comp = (c.fwd_comm_s, c.fwd_compute_s) if phase == "fwd" else (c.bwd_comm_s, c.bwd_compute_s)
            if comm <= 0:
                t = comp / (1.0 + charge.rate)
                out[i] = max(0.0, charge.wait_s(t) - charge.rate * t)
        return out

    fwd_extra: dict[int, np.ndarray] = {}
    bwd_extra: dict[int, np.ndarray] = {}
    for e in edges:
        if e.src not in fwd_extra:
            fwd_extra[e.src] = extra(opts[e.src].costs, "fwd")
        if e.dst not in bwd_extra:
            bwd_extra[e.dst] = extra(opts[e.dst].costs, "bwd")
        a, b = fwd_extra[e.src], bwd_extra[e.dst]
        f, g = np.asarray(e.fwd_s, dtype=float), np.asarray(e.bwd_s, dtype=float)
        if f.size and (a.any() or b.any()):
            e.fwd_s = (f + (f > 0) * a[:, None]).tolist()
            e.bwd_s = (g + (g > 0) * b[None, :]).tolist()
    return edges


def input_transition_s(table: CostTable) -> float:
    """Graph inputs are loaded straight into their consumer's layout: no transition."""
    return 0.0


@dataclass
class StepPrediction:
    step_time_s: float
    fwd_s: float
    bwd_s: float
    grad_sync_s: float
    exposed_comm_s: float
    optimizer_s: float
    memory_per_rank_bytes: float
    grad_sync_bytes: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def grad_sync_transfer_s(c: LayerCost) -> float:
    """A choice's gradient all-reduce less its latency terms (``grad_sync_latency``, paid once
    per bucket and group): the part that moves bytes."""
    return c.grad_sync_s - sum(t for _, t, _ in c.grad_sync_latency)


def bucket_allreduce_s(costs: list[LayerCost], final: bool = False) -> float:
    """All-reduce time of one gradient bucket whose layers are priced ``costs``::

        AR_b = sum_l (grad_sync_l - its latency terms) + sum over groups g of max_l latency_(l,g)

    the runtime flattens a bucket's gradients of one group into one all-reduce
    (``runtime.gradsync``): bandwidth terms add up, each group's latency is paid once. The
    ``final`` bucket (the step waits for it right after backward) pays the blocking latency."""
    total = 0.0
    lat: dict[str, float] = {}
    for c in costs:
        total += grad_sync_transfer_s(c)
        for sig, t, t_final in c.grad_sync_latency:
            lat[sig] = max(lat.get(sig, 0.0), t_final if final else t)
    return total + sum(lat.values())


def evaluate(table: CostTable, choice: list[int]) -> StepPrediction:
    """Step time of one choice per layer, by the model the ILP encodes::

        T_fwd  = sum_l fwd(l) + sum_e fwd(e)
        T_bwd  = sum_l bwd(l) + sum_e bwd(e)
        ready_b = T_fwd + sum of bwd over layers at or after the first layer of gradient
                  bucket b (and their input edges): the moment all of b's gradients exist
                  (backward runs in reverse order; buckets as ``runtime.gradsync.layer_buckets``)
        F_b    = max(F_(b-1), ready_b) + AR_b   (bucket allreduces run one after another, each
                 starting when its gradients are ready: DDP's overlap; AR_b as
                 ``bucket_allreduce_s``)
        step   = max(T_fwd + T_bwd, F_last) + sum_l optimizer(l)
    """
    table.ensure_edges()
    cs = [table.layers[l].costs[choice[l]] for l in range(len(table.layers))]
    e_f = [e.fwd_s[choice[e.src]][choice[e.dst]] for e in table.edges]
    e_b = [e.bwd_s[choice[e.src]][choice[e.dst]] for e in table.edges]
    t_fwd = sum(c.fwd_s for c in cs) + sum(e_f)
    t_bwd = sum(c.bwd_s for c in cs) + sum(e_b)
    edge_bwd_into = [0.0] * len(cs)
    for e, b in zip(table.edges, e_b):
        edge_bwd_into[e.dst] += b
    bucket = table.bucket_of()
    suffix = 0.0
    ready: dict[int, float] = {}
    members: dict[int, list[LayerCost]] = {}
    for l in reversed(table.topo):
        suffix += cs[l].bwd_s + edge_bwd_into[l]
        if cs[l].grad_sync_s > 0 and l in bucket:
            b = bucket[l]
            ready[b] = t_fwd + suffix          # the bucket's lowest layer comes last
            members.setdefault(b, []).append(cs[l])
    last = max(members, default=None)
    ar = {b: bucket_allreduce_s(m, final=b == last) for b, m in members.items()}
    f = 0.0
    for b in sorted(ar):
        f = max(f, ready[b]) + ar[b]
    opt = sum(c.optim_step_s for c in cs)
    step = max(t_fwd + t_bwd, f) + opt
    return StepPrediction(step_time_s=step, fwd_s=t_fwd, bwd_s=t_bwd,
                          grad_sync_s=sum(c.grad_sync_s for c in cs),
                          exposed_comm_s=max(0.0, f - (t_fwd + t_bwd)), optimizer_s=opt,
                          memory_per_rank_bytes=sum(c.memory_bytes for c in cs),
                          grad_sync_bytes=sum(c.grad_sync_bytes for c in cs))
