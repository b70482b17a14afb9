"""Pipeline stages as a plan-level strategy (issue 41): the model cut into S contiguous ranges of
blocks, each on its own sub-mesh of ``world / S`` ranks, run by one of torch's schedules over M
microbatches (``runtime.stages``).

Offered only when asked (``PlanOptions.pipeline``: "auto" tries every feasible stage count > 1,
an integer S forces that count, "off"/None offers nothing). Each stage's sub-plan comes from the
solver on its sub-mesh: ``make_plan`` of the same model at ``world / S`` ranks for one
microbatch (``batch / M`` samples), restricted to data parallelism inside the stage (``sample``
/ ``replicate``: what the stage runtime executes), cached per (sub-mesh size, microbatch); its
per-layer costs are summed per block (the units the cuts go between; embeddings fold into the
first block, the head and loss into the last) and ``cost.stages.search_stages`` picks the cuts
and prices the schedule (``decomp.stages.price_pipeline``). The stage layout and every count
priced go to plan.json's ``runtime`` record (``expected: "stages"``).

Limits (stated, not hidden): one sub-plan per (sub-mesh, microbatch) cut into ranges, rather
than one solve per (layer range, sub-mesh). Sub-plans are data parallel inside each stage
(what ``runtime.stages`` executes from a plan); only when no such stage fits the memory limit
are the solver's own sub-plans (tensor parallel...) priced under S x half the limit, recorded with
``executable: false`` (tensor parallelism inside a stage runs in ``runtime.stages`` for plain GPT
blocks, but plans do not drive it yet). The plan's per-layer decisions are the whole-world
solver's; the stages are in the runtime record.
"""

from __future__ import annotations

import dataclasses
import re

from ...artifacts import PlanHooks
from ...cost.stages import search_stages
from ...cost.table import StepPrediction
from ...decomp.stages import SCHEDULES, Schedule, StageCost, cut_send_time_s, even_layout, feasible_stage_counts
from ...errors import InfeasiblePlan, PipelineError
from . import Candidate, register_strategy

NAME = "stages"
_BLOCK = re.compile(r"^(?:.*\.)?(blocks|h|layers)\.(\d+)(?:\.|$)")


def block_units(graph) -> list[int] | None:
    """Per layer of ``graph``, the block (unit) it belongs to: blocks by their module path
    (``blocks.i``, ``transformer.h.i``, ``layers.i``), layers before the first block in unit 0,
    after the last in the last unit. None when the model has fewer than two blocks."""
    idx = []
    for lay in graph.layers:
        m = _BLOCK.match(getattr(lay, "module", "") or "")
        idx.append(int(m.group(2)) if m else None)
    blocks = sorted({i for i in idx if i is not None})
    if len(blocks) < 2 or blocks != list(range(len(blocks))):
        return None
    out, seen = [], None
    for i in idx:
        if i is not None:
            seen = i
        out.append(i if i is not None else (0 if seen is None else blocks[-1]))
    return out


