"""Pipeline stages as a plan-level strategy (issue 41): the model cut into S contiguous ranges of
blocks, each on its own sub-mesh of ``world / S`` ranks laid dp x tp, run by one of torch's
schedules over M microbatches (``runtime.stages``).

Offered only when asked (``PlanOptions.pipeline``: "auto" tries every feasible stage count > 1,
an integer S forces that count, "off"/None offers nothing). Each stage's sub-plan comes from the
solver on its tensor-parallel group: ``make_plan`` of the same model on ``tp`` ranks for one
microbatch of one data-parallel replica (``batch / (dp M)`` samples), with the kinds the stage
runtime executes -- ``tp = 1``: the whole block on one rank; ``tp > 1`` (plain GPT blocks):
Megatron's split, pinned (attention ``head(1,tp)``, MLP ``filter(1,tp)`` then
``row_parallel(1,tp)``, the rest ``replicate``) -- cached per (tp, microbatch): one solve prices
every block, and every (layer range, sub-mesh) of a stage is a sum of its blocks' costs (blocks
the units the cuts go between; embeddings fold into the first block, the head and loss into the
last). The stage's ``dp`` axis (``stage_data_axes``: ``--stage-data``) either replicates each
block, adding the all-reduce of its gradient bytes (the profile's allreduce at the link level the
dp group spans), or shards it with FSDP2 (``cost.stages.fsdp_unit_cost``: ``decomp.fsdp``'s level
1 on the block's parameters as the sub-plan leaves them on one tp rank); the search prices both.
A cut is priced with its values' planned redistribution between the two stages' sub-meshes
(``decomp.stages.plan_cut``, ``cost.stages.planned_cut_s``: the widest block boundary's values
while the cuts are searched; plan.json's ``runtime.cuts`` records each chosen cut's own values
and steps). ``cost.stages.search_stages`` then tries every (S, tp, M) -- M every divisor of the per-replica
batch -- with its best cuts, in order of a lower bound that prunes the rest, and prices the
schedule (``decomp.stages.price_pipeline``). The stage layout, the search's time and every
option tried (priced, pruned with its bound, or refused with why) go to plan.json's
``runtime`` record (``expected: "stages"``).

Stage plans (``--stage-data plan``; the default for block models the block runtime cannot cut):
instead of dp x tp of whole blocks, the model is planned on ``P = world / S`` ranks for one
microbatch of the whole batch with every kind the op-by-op runtime runs (``_program_sub``, one
solve per (P, microbatch)), each block's cost the sum of its layers' and of the transitions into
them; every stage runs its layers of that plan (``runtime.stage_program``), and each cut is priced
by its values as their producers' layouts leave them (``decomp.stages.plan_program_cut``: each
rank's block to its peer). plan.json keeps the plan under ``runtime.stage_plan``.

Limits (stated, not hidden): every stage has the same sub-mesh shape; tp stays within a node and
divides the heads; block stages split tp for plain GPT blocks only (what
``runtime.stages.shard_gpt_blocks`` runs), other block models get tp = 1 there (stage plans
split any layer the solver can). The plan's top-level per-layer decisions (and its generated
module) are the whole-world solver's; the stages are in the runtime record.
"""

from __future__ import annotations

import dataclasses
import re
import time

from ...artifacts import PlanHooks
from ...cost.stages import fsdp_unit_cost, memory_reach, microbatch_counts, search_stages
from ...decomp import REGISTRY
from ...decomp.fsdp import UnitParams
from ...profile.optimizer import optimizer_step_s
from ...cost.table import StepPrediction
from ...cost.stages import planned_cut_s
from ...decomp.program import crossing, value_layout
from ...decomp.stages import (CANNOT_CUT_HINT, SCHEDULES, SPLIT_BACKWARD, STAGE_DATA, CutValue, pipeline_structure, chunk_ranges, Schedule, Stage, StageCost, even_layout, feasible_stage_counts, in_flight_microbatches,
                              chunk_holder, chunk_layers, plan_cut, plan_cuts, plan_program_cut)
from ...errors import InfeasiblePlan, PipelineError
from .registry import Candidate, register_strategy

NAME = "stages"
_BLOCK = re.compile(r"^(?:.*\.)?(blocks|h|layers)\.(\d+)(?:\.|$)")


