"""The plan artifact: a versioned JSON file, loadable without a process group.

Schema ``autopar.plan/1`` (top-level keys):
    schema, created, autopar_version
    model        {path, sha256, name, batch_size, tracer}
    world_size   int;  mesh {world_size, ranks_per_node, nodes, placement}
                 placement {kind: "stride", local_stride: S}: which physical slot runs each
                 logical rank (``autopar.decomp.placement``); absent (older plans) = block,
                 the identity. The runtime applies it at process-group init.
    placement_search {mode, chosen, chosen_name, min_gain, max_solved, tried: [{placement, name, solved,
                  step_time_s, gain_bound_s, step_time_at_least_s, note}]}: every placement
                  priced, the predicted step time of those solved, the bound on every other
                  (at most gain_bound_s faster than block; ``autopar.solve.placement``)
    calibration  {path, fingerprint, provenance}
    solver       {solver, status, sol_status, time_s, gap, objective_s, variables, constraints,
                  memory_limit_bytes, candidates, notes}
    predicted    {step_time_s, fwd_s, bwd_s, grad_sync_s, exposed_comm_s, optimizer_s,
                  memory_per_rank_bytes, grad_sync_bytes}
    layers       [{layer, name, module, kinds, decomposition, choice, in_layouts, out_layout,
                   predicted (LayerCost), source, alternatives}]
    transitions  [{src, dst, value, src_layout, dst_layout, fwd_s, bwd_s}]
    graph        the layer graph (LayerGraphData JSON)
    generated    file name of the generated module beside plan.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import PlanFileError
from ..io import read_json

PLAN_SCHEMA = "autopar.plan/1"
REQUIRED = ("schema", "model", "world_size", "mesh", "calibration", "solver", "predicted",
            "layers", "graph", "generated")


def load_plan(path: str | Path, world_size: int | None = None) -> dict[str, Any]:
    """Read and check a plan file; PlanFileError (named, says what to do) otherwise."""
    plan = read_json(path, PlanFileError, "plan file")
    if not isinstance(plan, dict) or "schema" not in plan:
        raise PlanFileError(f"{path} is not an autopar plan (no schema field)", "run `autopar plan` to make one")
    if plan["schema"] != PLAN_SCHEMA:
        raise PlanFileError(f"{path} has schema {plan['schema']!r}; this autopar reads {PLAN_SCHEMA!r}",
                            "re-plan with this version of autopar")
    missing = [k for k in REQUIRED if k not in plan]
    if missing:
        raise PlanFileError(f"{path} is incomplete: missing {', '.join(missing)}", "re-plan")
    if isinstance(plan["mesh"], dict) and plan["mesh"].get("placement") is not None:
        from ..decomp.placement import Placement
        from ..errors import PlacementError
        try:
            Placement.from_json(plan["mesh"]["placement"], int(plan["world_size"]))
        except PlacementError as e:
            raise PlanFileError(f"{path} has a bad mesh.placement: {e.message}", "re-plan") from None
    if world_size is not None and int(plan["world_size"]) != int(world_size):
        raise PlanFileError(f"{path} was made for world size {plan['world_size']}, not {world_size}",
                            f"re-plan with --world-size {world_size}")
    return plan