def _requested(o) -> tuple[str, int | None]:
    p = getattr(o, "pipeline", None)
    if p in (None, "off", 0, 1, "1"):
        return "off", None
    if p == "auto":
        return "auto", None
    return "fixed", int(p)


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
        n_units = max(units) + 1
        crossing_values(base.graph, units)           # refuses a value crossing a cut backwards
        feasible = [s for s in feasible_stage_counts(n_units, world, virtual) if s > 1]
        if mode == "fixed" and fixed not in feasible:
            raise PipelineError(f"--pipeline {fixed} is not feasible for {n_units} blocks on {world} ranks",
                                f"use one of the feasible stage counts {feasible} (or --pipeline auto|off)")
        counts = [fixed] if mode == "fixed" else feasible
        m_fixed = getattr(o, "microbatches", None)
        profile = base.loaded.profile
        subplans: dict[tuple[str, int, int], tuple[list[StageCost], tuple[str, ...]]] = {}

        def unit_cost_of(mode_: str):
            # the search sees each stage as ONE group of ``tp = world / S`` ranks (dp = 1) handling
            # microbatches of ``mb`` samples: the sub-plan decides how its ranks split them
            def unit_cost(i, dp, tp, mb):
                key = (mode_, tp, mb)
                if key not in subplans:
                    subplans[key] = _unit_costs(base, tp, mb, units, n_units, mode_)
                return subplans[key][0][i]
            return unit_cost

        cands, records = [], []
        for s_count in counts:
            size = world // s_count

            def cut(k, tp, mb, size=size):       # each rank sends its 1/size share of the microbatch
                act = _cut_bytes(base.graph, units, mb, batch) / size
                return cut_send_time_s(profile, act, range(k * size, (k + 1) * size),
                                       range((k + 1) * size, (k + 2) * size))
            ms = [m_fixed] if m_fixed else [m for m in (s_count, 2 * s_count, 4 * s_count) if batch % m == 0]
            if not ms:
                records.append({"stages": s_count, "refused": f"batch {batch} does not split into "
                                                              f"M >= {s_count} microbatches"})
                continue
            best, sub_mode = None, "data_parallel"
            # sub-plans data parallel inside each stage (what the stage runtime executes); when no
            # such stage fits the memory limit, the solver's own sub-plans under half the limit
            # (tensor parallel and the rest: priced and recorded, not executable yet)
            for mode_ in ("data_parallel", "solver"):
                if mode_ == "solver" and (best is not None or base.memory_limit_bytes is None):
                    break
                for m in ms:
                    sr = search_stages(n_units, world, batch, unit_cost_of(mode_), cut, stage_counts=[s_count],
                                       tps=(size,), microbatches=m, schedule=sched_name, virtual=virtual,
                                       memory_limit_bytes=base.memory_limit_bytes)
                    records.extend({**{k: v for k, v in op.to_json().items() if k not in ("dp", "tp")},
                                    "sub_mesh_ranks": size, "sub_plans": mode_} for op in sr.options)
                    if sr.best is not None and (best is None or sr.best.step_s < best.step_s):
                        best, sub_mode = sr.best, mode_
            if best is None:
                why = next((r["refused"] for r in reversed(records) if r.get("stages") == s_count and "refused" in r),
                           "nothing fits")
                cands.append(Candidate(NAME, f"pipeline {s_count} stages", illegal=why, priority=self.priority,
                                       forced=mode == "fixed"))
                continue
            layout = even_layout(n_units, world, s_count, Schedule(sched_name, best.microbatches, virtual),
                                 cuts=best.cuts if virtual == 1 else None)   # V chunks: cut evenly
            p = best.price
            pred = StepPrediction(step_time_s=p.step_s, fwd_s=0.0, bwd_s=0.0, grad_sync_s=p.sync_tail_s,
                                  exposed_comm_s=p.send_s, optimizer_s=0.0,
                                  memory_per_rank_bytes=max(p.peak_bytes), grad_sync_bytes=0.0)
            cands.append(Candidate(NAME, f"pipeline {s_count} stages x M {best.microbatches} ({sched_name})", pred,
                                   table=base.table, choice=tuple(base.solution.choice), runtime="stages",
                                   forced=mode == "fixed", priority=self.priority,
                                   note=f"pipeline stages: {layout.to_json()['stages']}",
                                   detail={"layout": layout.to_json(), "price": p.to_json(), "priced": records,
                                           "sub_plans": sub_mode,
                                           "sub_plan_kinds": list(subplans[(sub_mode, best.tp, best.microbatch)][1]),
                                           "executable": sub_mode == "data_parallel"}))
        if mode == "fixed" and all(c.illegal for c in cands):
            fits = sorted({r["stages"] for r in records if "refused" not in r})
            raise PipelineError(f"--pipeline {fixed} leaves a stage without memory or the batch unsplit "
                                f"({cands[0].illegal if cands else 'nothing priced'})",
                                f"feasible stage counts: {fits or 'none'}; raise --memory-limit or the batch")
        return tuple(cands)

    def record(self, base, choice) -> dict:
        c = choice.chosen
        mine = [x for x in choice.candidates if x.strategy == NAME]
        if not mine:
            return {}
        priced = [r for x in mine if x.detail for r in x.detail["priced"]]
        if c.strategy != NAME:
            return {"pipeline_considered": priced}
        return {"runtime": {"expected": "stages", "step_time_s": c.step_time_s,
                            "reason": f"{c.label}: predicted {c.step_time_s * 1e3:.3f} ms, the fastest legal plan",
                            "stages": c.detail["layout"], "price": c.detail["price"],
                            "sub_plans": c.detail["sub_plans"], "sub_plan_kinds": c.detail["sub_plan_kinds"],
                            "executable": c.detail["executable"],
                            "stage_counts_priced": priced}}