def block_units(graph) -> list[int] | None:
    """Per layer of ``graph``, the block (unit) it belongs to: blocks by their module path
    (``blocks.i``, ``transformer.h.i``, ``layers.i``); any other layer joins the latest block its
    inputs come from (unit 0 when none: embeddings, their dropout; the last block for the final
    norm and head), by data flow rather than by its place in the layer list, which a tracer may
    order otherwise (Hugging Face GPT-2's embedding dropout). None when the model has fewer than
    two blocks."""
    idx = []
    for lay in graph.layers:
        m = _BLOCK.match(getattr(lay, "module", "") or "")
        idx.append(int(m.group(2)) if m else None)
    blocks = sorted({i for i in idx if i is not None})
    if len(blocks) < 2 or blocks != list(range(len(blocks))):
        return None
    made = {op.name: li for li, lay in enumerate(graph.layers) for op in lay.ops}
    out = list(idx)
    for _ in range(len(out) + 1):            # to a fixed point: producers listed after consumers
        changed = False
        for li, lay in enumerate(graph.layers):
            if idx[li] is not None:
                continue
            srcs = [out[made[v]] for v in lay.inputs if v in made and out[made[v]] is not None]
            u = max(srcs) if srcs else 0
            if out[li] != u:
                out[li], changed = u, True
        if not changed:
            break
    return out


def gpt_heads(graph) -> int | None:
    """The attention heads of a plain-GPT block model (``blocks.i.attn`` / ``.fc`` / ``.out``
    modules, what ``runtime.stages.shard_gpt_blocks`` splits), read from the traced attention's
    output ``[n, heads, s, d]``; None for any other model (no tensor parallelism in its stages)."""
    mods = {getattr(lay, "module", "") or "" for lay in graph.layers}
    if not all(f"blocks.0.{m}" in mods for m in ("attn", "fc", "out")):
        return None
    for lay in graph.layers:
        for op in lay.ops:
            if "scaled_dot_product_attention" in op.name and len(op.out_shape) == 4:
                return int(op.out_shape[1])
    return None


def tp_pins(tp: int) -> tuple[str, ...]:
    """Megatron's split of a plain GPT block over ``tp`` ranks as pins (what the stage runtime
    runs): attention heads, the MLP's first linear by output features, its second by input
    features; everything else whole on every rank of the group."""
    return ("*=replicate", f"blocks.*.attn=head(1,{tp})", f"blocks.*.fc=filter(1,{tp})",
            f"blocks.*.out=row_parallel(1,{tp})")


def sub_plan_kinds(tp: int) -> tuple[str, ...]:
    """The kinds a stage's sub-plan on ``tp`` ranks may use: what the stage runtime runs (the
    whole block on one rank; Megatron's split, with ``tp_pins``, over a tp group)."""
    return ("sample", "replicate") if tp == 1 else ("replicate", "head", "filter", "row_parallel")


def _requested(o) -> tuple[str, int | None]:
    p = getattr(o, "pipeline", None)
    if p in (None, "off", 0, 1, "1"):
        return "off", None
    if p == "auto":
        return "auto", None
    return "fixed", int(p)


def _short(option_json: dict) -> dict:
    """An option as plan.json lists it: the per-stage arrays folded into their maximum."""
    d = {k: v for k, v in option_json.items() if k not in ("peak_bytes", "in_flight_microbatches")}
    if "peak_bytes" in option_json:
        d["peak_bytes_max"] = max(option_json["peak_bytes"])
    return d


