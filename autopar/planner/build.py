"""Stage 6, build: the typed plan (``artifacts.Plan``) of the chosen table and choice, checked
like a loaded one (``artifacts.check_plan``)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
from pathlib import Path

from .. import __version__
from ..artifacts import (PLAN_SCHEMA, LayerDecision, MeshInfo, ModelRef, Plan, Prediction, SolverInfo,
                         RuntimeRecord, StrategyAlternative, TransitionDecision, check_plan)
from ..decomp.redistribute import steps_str
from ..decomp.transition import plan_layouts
from ..io import sha256_file
from ..pins import check_plan_level
from ..profile.speed import profile_nominal_s
from .choose import Chosen
from .load import Loaded, Request
from .price import Priced
from .solve import Solved
from .write import rel_path


def layer_decisions(table, choice, world: int) -> tuple[LayerDecision, ...]:
    """One ``LayerDecision`` per layer: the choice, its input and output placements (DTensor's
    vocabulary: one placement per mesh axis, outermost first), its price and every kept alternative."""
    out = []
    for lay, o, ci in zip(table.graph.layers, table.layers, choice):
        dec, c = o.choices[ci], o.costs[ci]
        out.append(LayerDecision.from_json({
            "layer": lay.index, "name": lay.name, "module": lay.module,
            "kinds": [op.kind for op in lay.ops], "out_shape": lay.out_shape,
            "decomposition": dec.to_json(), "choice": str(dec),
            # axes named for each tensor's rank (``Sharding.named_for``: dim 2 of a 5-d tensor is D)
            "in_placements": {v: dec.in_placement(lay, v).named_for(len(lay.value_shape(v))).to_json(world)
                              for v in lay.inputs},
            "out_placement": dec.out_placement(lay).named_for(len(lay.out_shape)).to_json(world),
            "placements": {"in": {v: dec.in_placement(lay, v).placements_str(world) for v in lay.inputs},
                           "out": {v: dec.out_placement(lay, v).placements_str(world) for v in lay.outputs}},
            "predicted": c.to_json(), "source": c.source,
            "exact_keys": o.exact_keys[ci] if o.exact_keys else [],
            "alternatives": [{"choice": str(d), "time_s": k.fwd_s + k.bwd_s + k.grad_sync_s,
                              "memory_bytes": k.memory_bytes} for d, k in zip(o.choices, o.costs)],
            "illegal": o.illegal,
        }))
    return tuple(out)


def transitions(table, choice, world: int) -> tuple[TransitionDecision, ...]:
    """The redistributions between layers whose placements differ (owned blocks), with their
    planned steps."""
    graph, out = table.graph, []
    for e in table.edges:
        i, j = choice[e.src], choice[e.dst]
        src = table.layers[e.src].choices[i].out_placement(graph.layers[e.src], e.value)
        dst = table.layers[e.dst].choices[j].in_placement(graph.layers[e.dst], e.value)
        if src.owned() != dst.owned():     # into a HaloShard: the layer exchanges its halo
            shape = tuple(int(n) for n in graph.value_shape(e.value))
            steps = plan_layouts(src, dst, shape, world)
            src, dst = src.named_for(len(shape)), dst.named_for(len(shape))
            out.append(TransitionDecision(
                src=e.src, dst=e.dst, value=e.value, src_placement=str(src), dst_placement=str(dst),
                fwd_s=e.fwd_s[i][j], bwd_s=e.bwd_s[i][j],
                extra={"src_placements": src.placements_str(world), "dst_placements": dst.placements_str(world),
                       "steps": steps_str(steps)}))
    return tuple(out)


def solver_info(table, sol, memory_limit_bytes, graph_parallel) -> SolverInfo:
    info = sol.to_json()
    info.update({"memory_limit_bytes": memory_limit_bytes, "candidates": table.size(),
                 "max_candidates_per_layer": table.ctx.max_candidates})
    if any(len(o.choices) >= table.ctx.max_candidates for o in table.layers):
        info["notes"] = list(info.get("notes", [])) + [
            f"optimal over the candidates kept per layer (at most {table.ctx.max_candidates}, "
            f"cost_table._pareto); --max-candidates keeps more"]
    if graph_parallel is not None:
        info["graph_parallel"] = graph_parallel
    return SolverInfo.from_json(info)


def calibration_record(loaded: Loaded, priced: Priced) -> dict:
    """Where the prices came from: the profile (path, fingerprint, provenance), its nominal
    speed-probe reading, the machine speed applied, and the shape file read (if any)."""
    prof = loaded.profile
    rec = {"path": str(loaded.cal_path) if loaded.cal_path else None, "fingerprint": prof.fingerprint,
           "provenance": prof.provenance}
    nominal = profile_nominal_s(prof)
    if nominal:
        rec["speed_probe_nominal_s"] = nominal
    rec["machine_speed"] = priced.speed_json()
    if loaded.shapes is not None:
        rec["shapes"] = loaded.shapes.to_json()
    return rec


def pin_marks(chosen: Chosen, req: Request, layers) -> dict[int, str]:
    """Layer index -> the pin that fixed it; ``*=graphs`` marks every layer (plan-level)."""
    if req.force_graphs and req.options.pins:
        check_plan_level(req.options.pins[0], [d.choice for d in layers])
        return {d.layer: str(req.options.pins[0]) for d in layers}
    return chosen.pin_marks


def build(loaded: Loaded, priced: Priced, solved: Solved, chosen: Chosen, req: Request,
          out_dir: Path) -> Plan:
    o, world, table, sol = req.options, req.world, chosen.table, chosen.solution
    layers = layer_decisions(table, sol.choice, world)
    marks = pin_marks(chosen, req, layers)
    layers = tuple(dataclasses.replace(d, pinned=marks[d.layer]) if d.layer in marks else d for d in layers)
    mf = loaded.mf
    plan = Plan(
        schema=PLAN_SCHEMA,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        autopar_version=__version__, plan_file="plan.json",
        model=ModelRef(path=rel_path(loaded.model_file, out_dir), sha256=sha256_file(loaded.model_file),
                       name=mf.name, batch_size=loaded.batch_size, tracer=table.graph.tracer),
        mesh=MeshInfo(world_size=world, ranks_per_node=loaded.ranks_per_node, nodes=loaded.nodes,
                      local_stride=solved.placed.placement.local_stride),
        placement_search=solved.placed.to_json(),
        calibration=calibration_record(loaded, priced),
        solver=solver_info(table, sol, o.memory_limit_bytes, chosen.records.get("graph_parallel")),
        predicted=Prediction.from_json(chosen.prediction.to_json()),
        layers=layers, transitions=transitions(table, sol.choice, world),
        graph_json=table.graph.to_json(), generated=f"{mf.name.replace('-', '_')}_dist.py",
        options=o, batch_norm=priced.bn.to_json(),
        runtime=RuntimeRecord.from_json(chosen.records["runtime"]) if "runtime" in chosen.records else None,
        strategies=tuple(StrategyAlternative.from_json(c.to_json(c is chosen.choice.chosen))
                         for c in chosen.choice.candidates))
    check_plan(plan, f"the plan made for {mf.name}")
    return plan
