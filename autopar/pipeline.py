"""``make_plan``: model file -> layer graph -> cost table -> ILP -> plan.json + generated module.

Each stage reads one artifact and writes the next; this module only strings them together and
writes the results atomically. Planning starts no processes: ``world_size=1024`` plans a
simulated run on the profile's (or the given) cluster shape.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from . import __version__
from .codegen.plan import PLAN_SCHEMA
from .errors import AutoparError
from .io import atomic_write_json, atomic_write_text, sha256_file


@dataclass
class PlanResult:
    plan: dict[str, Any]
    plan_path: Path | None
    module_path: Path | None
    table: Any
    solution: Any
    timings_s: dict[str, float]


def parse_bytes(text: str | None) -> float | None:
    """'512MiB', '2GB', '1.5GiB', '1000000' -> bytes."""
    if text is None:
        return None
    t = str(text).strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6,
             "gb": 1e9, "tb": 1e12, "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    for u, f in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            try:
                return float(t[: -len(u)]) * f
            except ValueError:
                break
    try:
        return float(t)
    except ValueError:
        raise AutoparError(f"cannot read memory size {text!r}", "write e.g. 512MiB, 2GiB or a number of bytes") from None


def load_calibration(path: str | Path | None, check_machine: bool = True):
    from .calibrate.profile import check_fingerprint, default_profile_path, load_profile
    if path is None:
        path = default_profile_path()
    prof = load_profile(path, check_machine=False)
    if check_machine and prof.provenance.get("kind") == "measured":
        check_fingerprint(prof, path)  # warns, naming the fields that differ
    return Path(path), prof


def make_plan(model_file: str | Path, world_size: int, batch_size: int | None = None,
              calibration: str | Path | None = None, out_dir: str | Path | None = None,
              memory_limit_bytes: float | None = None, ranks_per_node: int | None = None,
              nodes: int | None = None, kinds: list[str] | None = None,
              time_limit_s: float = 60.0, solver: str = "highs", max_candidates: int = 8,
              force: dict[int, str] | None = None, write: bool = True,
              progress: Callable[[str], None] | None = None,
              optimizer_state_per_param: float = 1.0, profile=None, graph=None,
              choice_filter=None, placement: str | int = "search",
              trace_cache: bool = True) -> PlanResult:
    """Plan ``model_file`` for ``world_size`` ranks. ``force`` maps layer index -> str of a
    decomposition to pin (for forced alternative plans in benchmarks). ``placement``: "search"
    (plan under block placement and each candidate local stride, keep the fastest; only block
    on one node), "block" (logical rank = physical rank), or an integer local stride
    (``autopar.decomp.placement``, ``autopar.solve.placement``). ``trace_cache``: reuse the
    traced graph of an unchanged model file (``autopar.trace.cache``)."""
    from .codegen.generate import generate_module
    from .cost.table import build_cost_table, evaluate
    from .decomp.base import CostContext
    from .modelfile import load_model_file
    from .solve.ilp import solve
    from .solve.placement import placements_for, search_placement
    from .trace.cache import trace_cached

    say = progress or (lambda s: None)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    model_file = Path(model_file)
    mf = load_model_file(model_file)
    if batch_size is None:
        batch_size = mf.default_batch_size() or max(8, world_size)
    if profile is None:
        cal_path, profile = load_calibration(calibration)
    else:
        cal_path = Path(calibration) if calibration else None
    rpn = int(ranks_per_node or profile.topology.get("ranks_per_node", world_size))
    n_nodes = int(nodes or max(1, math.ceil(world_size / rpn)))
    if rpn * n_nodes < world_size:
        raise AutoparError(f"{n_nodes} nodes x {rpn} ranks per node < world size {world_size}",
                           "raise --nodes or --ranks-per-node")
    profile = profile.with_topology(rpn, n_nodes)
    placements_for(placement, world_size, rpn)   # a bad --placement fails before tracing
    timings["load_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    cached = False
    if graph is None:
        graph, cached = trace_cached(mf, batch_size, use_cache=trace_cache)
    timings["trace_s"] = time.perf_counter() - t
    say(f"traced {mf.name}: {len(graph.layers)} layers ({graph.tracer}"
        f"{', from the trace cache' if cached else ''}) in {timings['trace_s']:.2f} s")

    ctx = CostContext(profile=profile, world=world_size, ranks_per_node=rpn,
                      optimizer_state_per_param=optimizer_state_per_param, batch_size=batch_size,
                      max_candidates=max_candidates)
    tables_s = []

    def build(c):
        t = time.perf_counter()
        tab = build_cost_table(graph, c, kinds=kinds, choice_filter=choice_filter)
        if force:
            _pin(tab, force)
        tables_s.append(time.perf_counter() - t)
        return tab

    solves = []

    def solve_table(tab):
        t = time.perf_counter()
        s = solve(tab, memory_limit_bytes=memory_limit_bytes, time_limit_s=time_limit_s, solver=solver)
        solves.append((time.perf_counter() - t, s))
        return s

    placed = search_placement(ctx, placement, build, solve_table, evaluate)
    table, sol, pred = placed.table, placed.solution, placed.prediction
    timings["cost_s"] = sum(tables_s)
    timings["solve_s"] = sum(t for t, _ in solves)
    say(f"priced {table.size()['choices']} layer choices and {table.size()['pairs']} transitions "
        f"in {tables_s[0]:.2f} s" + (f" (+{sum(tables_s[1:]):.2f} s for {len(tables_s) - 1} more "
                                      f"placements)" if len(tables_s) > 1 else ""))
    say(f"solved with {sol.solver} in {sol.time_s:.2f} s ({sol.status}, gap {sol.gap})"
        + (f"; {len(solves)} placements solved in {timings['solve_s']:.2f} s" if len(solves) > 1 else ""))
    say(placed.summary())

    out_dir = Path(out_dir) if out_dir is not None else default_plan_dir(mf.name, world_size)
    plan = _plan_json(mf, model_file, out_dir, world_size, rpn, n_nodes, batch_size, cal_path,
                      profile, table, sol, pred, memory_limit_bytes, placed)
    plan["timings_s"] = timings
    plan_path = module_path = None
    if write:
        t = time.perf_counter()
        out_dir.mkdir(parents=True, exist_ok=True)
        module_path = out_dir / plan["generated"]
        atomic_write_text(module_path, generate_module(plan))
        plan_path = out_dir / "plan.json"
        timings["write_s"] = time.perf_counter() - t
        plan["timings_s"] = timings
        atomic_write_json(plan_path, plan)
    return PlanResult(plan, plan_path, module_path, table, sol, timings)


def default_plan_dir(model_name: str, world: int) -> Path:
    return Path("strategies") / "plans" / f"{model_name}-w{world}"


def _pin(table, force: dict[int, str]) -> None:
    for li, want in force.items():
        o = table.layers[li]
        idx = [i for i, d in enumerate(o.choices) if str(d) == want or d.kind == want]
        if not idx:
            raise AutoparError(f"layer {li}: {want} is not a legal (kept) choice; choices: "
                               f"{[str(d) for d in o.choices]}", "pick one of the listed choices")
        keep = idx[0]
        o.choices, o.costs = [o.choices[keep]], [o.costs[keep]]
        if o.exact_keys:
            o.exact_keys = [o.exact_keys[keep]]
        for e in table.edges:
            if e.src == li:
                e.fwd_s, e.bwd_s = [e.fwd_s[keep]], [e.bwd_s[keep]]
            if e.dst == li:
                e.fwd_s = [[row[keep]] for row in e.fwd_s]
                e.bwd_s = [[row[keep]] for row in e.bwd_s]


def _rel(path: Path, base: Path) -> str:
    import os
    try:
        return os.path.relpath(path.resolve(), base.resolve())
    except ValueError:
        return str(path.resolve())


def _plan_json(mf, model_file: Path, out_dir: Path, world: int, rpn: int, n_nodes: int,
               batch: int, cal_path, profile, table, sol, pred, memory_limit_bytes,
               placed) -> dict[str, Any]:
    graph = table.graph
    layers = []
    for lay, o, ci in zip(graph.layers, table.layers, sol.choice):
        dec = o.choices[ci]
        c = o.costs[ci]
        layers.append({
            "layer": lay.index, "name": lay.name, "module": lay.module,
            "kinds": [op.kind for op in lay.ops], "out_shape": lay.out_shape,
            "decomposition": dec.to_json(), "choice": str(dec),
            "in_layouts": {v: dec.in_layout(lay, v).to_json() for v in lay.inputs},
            "out_layout": dec.out_layout(lay).to_json(),
            "predicted": c.to_json(), "source": c.source,
            "exact_keys": o.exact_keys[ci] if o.exact_keys else [],
            "alternatives": [{"choice": str(d), "time_s": k.fwd_s + k.bwd_s + k.grad_sync_s,
                              "memory_bytes": k.memory_bytes} for d, k in zip(o.choices, o.costs)],
            "illegal": o.illegal,
        })
    transitions = []
    for e in table.edges:
        i, j = sol.choice[e.src], sol.choice[e.dst]
        src = table.layers[e.src].choices[i].out_layout(graph.layers[e.src], e.value)
        dst = table.layers[e.dst].choices[j].in_layout(graph.layers[e.dst], e.value)
        if src != dst:
            transitions.append({"src": e.src, "dst": e.dst, "value": e.value,
                                "src_layout": str(src), "dst_layout": str(dst),
                                "fwd_s": e.fwd_s[i][j], "bwd_s": e.bwd_s[i][j]})
    solver = sol.to_json()
    solver.update({"memory_limit_bytes": memory_limit_bytes, "candidates": table.size(),
                   "max_candidates_per_layer": table.ctx.max_candidates})
    if any(len(o.choices) >= table.ctx.max_candidates for o in table.layers):
        solver["notes"] = list(solver.get("notes", [])) + [
            f"optimal over the candidates kept per layer (at most {table.ctx.max_candidates}, "
            f"cost_table._pareto); --max-candidates keeps more"]
    fp = profile.fingerprint
    return {
        "schema": PLAN_SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "autopar_version": __version__,
        "plan_file": "plan.json",
        "model": {"path": _rel(model_file, out_dir), "sha256": sha256_file(model_file),
                  "name": mf.name, "batch_size": batch, "tracer": graph.tracer},
        "world_size": world,
        "mesh": {"world_size": world, "ranks_per_node": rpn, "nodes": n_nodes,
                 "placement": placed.placement.to_json()},
        "placement_search": placed.to_json(),
        "calibration": {"path": str(cal_path) if cal_path else None, "fingerprint": fp,
                        "provenance": profile.provenance},
        "solver": solver,
        "predicted": pred.to_json(),
        "layers": layers,
        "transitions": transitions,
        "graph": graph.to_json(),
        "generated": f"{mf.name.replace('-', '_')}_dist.py",
    }


def format_plan_table(plan: dict[str, Any], max_rows: int = 60) -> str:
    rows = [f"{'#':>3} {'module':<22} {'ops':<22} {'out shape':<18} {'decomposition':<16} "
            f"{'fwd ms':>8} {'bwd ms':>8} {'sync ms':>8} {'mem MiB':>8} src"]
    ls = plan["layers"]
    show = ls if len(ls) <= max_rows else ls[: max_rows // 2] + [None] + ls[-max_rows // 2:]
    for r in show:
        if r is None:
            rows.append(f"{'...':>3} ({len(ls) - max_rows} more layers)")
            continue
        p = r["predicted"]
        rows.append(f"{r['layer']:>3} {(r['module'] or r['name'])[:22]:<22} {'+'.join(r['kinds'])[:22]:<22} "
                    f"{str(tuple(r['out_shape']))[:18]:<18} {r['choice'][:16]:<16} "
                    f"{(p['fwd_compute_s'] + p['fwd_comm_s']) * 1e3:8.3f} "
                    f"{(p['bwd_compute_s'] + p['bwd_comm_s']) * 1e3:8.3f} {p['grad_sync_s'] * 1e3:8.3f} "
                    f"{p['memory_bytes'] / 2**20:8.2f} {r['source']}")
    pr = plan["predicted"]
    s = plan["solver"]
    rows.append("")
    rows.append(f"transitions: {len(plan['transitions'])}  " + ", ".join(
        f"{t['value']}: {t['src_layout']}->{t['dst_layout']}" for t in plan["transitions"][:6]))
    rows.append(f"predicted step time: {pr['step_time_s'] * 1e3:.3f} ms (fwd {pr['fwd_s'] * 1e3:.3f}, "
                f"bwd {pr['bwd_s'] * 1e3:.3f}, exposed comm {pr['exposed_comm_s'] * 1e3:.3f}, "
                f"optimizer {pr['optimizer_s'] * 1e3:.3f}); memory {pr['memory_per_rank_bytes'] / 2**20:.1f} MiB per rank")
    gap = "n/a" if s["gap"] is None else f"{s['gap']:.2g}"
    rows.append(f"solver: {s['solver']} {s['status']} in {s['time_s']:.2f} s, gap {gap}, "
                f"{s['variables']} variables")
    return "\n".join(rows)