@register_strategy
class PipelineStages:
    name = NAME
    priority = 3

    def offer(self, base):
        o = base.req.options
        mode, fixed = _requested(o)
        if mode == "off":
            return ()
        sched_name = getattr(o, "schedule", None) or "1f1b"
        if sched_name not in SCHEDULES:
            raise PipelineError(f"--schedule {sched_name!r} is not one of torch's schedules here",
                                f"use one of {', '.join(SCHEDULES)}")
        virtual = 1 if SCHEDULES[sched_name][1] == 1 else 2      # interleaved / V-shaped: 2 chunks per rank
        units = block_units(base.graph)
        world, batch = base.req.world, base.loaded.batch_size
        if units is None:
            why = "not a sequential block model (no blocks.i / transformer.h.i / layers.i modules)"
            if mode == "fixed":
                raise PipelineError(f"--pipeline {fixed}: {why}", "plan with --pipeline off")
            return (Candidate(NAME, "pipeline stages", illegal=why, priority=self.priority),)
        data_axes = stage_data_axes(o, sched_name)
        program_mode = data_axes == ("plan",)     # only stage plans: the plan's program, any traced layers
        auto = (getattr(o, "stage_data", None) or "auto") == "auto" and sched_name not in SPLIT_BACKWARD
        cannot = None if program_mode else runtime_cannot_cut(base.loaded.mf)
        if cannot is not None and auto:
            # the block runtime cannot cut this model: its stages run the solver's plan instead
            data_axes, program_mode, cannot = ("plan",), True, None
        bn_local = bool(getattr(base.table.ctx.batch_norm, "local", False))
        if program_mode:
            cannot = program_cannot_run(base.graph, base.loaded.batch_size, bn_local)
        if cannot is not None:                       # the planner offers only what the stage runtime runs
            if mode == "fixed":
                raise PipelineError(f"--pipeline {fixed}: {cannot}", "plan with --pipeline off")
            return (Candidate(NAME, "pipeline stages", illegal=cannot, priority=self.priority),)
        n_units = max(units) + 1
        crossing_values(base.graph, units)           # refuses a value crossing a cut backwards
        feasible = [s for s in feasible_stage_counts(n_units, world, virtual) if s > 1]
        if mode == "fixed" and fixed not in feasible:
            raise PipelineError(f"--pipeline {fixed} is not feasible for {n_units} blocks on {world} ranks",
                                f"use one of the feasible stage counts {feasible} (or --pipeline auto|off)")
        counts = [fixed] if mode == "fixed" else feasible
        if auto and not program_mode and program_cannot_run(base.graph, batch, bn_local) is None and \
                0 < len(plan_solves(counts, world, batch, sched_name, getattr(o, "microbatches", None))) <= PLAN_SOLVES_IN_AUTO:
            data_axes = (*data_axes, "plan")       # few enough solves: stage plans weighed beside block stages
        profile = base.loaded.profile
        rpn = int(base.loaded.ranks_per_node)
        heads = gpt_heads(base.graph)
        tp_ok = heads is not None and (o.kinds is None or "head" in o.kinds)      # tensor parallelism allowed
        tps = [t for t in range(1, rpn + 1) if t == 1 or (tp_ok and heads % t == 0 and not program_mode)]
        subplans: dict[tuple[int, int], SubPlan] = {}

        def sub(tp: int, mb: int) -> SubPlan:
            if (tp, mb) not in subplans:
                subplans[(tp, mb)] = _unit_costs(base, tp, mb, units, n_units)
            return subplans[(tp, mb)]

        def psub(p: int, rows: int) -> SubPlan:       # the plan every stage runs: P ranks, one microbatch
            if (-p, rows) not in subplans:
                sp = _program_sub(base, p, rows, units, n_units)
                limit = base.memory_limit_bytes
                if limit is not None and sp.record is not None:
                    s_count = world // p
                    budget = stage_plan_budget(limit, s_count, Schedule(sched_name, max(1, batch // rows), virtual))
                    if sum(c.static_bytes + budget[1] * c.act_bytes_per_microbatch for c in sp.costs) > s_count * limit:
                        # no cut of the fastest plan fits: the plan solved again under the budget
                        sp = _program_sub(base, p, rows, units, n_units, memory_limit=budget[0])
                subplans[(-p, rows)] = sp
            return subplans[(-p, rows)]

        def unit_cost(i, dp, tp, mb, data="replicate"):
            if data == "plan":              # ``mb``: the whole microbatch's samples (``search_stages``)
                return psub(dp, mb).costs[i]
            sp = sub(tp, mb)
            c = sp.costs[i]
            level = profile.level_of(range(0, dp * tp, tp))
            if data == "fsdp":
                def coll(kind, p, n):
                    return profile.collective_time_s(kind, p, n, level=level)

                def opt(n, nbytes):
                    return optimizer_step_s(profile, n, nbytes) or 0.0
                return fsdp_unit_cost(c, sp.params[i], dp, float(base.table.ctx.optimizer_state_per_param),
                                      sp.optim_s[i], coll, opt, sp.costs[i - 1].fwd_s if i else 0.0)
            sync = profile.collective_time_s("allreduce", dp, sp.grad_bytes[i], level=level) if dp > 1 else 0.0
            return dataclasses.replace(c, grad_sync_s=c.grad_sync_s + sync)

        bvalues = cut_values(base.graph, units, batch)
        widest = bvalues.get(widest_boundary(bvalues), [])
        ctx = base.table.ctx
        plan_cut_s: dict[tuple[int, int, int], float] = {}      # a stage plan's cut, per (S, k, microbatch)

        def cut(s_count, k, tp, mb, data="replicate"):   # the widest boundary's values, planned between the sub-meshes
            size = world // s_count
            if data == "plan":
                if (s_count, k, mb) not in plan_cut_s:
                    sp = psub(size, mb)
                    a = Stage(k, 0, 1, tuple(range(k * size, (k + 1) * size)), size, 1, "plan")
                    b = Stage(k + 1, 1, 2, tuple(range((k + 1) * size, (k + 2) * size)), size, 1, "plan")
                    plan_cut_s[(s_count, k, mb)] = max((planned_cut_s(plan_program_cut(k, a, b, vals), ctx)
                                                        for vals in sp.boundaries.values()))
                return plan_cut_s[(s_count, k, mb)]
            a = Stage(k, 0, 1, tuple(range(k * size, (k + 1) * size)), size // tp, tp)
            b = Stage(k + 1, 1, 2, tuple(range((k + 1) * size, (k + 2) * size)), size // tp, tp)
            return planned_cut_s(plan_cut(k, a, b, cut_value_list(widest, size // tp, mb)), ctx)

        t0 = time.perf_counter()
        sr = search_stages(n_units, world, batch, unit_cost, cut, stage_counts=counts, tps=tps,
                           microbatches=getattr(o, "microbatches", None), schedule=sched_name, virtual=virtual,
                           memory_limit_bytes=base.memory_limit_bytes, data_axes=data_axes,
                           mixed=not has_tied_weights(base.graph))   # a tied weight: one data axis for all
        search = {"search_s": time.perf_counter() - t0, "sub_plans_solved": len(subplans), "tps": tps,
                  "data_axes": list(data_axes),
                  "options_tried": len(sr.options), "memory_limit_bytes": base.memory_limit_bytes,
                  "memory_reach": memory_reach(sr.options)}
        records = [_short(op.to_json()) for op in sr.options]
        per = sr.best_per_stage_count()
        cands = []
        for s_count in counts:
            best = per.get(s_count)
            if best is None or best.price is None:
                why = best.refused if best is not None else "nothing to price"
                if all(c.illegal for c in cands) and s_count == counts[-1] and mode != "fixed":
                    why += f" ({search['memory_reach']})"       # nothing fits: what each count reaches
                                                                # (a fixed count's error names it itself)
                cands.append(Candidate(NAME, f"pipeline {s_count} stages", illegal=why, priority=self.priority,
                                       forced=mode == "fixed"))
                continue
            layout = even_layout(n_units, world, s_count, Schedule(sched_name, best.microbatches, virtual),
                                 tp=best.tp, cuts=best.cuts if virtual == 1 else None,   # V chunks: cut evenly
                                 data=best.stage_data or best.data)
            p = best.price
            # each cut's own boundary: the stages' (V = 1) or the chunks' (V chunks per rank, cut evenly;
            # the search priced them with the widest boundary)
            if best.data == "plan":
                sp = psub(best.dp, best.microbatch)
                cuts_planned = tuple(plan_program_cut(k, layout.stages[chunk_holder(layout, k)],
                                                      layout.stages[chunk_holder(layout, k + 1)], vals)
                                     for k, vals in sorted(program_cut_values(sp, layout).items()))
            else:
                crossing = [bvalues[stop - 1] for _, _, stop in chunk_ranges(layout)[:-1]]
                cuts_planned = plan_cuts(layout, [cut_value_list(v, best.dp, best.microbatch) for v in crossing])
            pred = StepPrediction(step_time_s=p.step_s, fwd_s=0.0, bwd_s=0.0, grad_sync_s=p.sync_tail_s,
                                  exposed_comm_s=p.send_s, optimizer_s=0.0,
                                  memory_per_rank_bytes=max(p.peak_bytes), grad_sync_bytes=0.0)
            dp_word = (f"the solver's plan on {best.dp} ranks" if best.data == "plan" else f"dp {best.dp}") + (
                " FSDP2" if best.data == "fsdp" else "") + (
                f" (FSDP2 on stages {[k for k, d in enumerate(best.stage_data) if d == 'fsdp']})"
                if best.data == "mixed" else "")
            mesh_word = dp_word if best.data == "plan" else f"{dp_word} x tp {best.tp}"
            label = f"pipeline {s_count} stages x M {best.microbatches} ({sched_name}, {mesh_word})"
            cands.append(Candidate(NAME, label, pred, table=base.table, choice=tuple(base.solution.choice),
                                   runtime="stages", forced=mode == "fixed", priority=self.priority,
                                   note=f"pipeline stages: {layout.to_json()['stages']}",
                                   detail={"layout": layout.to_json(), "price": p.to_json(), "priced": records,
                                           "cuts": [c.to_json() for c in cuts_planned],
                                           "search": search, "heads": heads if best.tp > 1 else None,
                                           "sub_plan_kinds": list((psub(best.dp, best.microbatch) if
                                                                   best.data == "plan" else sub(best.tp, best.microbatch)).kinds)
                                           + (["sharded"] if best.data in ("fsdp", "mixed") else []),
                                           **({"stage_plan": psub(best.dp, best.microbatch).record}
                                              if best.data == "plan" else {})}))
        if mode == "fixed" and all(c.illegal for c in cands):
            raise PipelineError(f"--pipeline {fixed} leaves a stage without memory or the batch unsplit "
                                f"({cands[0].illegal if cands else 'nothing priced'})",
                                f"{search['memory_reach']}; raise --memory-limit or the batch")
        return tuple(cands)

    def record(self, base, choice) -> dict:
        c = choice.chosen
        mine = [x for x in choice.candidates if x.strategy == NAME]
        if not mine:
            return {}
        withd = [x for x in mine if x.detail]
        priced = withd[0].detail["priced"] if withd else []
        if c.strategy != NAME:
            return {"pipeline_considered": priced}
        return {"runtime": {"expected": "stages", "step_time_s": c.step_time_s,
                            "reason": f"{c.label}: predicted {c.step_time_s * 1e3:.3f} ms, the fastest legal plan",
                            "stages": c.detail["layout"], "price": c.detail["price"], "cuts": c.detail["cuts"],
                            "sub_plan_kinds": c.detail["sub_plan_kinds"], "heads": c.detail["heads"],
                            **({"stage_plan": c.detail["stage_plan"]} if "stage_plan" in c.detail else {}),
                            "executable": True, "search": c.detail["search"],
                            "stage_counts_priced": priced}}


def runtime_cannot_cut(mf) -> str | None:
    """Why ``runtime.stages.pipeline_parts`` cannot cut the model file's model into (pre, blocks,
    post), asked of the model built on the meta device (no memory), or None when it can."""
    import torch
    with torch.device("meta"):
        model = mf.build_model()
    if pipeline_structure(model) is None:
        return f"the stage runtime cannot cut {type(model).__name__} ({CANNOT_CUT_HINT})"
    return None


def has_tied_weights(graph) -> bool:
    """Whether the traced model uses one parameter in two places (the tracer's ``tied`` roles):
    its parts are summed across the stages holding it, which needs one data axis on all of them
    (no per-stage mix of replicated and FSDP2)."""
    return any(op.attrs.get("tied") for lay in graph.layers for op in lay.ops)


def stage_data_axes(o, schedule: str = "1f1b") -> tuple[str, ...]:
    """What a stage's dp axis may do with its parameters (``decomp.stages.STAGE_DATA``): both
    unless ``--stage-data`` names one; FSDP2 only where ``--kinds`` allows ``sharded`` and the
    schedule runs whole backward steps (``decomp.stages.SPLIT_BACKWARD``)."""
    want = getattr(o, "stage_data", None) or "auto"
    if want not in ("auto", *STAGE_DATA):
        raise PipelineError(f"--stage-data {want!r} is not auto, {' or '.join(STAGE_DATA)}",
                            "use --stage-data auto (the planner chooses), replicate, fsdp or plan")
    if want == "plan":      # the solver's plan inside every stage: asked for by name (one solve per (P, M))
        if schedule in SPLIT_BACKWARD:
            raise PipelineError(f"--stage-data plan under the {schedule} schedule: its weight-gradient step reads the "
                                "stage module's own parameters, and a stage plan's are its DistModel's",
                                "use gpipe, 1f1b, interleaved_1f1b or looped_bfs with --stage-data plan")
        return ("plan",)
    allowed = tuple(d for d in STAGE_DATA if d == "replicate" or (d == "fsdp" and (o.kinds is None or "sharded" in o.kinds)))
    if schedule in SPLIT_BACKWARD:
        allowed = ("replicate",)
        if want == "fsdp":
            raise PipelineError(f"--stage-data fsdp under the {schedule} schedule: its weight-gradient step does not "
                                "reach FSDP2's gathered parameters", "use gpipe, 1f1b, interleaved_1f1b or looped_bfs "
                                "with fsdp, or --stage-data replicate")
    if want == "auto":
        return allowed
    if want not in allowed:
        raise PipelineError(f"--stage-data {want} needs the sharded kind, which --kinds leaves out",
                            "add sharded to --kinds or drop --stage-data")
    return (want,)


@dataclasses.dataclass(frozen=True)
class SubPlan:
    """A stage's sub-plan on ``tp`` ranks for one microbatch, per block: its costs (no dp
    traffic), gradient bytes per rank (what a replicated dp axis all-reduces), the optimizer's
    seconds on it whole, and its parameters as one rank holds them (what FSDP2 shards); the kinds.
    A stage plan (``--stage-data plan``: the whole sub-mesh planned, ``_program_sub``) also keeps
    its graph, decisions and each layer's unit, every unit boundary's crossing values with their
    layouts (``boundaries``), and plan.json's ``runtime.stage_plan`` record."""
    costs: list
    grad_bytes: list
    optim_s: list
    params: list
    kinds: tuple
    graph: object = None
    decs: dict | None = None
    units: tuple = ()
    boundaries: dict = dataclasses.field(default_factory=dict)
    record: dict | None = None


#: ``--stage-data auto`` weighs stage plans beside block stages when at most this many stage plans
#: (one solve of the whole model per (ranks per stage, microbatch rows)) would be solved; beyond it,
#: planning would be dominated by those solves (every stage count times every microbatch count,
#: each a solve of the whole model on up to world / 2 ranks), and ``--stage-data plan`` asks for
#: them by name
PLAN_SOLVES_IN_AUTO = 8


def plan_solves(counts, world: int, batch: int, schedule: str, microbatches: int | None) -> set[tuple[int, int]]:
    """The (ranks per stage, microbatch rows) pairs a search over ``counts`` stage counts would
    solve a stage plan for (``cost.stages.microbatch_counts``, or the fixed M): stages of more than
    one rank only."""
    out = set()
    for s in counts:
        p = world // s
        if p < 2:
            continue
        ms = [microbatches] if microbatches else microbatch_counts(batch, s, schedule)
        out |= {(p, batch // m) for m in ms if m and batch % m == 0}
    return out


#: the per-layer kinds a stage running a plan may use: what the op-by-op runtime runs on a
#: sub-mesh (not the plan-level runtimes: whole graphs per rank, branches on their own groups)
PROGRAM_EXCLUDED = ("graphs", "branch")


def program_cannot_run(graph, traced_batch: int, bn_local: bool = False) -> str | None:
    """Why stages cannot run the solver's plan of this model (``runtime.stage_program``), or None:
    torch's schedule cuts every model input into microbatches along dim 0, so each must be
    batched; batch norm needs global statistics there (local ones defer their running statistics
    to a step's end, which a schedule does not have)."""
    if bn_local and any(op.kind == "batch_norm" for lay in graph.layers for op in lay.ops):
        return ("stage plans need global batch-norm statistics (--batch-norm global): local ones update running "
                "statistics at a step's end, which a pipeline schedule does not have")
    for gi in graph.inputs:
        if not gi.shape or int(gi.shape[0]) != int(traced_batch):
            return (f"model input {gi.name} {tuple(gi.shape)} has no batch dim 0 of {traced_batch} samples: the "
                    "schedule cannot cut it into microbatches")
    return None


def program_cut_values(sp: SubPlan, layout) -> dict[int, list]:
    """{cut c: [(CutValue, its producer's Sharding)]} of a stage layout running stage plan ``sp``."""
    return _cut_pairs(sp.graph, sp.decs, chunk_layers(layout, sp.units))


def _cut_pairs(graph, decs, chunks: dict[int, list[int]]) -> dict[int, list]:
    """{cut c after chunk c: [(CutValue, its producer's Sharding)]} (``decomp.program.crossing``)."""
    prod = graph.producer()
    return {c: [(CutValue(v, tuple(graph.value_shape(v)), _value_itemsize(graph, v)),
                 value_layout(graph, decs, v, prod)) for v in vals]
            for c, vals in crossing(graph, decs, chunks).items()}


def _value_itemsize(graph, v: str) -> int:
    return _DTYPE_BYTES.get(graph.value_dtype(v), 4)


def stage_plan_budget(limit: float, s_count: int, schedule: Schedule) -> tuple[float, float]:
    """(memory limit for the stage plan's solve, F) under a per-rank ``limit``: every cut of a
    model into S stages needs ``sum over layers (static + F act) <= S limit`` (F: the most
    microbatches a stage keeps in flight, stage 0's), and a plan of the whole model whose one-
    microbatch memory ``sum (static + act)`` is at most ``S limit / F`` meets it. A budget, not a
    guarantee: the cuts still have to balance the stages."""
    f = max(1.0, in_flight_microbatches(schedule, s_count, 0))
    return s_count * limit / f, f


def _program_sub(base, p: int, rows: int, units: list[int], n_units: int,
                 memory_limit: float | None = None) -> SubPlan:
    """The model planned on ``p`` ranks for ``rows`` samples (one microbatch of the whole batch),
    every kind the op-by-op runtime runs (``PROGRAM_EXCLUDED`` out; ``--kinds`` respected), per
    unit: its layers' costs plus the transitions into them (gradient sync of the plan's own groups
    included: the stage syncs once a step, as one step of the plan does); ``memory_limit``: the
    solve's (``stage_plan_budget``), none for the fastest plan. No plan at all: ``_priced_out``."""
    o = base.req.options
    kinds = tuple(k for k in REGISTRY if k not in PROGRAM_EXCLUDED and (o.kinds is None or k in o.kinds))
    sub = dataclasses.replace(o, world_size=p, batch_size=rows, write=False, out_dir=None, pipeline="off",
                              microbatches=None, schedule=None, stage_data=None, kinds=kinds,
                              placement="block", memory_limit_bytes=memory_limit, nodes=None)
    try:
        res = base.replan(base.loaded.model_file, sub, PlanHooks(profile=base.loaded.profile, graph=None))
    except InfeasiblePlan:
        return _priced_out(n_units)
    tab, ch = res.table, list(res.solution.choice)
    tab.ensure_edges()
    sub_units = block_units(tab.graph) or units
    acc = [[0.0] * 5 for _ in range(n_units)]
    for li, u in enumerate(sub_units):
        c = tab.layers[li].costs[ch[li]]
        for k, x in enumerate((c.fwd_s, c.bwd_s, c.grad_sync_s + c.optim_step_s, c.activation_bytes + c.workspace_bytes,
                               c.param_bytes + c.grad_bytes + c.optim_bytes)):
            acc[u][k] += x
    for e in tab.edges:                    # a transition runs on its way into its consumer's layer
        acc[sub_units[e.dst]][0] += e.fwd_s[ch[e.src]][ch[e.dst]]
        acc[sub_units[e.dst]][1] += e.bwd_s[ch[e.src]][ch[e.dst]]
    graph = tab.graph
    decs = {li: tab.layers[li].choices[ch[li]] for li in range(len(ch))}
    sp = SubPlan([StageCost(*a) for a in acc], [0.0] * n_units, [0.0] * n_units,
                 [UnitParams(f"block {u}", ()) for u in range(n_units)],
                 tuple(sorted({d.kind for d in decs.values()})), graph, decs, tuple(sub_units))
    # every place a cut may go (after each unit): what would cross it
    boundaries = _cut_pairs(graph, decs, {u: [li for li, x in enumerate(sub_units) if x == u] for u in range(n_units)})
    record = {"world_size": p, "graph": dict(res.plan.graph_json), "units": list(sub_units),
              "batch_norm": res.plan.batch_norm.to_json(),
              "layers": [{"layer": li, "decomposition": decs[li].to_json()} for li in range(len(ch))],
              "choices": [str(decs[li]) for li in range(len(ch))]}
    return dataclasses.replace(sp, boundaries=boundaries, record=record)


def _priced_out(n_units: int) -> SubPlan:
    """A sub-mesh with no sub-plan: every unit infinitely slow and large (the search refuses it)."""
    inf = float("inf")
    return SubPlan([StageCost(inf, inf, 0.0, inf, inf)] * n_units, [0.0] * n_units, [0.0] * n_units,
                   [UnitParams(f"block {u}", ()) for u in range(n_units)], ())


def _unit_costs(base, tp: int, mb: int, units: list[int], n_units: int) -> SubPlan:
    """The model planned on ``tp`` ranks for ``mb`` samples (one microbatch of one dp replica of a
    stage), with the stage runtime's kinds (module docstring), its per-layer costs summed per
    block (``SubPlan``)."""
    make_plan = base.replan           # the planner itself, passed in by planner.make (Offer.replan)
    o = base.req.options
    pins = tp_pins(tp) if tp > 1 else ()
    sub = dataclasses.replace(o, world_size=tp, batch_size=mb, write=False, out_dir=None, pipeline="off",
                              microbatches=None, schedule=None, stage_data=None,
                              kinds=sub_plan_kinds(tp),
                              placement="block", memory_limit_bytes=None, pins=pins, nodes=None)
    try:
        res = make_plan(base.loaded.model_file, sub, PlanHooks(profile=base.loaded.profile, graph=None))
    except InfeasiblePlan:           # no sub-plan at all: every unit priced out
        return _priced_out(n_units)
    tab, ch = res.table, list(res.solution.choice)
    sub_units = block_units(tab.graph) or units
    acc = [[0.0] * 5 for _ in range(n_units)]
    grads, optim = [0.0] * n_units, [0.0] * n_units
    shapes: list[dict[str, tuple[int, ...]]] = [{} for _ in range(n_units)]
    itemsize = [4] * n_units
    for li, u in enumerate(sub_units):
        c = tab.layers[li].costs[ch[li]]
        a = acc[u]
        a[0] += c.fwd_s
        a[1] += c.bwd_s
        a[2] += c.grad_sync_s + c.optim_step_s
        a[3] += c.activation_bytes + c.workspace_bytes
        a[4] += c.param_bytes + c.grad_bytes + c.optim_bytes
        grads[u] += c.grad_bytes
        optim[u] += c.optim_step_s
        lay, dec = tab.graph.layers[li], tab.layers[li].choices[ch[li]]
        for op in lay.ops:               # each parameter as tp rank 0 holds it (what FSDP2 shards)
            for role, q in op.param_names.items():
                if not any(q in d for d in shapes):
                    sh = dec.layer_param_shard(lay, op, role)
                    shapes[u][q] = tuple(int(x) for x in sh.local_shape(op.params[role], 0, tp))
                    itemsize[u] = _DTYPE_BYTES.get(str(op.dtype).replace("torch.", ""), 4)
    kinds_used = tuple(sorted({tab.layers[li].choices[ch[li]].kind for li in range(len(ch))}))
    params = [UnitParams(f"block {u}", tuple(shapes[u].values()), itemsize[u]) for u in range(n_units)]
    return SubPlan([StageCost(*a) for a in acc], grads, optim, params, kinds_used)


_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}


def _crossing(graph, units: list[int]) -> dict[str, tuple[int, int, tuple[int, ...], int]]:
    """Every value consumed in a later unit than the one producing it: name -> (producing unit,
    last consuming unit, traced shape, bytes per element). A value consumed by an earlier unit
    than the one producing it would cross a cut backwards: refused, naming it."""
    produced: dict[str, tuple[int, tuple[int, ...], int]] = {}
    for lay, u in zip(graph.layers, units):
        for op in lay.ops:
            produced[op.name] = (u, tuple(int(d) for d in op.out_shape),
                                 _DTYPE_BYTES.get(str(op.dtype).replace("torch.", ""), 4))
    last_use: dict[str, int] = {}
    for lay, u in zip(graph.layers, units):
        for v in lay.inputs:
            if v not in produced:
                continue
            pu = produced[v][0]
            if u < pu:
                raise PipelineError(f"value {v} (made in block {pu}) feeds {lay.name} in block {u}: it would cross "
                                    "a stage cut backwards", "pipeline stages need every value to flow forward; "
                                    "plan with --pipeline off")
            last_use[v] = max(last_use.get(v, u), u)
    return {v: (produced[v][0], lu, produced[v][1], produced[v][2]) for v, lu in last_use.items()
            if lu > produced[v][0]}


def crossing_values(graph, units: list[int]) -> dict[int, list[tuple[str, float]]]:
    """Per unit boundary u (between unit u and u+1), the values produced at or before u and
    consumed after it, with their traced bytes (the whole traced batch); refuses a value crossing
    a cut backwards (``_crossing``)."""
    n_units = max(units) + 1
    out: dict[int, list[tuple[str, float]]] = {u: [] for u in range(n_units - 1)}
    for v, (pu, lu, shape, item) in _crossing(graph, units).items():
        nbytes = float(item)
        for d in shape:
            nbytes *= d
        for u in range(pu, lu):
            out[u].append((v, nbytes))
    return out


def cut_values(graph, units: list[int], traced_batch: int) -> dict[int, list[tuple[str, tuple[int, ...], int, bool]]]:
    """Per unit boundary, the values the stage runtime sends over it, as (name, shape, bytes per
    element, batched): those a *block* makes (a layer whose module is ``blocks.i`` / ``h.i`` /
    ``layers.i``) and a later unit reads -- what a block returns and ``runtime.stages`` passes on.
    A value made outside the blocks and read by several (Hugging Face GPT-2's attention mask,
    built before the blocks) is not sent: each block makes its own at run time. A value whose
    dim 0 is the traced batch is *batched* (its samples follow the microbatch; the shape keeps
    dims 1.. and dim 0 is set per microbatch), any other crosses whole."""
    n_units = max(units) + 1
    in_block = {op.name for lay in graph.layers if _BLOCK.match(getattr(lay, "module", "") or "") for op in lay.ops}
    out: dict[int, list[tuple[str, tuple[int, ...], int, bool]]] = {u: [] for u in range(n_units - 1)}
    for v, (pu, lu, shape, item) in sorted(_crossing(graph, units).items()):
        if v not in in_block:
            continue
        batched = bool(shape) and shape[0] == int(traced_batch)
        for u in range(pu, lu):
            out[u].append((v, shape, item, batched))
    return out


def cut_value_list(values: list[tuple[str, tuple[int, ...], int, bool]], dp: int, microbatch: int
                   ) -> tuple[CutValue, ...]:
    """One microbatch's ``CutValue``s of a boundary (``cut_values``) on stages of ``dp`` replicas:
    a batched value's dim 0 is every replica's microbatch rows, ``dp x microbatch``."""
    return tuple(CutValue(n, (dp * microbatch, *shape[1:]) if batched else shape, item, batched)
                 for n, shape, item, batched in values)


def widest_boundary(values: dict[int, list[tuple[str, tuple[int, ...], int, bool]]]) -> int:
    """The boundary whose values move the most bytes per sample (every boundary of a uniform
    block model carries the same): what a cut is priced with before its position is known."""
    def per_sample(u):
        total = 0
        for _, shape, item, batched in values[u]:
            n = item
            for d in (shape[1:] if batched else shape):
                n *= d
            total += n
        return total
    return max(values, key=lambda u: (per_sample(u), -u)) if values else 0
