"""``make_plan``: the stages in order, load -> trace -> price -> solve -> choose -> build ->
write, each a function over typed values (``planner.load`` ... ``planner.write``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifacts import Plan, PlanHooks, PlanOptions
from .build import build
from .choose import choose
from .load import load, request
from .price import price
from .shapes import missing_shapes
from .strategies import check_kinds, strategy_kinds
from .solve import solve
from .trace import trace
from .write import default_plan_dir, with_timings, write_module, write_plan_file


@dataclass(frozen=True)
class PlanResult:
    """What ``make_plan`` returns: the typed plan, where it was written (None if not), the cost
    table and solution it came from (for benchmarks and tests), where the time went, and the
    competitive local shapes the profile lacks (``planner.shapes``; measure them first with
    ``autopar plan --measure-shapes``)."""
    plan: Plan
    plan_path: Path | None
    module_path: Path | None
    table: Any
    solution: Any
    timings_s: dict[str, float]
    missing_shapes: tuple[str, ...] = ()


def make_plan(model_file: str | Path, options: PlanOptions, hooks: PlanHooks | None = None) -> PlanResult:
    """Plan ``model_file`` as ``options`` say (``artifacts.PlanOptions``: world size, batch,
    profile, shape file, cluster shape, kinds, solver, placement, pins, output folder...).
    ``hooks`` (``PlanHooks``) are for tests and benchmarks: pinned decompositions, a candidate
    filter, a profile or traced graph given in memory, progress lines. ``options.pins``
    (``autopar.pins``) fix the matching layers' choices in every table priced, before any
    solver or strategy sees it; plan.json marks those layers and records the options.
    Starts no process: missing shapes are named (``PlanResult.missing_shapes``), not measured."""
    if not isinstance(options, PlanOptions):
        raise TypeError("make_plan(model_file, PlanOptions(...), hooks=None): options must be a PlanOptions")
    hooks = hooks or PlanHooks()
    t0 = time.perf_counter()
    check_kinds(options.kinds)
    req = request(options, hooks, tuple(strategy_kinds()))
    loaded = load(model_file, req, hooks)
    timings = {"load_s": time.perf_counter() - t0}
    traced = trace(loaded, req, hooks.graph)
    timings["trace_s"] = traced.trace_s
    priced = price(loaded, traced, req)
    solved = solve(traced, priced, req)
    timings.update(solved.timings_s)
    chosen = choose(loaded, solved, req, replan=make_plan)
    missing = missing_shapes(loaded, solved, hooks, req)
    out_dir = Path(options.out_dir) if options.out_dir is not None else default_plan_dir(loaded.mf.name,
                                                                                         options.world_size)
    plan = build(loaded, priced, solved, chosen, req, out_dir)
    plan_path = module_path = None
    if options.write:
        t = time.perf_counter()
        module_path = write_module(plan, out_dir)
        timings["write_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t0
    plan = with_timings(plan, timings)
    if options.write:
        plan_path = write_plan_file(plan, out_dir)
    return PlanResult(plan, plan_path, module_path, chosen.table, chosen.solution, timings, missing)