def _unit_costs(base, world: int, batch: int, units: list[int], n_units: int,
                mode: str = "data_parallel") -> tuple[list[StageCost], tuple[str, ...]]:
    """The model planned on ``world`` ranks for ``batch`` samples (one microbatch of a stage),
    its per-layer costs summed per block, and the decomposition kinds the sub-plan uses. Modes:
    "data_parallel" (sample / replicate, no limit) or "solver" (the request's kinds, under S x
    half the request's memory limit)."""
    from ..make import make_plan      # the planner itself, one level down (see tests/test_layering.py)
    o = base.req.options
    kinds = ("sample", "replicate") if mode == "data_parallel" else o.kinds
    # the sub-plan is of the whole model, of which a stage holds 1/S: its per-layer choices are
    # made under S x half the limit (half: room for the microbatches in flight); the search then
    # holds each stage's real memory (static + in flight) to the limit
    stages = max(1, base.req.world // world)
    limit = None if mode == "data_parallel" else base.memory_limit_bytes / 2 * stages
    sub = dataclasses.replace(o, world_size=world, batch_size=batch, write=False, out_dir=None, pipeline="off",
                              kinds=kinds, placement="block", memory_limit_bytes=limit, pins=())
    try:
        res = make_plan(base.loaded.model_file, sub, PlanHooks(profile=base.loaded.profile, graph=None))
    except InfeasiblePlan:           # no sub-plan fits: every unit over any limit
        return [StageCost(float("inf"), float("inf"), 0.0, float("inf"), float("inf"))] * n_units, ()
    tab, ch = res.table, list(res.solution.choice)
    sub_units = block_units(tab.graph) or units
    acc = [[0.0] * 5 for _ in range(n_units)]
    for li, u in enumerate(sub_units):
        c = tab.layers[li].costs[ch[li]]
        a = acc[u]
        a[0] += c.fwd_s
        a[1] += c.bwd_s
        a[2] += c.grad_sync_s + c.optim_step_s
        a[3] += c.activation_bytes + c.workspace_bytes
        a[4] += c.param_bytes + c.grad_bytes + c.optim_bytes
    kinds_used = tuple(sorted({tab.layers[li].choices[ch[li]].kind for li in range(len(ch))}))
    return [StageCost(*a) for a in acc], kinds_used


_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}


def crossing_values(graph, units: list[int]) -> dict[int, list[tuple[str, float]]]:
    """Per unit boundary u (between unit u and u+1), the values produced at or before u and
    consumed after it, with their traced bytes (the whole traced batch). A value consumed by an
    earlier unit than the one producing it would cross a cut backwards: refused, naming it."""
    produced: dict[str, tuple[int, float]] = {}
    for lay, u in zip(graph.layers, units):
        for op in lay.ops:
            n = 1
            for d in op.out_shape:
                n *= int(d)
            produced[op.name] = (u, float(n * _DTYPE_BYTES.get(str(op.dtype).replace("torch.", ""), 4)))
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
    n_units = max(units) + 1
    out: dict[int, list[tuple[str, float]]] = {u: [] for u in range(n_units - 1)}
    for v, lu in last_use.items():
        pu, nbytes = produced[v]
        for u in range(pu, lu):
            out[u].append((v, nbytes))
    return out


def _cut_bytes(graph, units: list[int], samples: int, batch: int) -> float:
    """Bytes one rank sends over a cut for ``samples`` samples of a microbatch: the largest
    boundary's crossing values (every boundary of a uniform block model carries the same), scaled
    from the traced batch."""
    cross = crossing_values(graph, units)
    per_batch = max((sum(b for _, b in vals) for vals in cross.values()), default=0.0)
    return per_batch * samples / max(1, batch)
