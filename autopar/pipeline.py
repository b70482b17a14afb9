"""``make_plan``: model file -> layer graph -> cost table -> ILP -> plan.json + generated module.

Each stage reads one artifact and writes the next; this module only strings them together and
writes the results atomically (the typed plan and its JSON: ``autopar.artifacts``). Planning starts no processes: ``world_size=1024`` plans a
simulated run on the profile's (or the given) cluster shape.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__
from .artifacts import (PLAN_SCHEMA, Plan, PlanHooks, PlanOptions, write_plan)
from .calibrate.speed import profile_nominal_s
from .errors import AutoparError
from .io import atomic_write_text, sha256_file


@dataclass(frozen=True)
class PlanResult:
    """What ``make_plan`` returns: the typed plan, where it was written (None if not), and the
    cost table and solution it came from (for benchmarks and tests)."""
    plan: Plan
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


_LOADED: dict = {}   # (path, mtime, size) -> profile: a long-lived process re-plans without re-reading


_TOPOLOGY: dict = {}  # (profile read by load_calibration, rpn, nodes) -> (it, its copy for that shape)


def _with_topology(profile, rpn: int, n_nodes: int):
    """``profile.with_topology`` (a deep copy, raw samples and all) once per profile read by
    ``load_calibration`` and cluster shape; planning only reads it."""
    key = (id(profile), rpn, n_nodes)
    hit = _TOPOLOGY.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    if len(_TOPOLOGY) > 8:
        _TOPOLOGY.clear()
    out = profile.with_topology(rpn, n_nodes)
    _TOPOLOGY[key] = (profile, out)
    return out


def load_calibration(path: str | Path | None, check_machine: bool = True):
    """(path, profile); a profile file read before in this process and unchanged since (same
    modification time and size) is not read, validated and fitted again. Planning never
    changes the profile it is given (``Profile.with_topology`` copies)."""
    from .calibrate.profile import check_fingerprint, default_profile_path, load_profile
    if path is None:
        path = default_profile_path()
    try:
        st = Path(path).stat()
        key = (str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    prof = _LOADED.get(key) if key is not None else None
    if prof is None:
        prof = load_profile(path, check_machine=False)
        if key is not None:
            _LOADED.clear()        # one profile kept: the one a session re-plans with
            _LOADED[key] = prof
    if check_machine and prof.provenance.get("kind") == "measured":
        check_fingerprint(prof, path)  # warns, naming the fields that differ
    return Path(path), prof


def make_plan(model_file: str | Path, options: PlanOptions, hooks: PlanHooks | None = None) -> PlanResult:
    """Plan ``model_file`` as ``options`` say (``autopar.artifacts.PlanOptions``: world size,
    batch, profile, cluster shape, kinds, solver, placement, output folder...). ``hooks``
    (``PlanHooks``) are for tests and benchmarks: pinned decompositions, a candidate filter, a
    profile or traced graph given in memory, progress lines. ``options.pins`` (``autopar.pins``)
    fix the matching layers' choices in every table priced, before any solver sees it (the
    placement search, the dynamic program, the ILP and the native-runtime choice all choose
    among the pinned table's choices); plan.json marks those layers (``LayerDecision.pinned``)
    and records the options."""
    if not isinstance(options, PlanOptions):
        raise TypeError("make_plan(model_file, PlanOptions(...), hooks=None): options must be a PlanOptions")
    hooks = hooks or PlanHooks()
    from .codegen.generate import generate_module
    from .cost.table import build_cost_table, evaluate, pricing_profile
    from .decomp.base import CostContext
    from .modelfile import load_model_file
    from .solve.ilp import solve
    from .solve.placement import placements_for, search_placement
    from .trace.cache import trace_cached

    o = options
    world_size, batch_size, kinds = o.world_size, o.batch_size, (list(o.kinds) if o.kinds else None)
    memory_limit_bytes, placement = o.memory_limit_bytes, o.placement
    profile, graph, force, choice_filter = hooks.profile, hooks.graph, hooks.force, hooks.choice_filter
    # ``force`` naming graphs(P) on every layer: the plan-level graph-parallel plan, whatever it costs
    force_graphs = bool(force) and all(str(v).split("(")[0] == "graphs" for v in force.values())
    if force_graphs:
        force = None
    # ``--pin``: layer pins, or the plan-level graphs(P) pinned on every layer (``*=graphs``)
    from .pins import plan_level
    layer_pins = tuple(o.pins)
    if layer_pins and plan_level(layer_pins, world_size):
        force_graphs, layer_pins = True, ()
    # graphs(P) is plan-level (no layer choice of the ILP): ``--kinds graphs`` alone asks for it
    table_kinds = [k for k in kinds if k != "graphs"] if kinds else None
    if kinds and not table_kinds:
        force_graphs, table_kinds = True, None
    say = hooks.progress or (lambda s: None)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    model_file = Path(model_file)
    mf = load_model_file(model_file, lazy=True)   # imported (with torch) only if traced
    if batch_size is None:
        batch_size = mf.default_batch_size() or max(8, world_size)
    if profile is None:
        cal_path, profile = load_calibration(o.calibration)
    else:
        cal_path = Path(o.calibration) if o.calibration else None
    rpn = int(o.ranks_per_node or profile.topology.get("ranks_per_node", world_size))
    n_nodes = int(o.nodes or max(1, math.ceil(world_size / rpn)))
    if rpn * n_nodes < world_size:
        raise AutoparError(f"{n_nodes} nodes x {rpn} ranks per node < world size {world_size}",
                           "raise --nodes or --ranks-per-node")
    if hooks.profile is None:
        profile = _with_topology(profile, rpn, n_nodes)
    else:
        profile = profile.with_topology(rpn, n_nodes)
    placements_for(placement, world_size, rpn)   # a bad --placement fails before tracing
    ondemand = None
    if o.measure_shapes and hooks.profile is None and cal_path is not None:
        from .calibrate.ondemand import OnDemand
        ondemand = OnDemand(cal_path, profile, world_size, say, o.measure_budget_s)
        profile = ondemand.profile            # with the shapes measured on demand before
    timings["load_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    cached = False
    if graph is None:
        graph, cached = trace_cached(mf, batch_size, use_cache=o.trace_cache)
        graph = attention_units(graph)
    timings["trace_s"] = time.perf_counter() - t
    say(f"traced {mf.name}: {len(graph.layers)} layers ({graph.tracer}"
        f"{', from the trace cache' if cached else ''}) in {timings['trace_s']:.2f} s")
    if graph.unregistered:
        from .ops import describe_unregistered
        say(describe_unregistered(graph.unregistered))

    bn = batch_norm_stats(o, graph, batch_size, world_size)
    if bn.local:
        say(f"batch-norm statistics: local, per group of {bn.group} samples (what torch DDP computes)")
    elif o.batch_norm == "local":
        say(f"batch-norm statistics: global (batch {batch_size} does not split evenly over {world_size} "
            f"ranks, so no per-rank group exists; --bn-group G chooses local groups)")
    machine, machine_why = None, "off (the default; --speed-history opts in)"
    if o.speed_history:
        from .calibrate.history import usual_speed
        machine, machine_why = usual_speed(profile)
    if machine is not None:
        say(f"machine speed: the probe usually reads {machine.usual_probe_s * 1e3:.2f} ms here "
            f"({machine.events} readings), the profile's kernels were measured at "
            f"{machine.profile_nominal_s * 1e3:.2f} ms: local compute priced at {machine.priced_at_s * 1e3:.2f} ms "
            f"between them, x{machine.factor:.3f}")
    ctx = CostContext(profile=pricing_profile(profile), world=world_size, ranks_per_node=rpn,
                      optimizer_state_per_param=o.optimizer_state_per_param, batch_size=batch_size,
                      max_candidates=o.max_candidates, batch_norm=bn,
                      speed_factor=machine.factor if machine is not None else 1.0,
                      loss_output=vocab_loss_output_cached(mf, graph, batch_size, o.trace_cache))
    tables_s = []

    pin_marks: dict[int, dict[int, str]] = {}   # id(table) -> {layer index: pin}
    dp_unpinned: dict[int, bool] = {}            # id(table) -> a native data-parallel plan before pinning

    def build(c):
        t = time.perf_counter()
        # transitions are priced when a table is solved (most placements are only bounded)
        tab = build_cost_table(graph, c, kinds=table_kinds, choice_filter=choice_filter, edges=False)
        if layer_pins:
            # pins choose among every legal candidate, also those pruned for price: the
            # pinned layers' options come from the unpruned table, the others' are as unpinned
            from .decomp import REGISTRY
            from .pins import pin_table, resolve
            full = build_cost_table(graph, c, kinds=table_kinds, prune=False, choice_filter=choice_filter,
                                    edges=False)
            from .cost.native import native_choice
            dp_unpinned[id(tab)] = native_choice(tab) is not None
            pin_marks[id(tab)] = pin_table(tab, full, resolve(layer_pins, full, REGISTRY, table_kinds))
        if force:
            _pin(tab, force)
        tables_s.append(time.perf_counter() - t)
        return tab

    solves = []

    edges_s = []     # pricing the transitions of each table solved (first: the first table's)

    def solve_table(tab):
        t = time.perf_counter()
        tab.ensure_edges()
        edges_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        s = solve(tab, memory_limit_bytes=memory_limit_bytes, time_limit_s=o.time_limit_s, solver=o.solver)
        solves.append((time.perf_counter() - t, s))
        return s

    t = time.perf_counter()
    placed = search_placement(ctx, placement, build, solve_table, evaluate)
    search_s = time.perf_counter() - t
    if ondemand is not None:
        if ondemand.reason is not None:
            say(f"exact shapes: not measured on demand: {ondemand.reason}")
        # the re-planned optimum may have competitive shapes of its own: up to 3 rounds
        for _ in range(3):
            t = time.perf_counter()
            if not ondemand.measure_for(placed.table, placed.solution.choice):
                break
            timings["measure_s"] = timings.get("measure_s", 0.0) + time.perf_counter() - t
            say("re-planning with the shapes just measured")
            tables_s.clear()
            solves.clear()
            edges_s.clear()
            ctx = dataclasses.replace(ctx, profile=pricing_profile(ondemand.profile), cost_memo=None)
            t = time.perf_counter()
            placed = search_placement(ctx, placement, build, solve_table, evaluate)
            search_s = time.perf_counter() - t
    table, sol, pred = placed.table, placed.solution, placed.prediction
    # the plan-wide price of running op by op (``cost.native``): the native data-parallel plan
    # is taken when it is predicted at least as fast (never against pinned layers or a filter)
    from .cost.native import choose_runtime
    runtime, rt_pred = choose_runtime(table, sol.choice, evaluate, memory_limit_bytes)
    if layer_pins and runtime.native_dp_step_time_s is None and dp_unpinned.get(id(table)):
        runtime = dataclasses.replace(runtime, reason=f"no native data-parallel plan: the pins "
                                                      f"({', '.join(map(str, layer_pins))}) leave some layer "
                                                      f"without sample over the whole world")
    if runtime.choice != list(sol.choice) and (force or choice_filter is not None):
        runtime = dataclasses.replace(runtime, choice=list(sol.choice), runtime="traced",
                                      step_time_s=runtime.ilp_step_time_s,
                                      reason="layers pinned or filtered: the ILP's plan is kept")
    else:
        if runtime.choice != list(sol.choice):
            sol = dataclasses.replace(sol, choice=runtime.choice, notes=list(sol.notes) + [
                f"replaced by the native data-parallel plan: {runtime.reason}"])
        pred = rt_pred
    say(f"runtime: {runtime.runtime} ({runtime.reason})")
    graph_record = None
    if not force and not layer_pins and (kinds is None or "graphs" in kinds or force_graphs):
        table, sol, pred, graph_record = _graph_parallel_choice(graph, ctx, table, sol, pred,
                                                                memory_limit_bytes, force_graphs, say,
                                                                _example_shares(mf, batch_size, world_size))
    timings["cost_s"] = sum(tables_s) + sum(edges_s)
    timings["solve_s"] = sum(t for t, _ in solves)
    # where the time went (``--verbose``, plan.json): the first table with its transitions,
    # the other placements (their tables, bounds and transitions where solved), the ILP solves
    timings["price_s"] = tables_s[0] + (edges_s[0] if edges_s else 0.0)
    timings["placements_s"] = max(0.0, search_s - timings["price_s"] - timings["solve_s"])
    timings["placements_priced"] = float(len(tables_s))
    timings["placements_solved"] = float(len(solves))
    say(f"priced {table.size()['choices']} layer choices and {table.size()['pairs']} transitions "
        f"in {timings['price_s']:.2f} s" + (f" (+{timings['placements_s']:.2f} s for {len(tables_s) - 1} more "
                                             f"placements)" if len(tables_s) > 1 else ""))
    say(f"solved with {sol.solver} in {sol.time_s:.2f} s ({sol.status}, gap {sol.gap})"
        + (f"; {len(solves)} placements solved in {timings['solve_s']:.2f} s" if len(solves) > 1 else ""))
    say(placed.summary())

    out_dir = Path(o.out_dir) if o.out_dir is not None else default_plan_dir(mf.name, world_size)
    plan = _build_plan(mf, model_file, out_dir, world_size, rpn, n_nodes, batch_size, cal_path,
                       profile, table, sol, pred, memory_limit_bytes, placed)
    marks = pin_marks.get(id(table), {})
    if force_graphs and o.pins:          # ``*=graphs``: every layer, the plan-level choice
        from .pins import check_plan_level
        check_plan_level(o.pins[0], [d.choice for d in plan.layers])
        marks = {d.layer: str(o.pins[0]) for d in plan.layers}
    plan = dataclasses.replace(plan, options=o, layers=tuple(
        dataclasses.replace(d, pinned=marks[d.layer]) if d.layer in marks else d for d in plan.layers))
    speed = machine.to_json() if machine is not None else {"speed_factor": 1.0, "not_applied": machine_why}
    plan = dataclasses.replace(plan, timings_s=dict(timings), batch_norm=bn.to_json(),
                               calibration={**plan.calibration, "machine_speed": speed},
                               extra={**plan.extra, "runtime": runtime.to_json()})
    if graph_record is not None:
        from .artifacts import SolverInfo
        plan = dataclasses.replace(plan, solver=SolverInfo.from_json(
            {**plan.solver.to_json(), "graph_parallel": graph_record}))
        if graph_record.get("chosen", "").startswith("graphs"):
            plan = dataclasses.replace(plan, extra={**plan.extra, "runtime": {
                "expected": "native", "step_time_s": pred.step_time_s, "reason": graph_record["why"]}})
    if ondemand is not None:
        plan = dataclasses.replace(plan, calibration={**plan.calibration,
                                                      "shapes_on_demand": ondemand.to_json()})
    plan_path = module_path = None
    if o.write:
        t = time.perf_counter()
        out_dir.mkdir(parents=True, exist_ok=True)
        module_path = out_dir / plan.generated
        atomic_write_text(module_path, generate_module(plan))
        plan_path = out_dir / "plan.json"
        timings["write_s"] = time.perf_counter() - t
        timings["total_s"] = time.perf_counter() - t0
        plan = dataclasses.replace(plan, timings_s=dict(timings))
        write_plan(plan, plan_path)
    else:
        timings["total_s"] = time.perf_counter() - t0

    return PlanResult(plan, plan_path, module_path, table, sol, timings)


def _example_shares(mf, batch_size: int, world: int):
    """For ``graphs_alternative``: the largest rank's node / edge fractions of the model file's
    example batch under the graph split (imports the model file and torch, only when a PyG
    batch is priced)."""
    def shares(roles):
        from .runtime.graphs import largest_shares
        return largest_shares(roles, list(mf.example_inputs(batch_size)), world)
    return shares


def _graph_parallel_choice(graph, ctx, table, sol, pred, memory_limit_bytes, forced: bool, say,
                           shares=None):
    """The plan-level alternative ``graphs(P)`` of a PyG batch (``decomp.graph.graphs``: whole
    graphs per rank, the user's module run natively) against the ILP's best op-by-op plan
    (which pays the runtime's per-op overhead): the cheaper one is kept (``forced``: graphs
    whenever legal). Returns (table, solution, prediction, the record plan.json keeps under
    ``solver.graph_parallel``: both predictions, the choice and why), the ILP's when graphs(P)
    does not apply (no PyG batch: no record)."""
    from .cost.graphs import graphs_alternative
    alt = graphs_alternative(graph, table.ctx, table, memory_limit_bytes, shares)
    if alt.roles is None and not forced:     # not a PyG batch: nothing to compare
        return table, sol, pred, None
    rec = {"parts": alt.parts, "op_by_op_step_time_s": pred.step_time_s,
           "graphs_step_time_s": alt.prediction.step_time_s if alt.prediction is not None else None,
           "graphs_memory_per_rank_bytes": (alt.prediction.memory_per_rank_bytes
                                            if alt.prediction is not None else None),
           "illegal": alt.illegal,
           "priced_shares": (dict(alt.shares, source="the largest rank of the model file's example batch")
                             if alt.shares else {"source": "the mean share 1 / P"})}
    if forced and alt.illegal is not None:
        raise AutoparError(f"graphs({alt.parts}) was asked for (--kinds graphs, or forced on every layer) "
                           f"but is illegal: {alt.illegal}",
                           "plan with other --kinds (a padded batch's graphs are sample(P))")
    if alt.illegal is None and (forced or alt.prediction.step_time_s < pred.step_time_s):
        rec["chosen"] = f"graphs({alt.parts})"
        rec["why"] = ("forced" if forced else
                      f"graphs({alt.parts}) predicted {alt.prediction.step_time_s * 1e3:.3f} ms < the best "
                      f"op-by-op plan's {pred.step_time_s * 1e3:.3f} ms")
        say(f"graph parallelism: {rec['why']}: whole graphs per rank, run natively")
        gsol = dataclasses.replace(sol, choice=[0] * len(alt.table.layers),
                                   notes=list(sol.notes) + [f"plan-level alternative graphs({alt.parts}) chosen: "
                                                            + rec["why"]])
        return alt.table, gsol, alt.prediction, rec
    rec["chosen"] = "op-by-op"
    rec["why"] = (alt.illegal if alt.illegal is not None else
                  f"the op-by-op plan predicted {pred.step_time_s * 1e3:.3f} ms <= graphs({alt.parts})'s "
                  f"{alt.prediction.step_time_s * 1e3:.3f} ms")
    say(f"graph parallelism not chosen: {rec['why']}")
    return table, sol, pred, rec


def batch_norm_stats(o: PlanOptions, graph, batch_size: int, world_size: int):
    """The plan's batch-norm statistics (``decomp.bn``) from ``--batch-norm`` / ``--bn-group``;
    a named error (the first training batch norm) when the group does not divide the batch."""
    from .decomp.bn import resolve
    from .decomp.ir import BATCH_NORM
    try:
        return resolve(o.batch_norm, o.bn_group, batch_size, world_size)
    except ValueError as e:
        bns = [(lay, op) for lay in graph.layers for op in lay.ops
               if op.kind == BATCH_NORM and op.attrs.get("training", True)]
        if not bns:     # no batch norm: the choice changes nothing
            from .decomp.bn import BatchNormStats
            return BatchNormStats("global")
        lay, op = bns[0]
        raise AutoparError(f"batch norm {getattr(op, 'module', None) or lay.module or lay.name} ({op.name}): {e}",
                           "give a --bn-group that divides the samples every rank holds, or --batch-norm global") from None


def format_timings(t: dict[str, float]) -> str:
    """One line: where planning time went (``autopar plan --verbose``)."""
    return (f"timings: load {t.get('load_s', 0):.2f} s, trace {t.get('trace_s', 0):.2f} s, pricing "
            f"{t.get('price_s', 0):.2f} s, placements {t.get('placements_s', 0):.2f} s "
            f"({int(t.get('placements_priced', 1))} priced, {int(t.get('placements_solved', 1))} "
            f"solved), ILP {t.get('solve_s', 0):.2f} s, "
            + (f"measuring shapes {t['measure_s']:.2f} s, " if t.get("measure_s") else "")
            + f"write {t.get('write_s', 0):.2f} s; total "
            f"{t.get('total_s', 0):.2f} s in make_plan")


def default_plan_dir(model_name: str, world: int) -> Path:
    return Path("strategies") / "plans" / f"{model_name}-w{world}"


def vocab_loss_output_cached(mf, graph, batch_size: int, use_cache: bool = True) -> str | None:
    """``vocab_loss_output``, remembered beside the trace cache under the trace's key (it runs
    the user's loss on meta tensors: seconds of torch import and tracing on a re-plan that the
    trace cache otherwise spares). A cached answer is trusted only when it names the graph's
    own output, or no output; anything else is recomputed."""
    from .io import atomic_write_json
    from .trace.cache import cache_dir, trace_key
    if not use_cache:
        return vocab_loss_output(mf, graph, batch_size)
    path = cache_dir() / f"{trace_key(mf.path, batch_size)}.vocab-loss.json"
    try:
        got = json.loads(path.read_text())["loss_output"]
        if got is None or got == graph.output:
            return got
    except (OSError, ValueError, KeyError, TypeError):
        pass
    out = vocab_loss_output(mf, graph, batch_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"loss_output": out})
    except OSError:
        pass                      # a read-only cache folder: computed again next time
    return out


def vocab_loss_output(mf, graph, batch_size: int) -> str | None:
    """The graph's output when the model file's loss is one cross-entropy over the output's last
    dim and a lone linear makes it, on (batch, sequence, vocabulary) logits (a language-model
    head: ``vocab_head`` may then split the vocabulary and run the loss vocabulary-parallel);
    None otherwise. Imports torch (to run the loss on meta tensors) only for such a head, so
    re-planning a CNN from the trace cache still imports no torch."""
    out = graph.output
    lay = next((lay for lay in graph.layers if lay.output == out), None)
    if lay is None or len(lay.ops) != 1 or lay.anchor.kind != "linear" or len(lay.out_shape) < 3:
        return None
    from .decomp.tensor_parallel.cross_entropy import loss_is_cross_entropy
    try:
        target = mf.example_targets(batch_size)
    except Exception:
        return None
    from .trace.tracer import STEP_TRACER
    loss = mf.loss_fn()
    if graph.tracer == STEP_TRACER:
        # the model returns a structure (a ModelOutput) and the loss reads the logits from it:
        # feed the loss the same structure, found on a model built on the meta device
        import torch

        from .runtime.model import output_structure, rebuild_output
        try:
            with torch.device("meta"):
                structure = output_structure(mf.build_model(), graph)
        except Exception:
            return None
        user_loss = loss

        def loss(x, *t):
            return user_loss(rebuild_output(structure, x), *t)
    return out if loss_is_cross_entropy(loss, lay.out_shape, target) is None else None


def attention_units(graph):
    """``graph`` with every attention block and every Conv1D MLP
    (``decomp.tensor_parallel.detect``) merged into one sub-graph unit, so that head
    parallelism and the Megatron MLP pair can be priced for it."""
    from .decomp.tensor_parallel.detect import attention_modules, mlp_modules
    from .trace.units import merge_units
    att = attention_modules(graph)
    return merge_units(graph, att + mlp_modules(graph, att))


def _pin(table, force: dict[int, str]) -> None:
    for li, want in force.items():
        o = table.layers[li]
        idx = [i for i, d in enumerate(o.choices) if str(d) == want or d.kind == want]
        if not idx:
            why = (o.illegal or {}).get(want)
            raise AutoparError(f"layer {li}: {want} is not a legal (kept) choice"
                               + (f" ({why})" if why else "") + f"; choices: {[str(d) for d in o.choices]}",
                               "pick one of the listed choices")
        keep = idx[0]
        o.choices, o.costs = [o.choices[keep]], [o.costs[keep]]
        if o.exact_keys:
            o.exact_keys = [o.exact_keys[keep]]
        for e in table.edges or ():
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


def _build_plan(mf, model_file: Path, out_dir: Path, world: int, rpn: int, n_nodes: int,
                batch: int, cal_path, profile, table, sol, pred, memory_limit_bytes, placed) -> Plan:
    """The typed plan of a solution; checked like a loaded one (``artifacts.check_plan``)."""
    from .artifacts import (LayerDecision, MeshInfo, ModelRef, Prediction, SolverInfo,
                            TransitionDecision, check_plan)
    from .decomp.redistribute import steps_str
    from .decomp.transition import plan_layouts
    graph = table.graph
    layers = []
    for lay, o, ci in zip(graph.layers, table.layers, sol.choice):
        dec = o.choices[ci]
        c = o.costs[ci]
        layers.append(LayerDecision.from_json({
            "layer": lay.index, "name": lay.name, "module": lay.module,
            "kinds": [op.kind for op in lay.ops], "out_shape": lay.out_shape,
            "decomposition": dec.to_json(), "choice": str(dec),
            "in_layouts": {v: dec.in_layout(lay, v).to_json() for v in lay.inputs},
            "out_layout": dec.out_layout(lay).to_json(),
            # the same in DTensor's vocabulary, one placement per mesh axis (outermost first)
            "placements": {"in": {v: dec.in_layout(lay, v).placements_str(world) for v in lay.inputs},
                           "out": {v: dec.out_layout(lay, v).placements_str(world) for v in lay.outputs}},
            "predicted": c.to_json(), "source": c.source,
            "exact_keys": o.exact_keys[ci] if o.exact_keys else [],
            "alternatives": [{"choice": str(d), "time_s": k.fwd_s + k.bwd_s + k.grad_sync_s,
                              "memory_bytes": k.memory_bytes} for d, k in zip(o.choices, o.costs)],
            "illegal": o.illegal,
        }))
    transitions = []
    for e in table.edges:
        i, j = sol.choice[e.src], sol.choice[e.dst]
        src = table.layers[e.src].choices[i].out_layout(graph.layers[e.src], e.value)
        dst = table.layers[e.dst].choices[j].in_layout(graph.layers[e.dst], e.value)
        if src != dst:
            steps = plan_layouts(src, dst, tuple(int(n) for n in graph.value_shape(e.value)), world)
            transitions.append(TransitionDecision(
                src=e.src, dst=e.dst, value=e.value, src_layout=str(src), dst_layout=str(dst),
                fwd_s=e.fwd_s[i][j], bwd_s=e.bwd_s[i][j],
                extra={"src_placements": src.placements_str(world), "dst_placements": dst.placements_str(world),
                       "steps": steps_str(steps)}))
    solver = sol.to_json()
    solver.update({"memory_limit_bytes": memory_limit_bytes, "candidates": table.size(),
                   "max_candidates_per_layer": table.ctx.max_candidates})
    if any(len(o.choices) >= table.ctx.max_candidates for o in table.layers):
        solver["notes"] = list(solver.get("notes", [])) + [
            f"optimal over the candidates kept per layer (at most {table.ctx.max_candidates}, "
            f"cost_table._pareto); --max-candidates keeps more"]
    plan = Plan(
        schema=PLAN_SCHEMA,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        autopar_version=__version__,
        plan_file="plan.json",
        model=ModelRef(path=_rel(model_file, out_dir), sha256=sha256_file(model_file), name=mf.name,
                       batch_size=batch, tracer=graph.tracer),
        mesh=MeshInfo(world_size=world, ranks_per_node=rpn, nodes=n_nodes,
                      local_stride=placed.placement.local_stride),
        placement_search=placed.to_json(),
        calibration={"path": str(cal_path) if cal_path else None, "fingerprint": profile.fingerprint,
                     "provenance": profile.provenance,
                     **({"speed_probe_nominal_s": nominal} if (nominal := profile_nominal_s(profile)) else {})},
        solver=SolverInfo.from_json(solver),
        predicted=Prediction.from_json(pred.to_json()),
        layers=tuple(layers),
        transitions=tuple(transitions),
        graph_json=graph.to_json(),
        generated=f"{mf.name.replace('-', '_')}_dist.py",
    )
    check_plan(plan, f"the plan made for {mf.name}")
    return plan


def format_plan_table(plan: Plan, verbose: bool = False) -> str:
    """The printed plan: summary, then the layer table with routine layers folded (every row
    when ``verbose``); ``autopar.report.planview.format_plan``."""
    from .report.planview import format_plan
    return format_plan(plan, verbose=verbose)


# ---- padding as a planning decision (``autopar plan --graph-sizes``) -------------------------

#: the environment variables a padded GNN model file reads its padded node / edge counts from
#: (``strategies/examples/gnn_pcqm4m.py``); a model file may name others in ``PADDING_ENV``
DEFAULT_PADDING_ENV = {"nodes": "AUTOPAR_GNN_NODES", "edges": "AUTOPAR_GNN_EDGES"}


@dataclass(frozen=True)
class PaddingOptions:
    """``--graph-sizes`` and its knobs (``autopar.cost.padding``): at most ``max_buckets``
    buckets, ``sampling`` "random" or "grouped", ``steps`` training steps (None: one epoch),
    ``shape_setup_s`` per distinct shape (ASSUMED), ``warmup_steps`` per distinct shape."""
    sizes_path: str
    max_buckets: int = 4
    sampling: str = "random"
    steps: int | None = None
    shape_setup_s: float | None = None
    warmup_steps: int | None = None


def shape_price_of(plan: Plan, nodes: int, edges: int, plan_file: str | None = None):
    """``ShapePrice`` of a plan made at padded shape (nodes, edges): its predicted step, and the
    priced compute of its layers split by the axis their output runs over (dim 1: ``edges`` ->
    edge axis; ``nodes`` or ``nodes + 1``, the padded extra node -> node axis; else other)."""
    from .cost.padding import ShapePrice
    edge = node = other = 0.0
    for d in plan.layers:
        w = float(d.predicted.get("fwd_compute_s", 0.0)) + float(d.predicted.get("bwd_compute_s", 0.0))
        dim1 = d.out_shape[1] if len(d.out_shape) > 1 else None
        if dim1 == edges:
            edge += w
        elif dim1 in (nodes, nodes + 1):
            node += w
        else:
            other += w
    return ShapePrice(plan.predicted.step_time_s, edge, node, other, plan_file)


def make_padded_plan(model_file: str | Path, options: PlanOptions, padding: PaddingOptions,
                     hooks: PlanHooks | None = None):
    """Plan a padded GNN for the graph sizes of ``padding.sizes_path``: price the model at each
    candidate bucket's padded shape (planning it with the model file's padding variables set),
    choose the padding (``autopar.cost.padding.decide``), write the plan of the largest shape as
    ``plan.json`` with the decision under ``padding``, and the plan of every other bucket
    beside it (``bucket-N<n>-E<e>/``). Returns (PlanResult, PaddingDecision)."""
    from .artifacts import PaddingInfo
    from .cost import padding as pad
    from .cost.graph_sizes import load_graph_sizes
    from .modelfile import load_model_file, model_env

    hooks = hooks or PlanHooks()
    say = hooks.progress or (lambda s: None)
    sizes = load_graph_sizes(padding.sizes_path)
    mf = load_model_file(model_file, lazy=True)
    env_names = dict(DEFAULT_PADDING_ENV)
    try:
        env_names.update(getattr(mf.module, "PADDING_ENV", None) or {})
    except Exception:  # noqa: BLE001 - a model file without it uses the default names
        pass
    batch = options.batch_size or mf.default_batch_size() or max(8, options.world_size)
    profile = hooks.profile
    if profile is None:
        _, profile = load_calibration(options.calibration)
    quiet = dataclasses.replace(options, write=False, out_dir=None, measure_shapes=False, batch_size=batch)
    plans: dict = {}

    def plan_at(b, opts, h):
        with model_env({env_names["nodes"]: str(b.nodes), env_names["edges"]: str(b.edges)}):
            return make_plan(model_file, opts, h)

    def price(b):
        res = plan_at(b, quiet, dataclasses.replace(hooks, profile=profile, progress=None))
        if not any(len(d.out_shape) > 1 and d.out_shape[1] == b.edges for d in res.plan.layers):
            raise AutoparError(
                f"{Path(model_file).name} planned at {b.nodes} nodes / {b.edges} edges has no layer over "
                f"{b.edges} edges: it does not read its padded sizes from {env_names['nodes']} / "
                f"{env_names['edges']}",
                "read NODES / EDGES from those variables in the model file (as strategies/examples/"
                "gnn_pcqm4m.py does), or name yours in PADDING_ENV = {'nodes': ..., 'edges': ...}")
        plans[b] = res
        p = shape_price_of(res.plan, b.nodes, b.edges)
        say(f"  priced padded shape {b}: step {p.step_time_s * 1e3:.3f} ms")
        return p

    kw = {}
    if padding.shape_setup_s is not None:
        kw["shape_setup_s"] = padding.shape_setup_s
    if padding.warmup_steps is not None:
        kw["warmup_steps"] = padding.warmup_steps
    say(f"padding: {sizes.graphs} graphs from {sizes.source} (at most {sizes.max_nodes} nodes, "
        f"{sizes.max_edges} edges); pricing the global maximum and up to {padding.max_buckets} buckets")
    try:
        decision = pad.decide(sizes, price, batch, options.world_size, max_buckets=padding.max_buckets,
                              sampling=padding.sampling, steps=padding.steps, **kw)
    except ValueError as e:
        raise AutoparError(f"padding: {e}", "check --max-buckets, --bucket-sampling and --train-steps") from None
    top = decision.chosen.buckets[-1]
    main = plan_at(top, dataclasses.replace(options, batch_size=batch), hooks)
    out_dir = main.plan_path.parent if main.plan_path is not None else None
    rows, written = [], []
    for b, r in zip(decision.chosen.buckets, decision.chosen.rows):
        rel = None
        if out_dir is not None and b != top:
            sub = out_dir / f"bucket-N{b.nodes}-E{b.edges}"
            res = plan_at(b, dataclasses.replace(options, batch_size=batch, out_dir=str(sub), measure_shapes=False),
                          dataclasses.replace(hooks, profile=profile, progress=None))
            written.append((b, res))
            rel = f"{sub.name}/plan.json"
        rows.append({**r, "plan": rel if b != top else "plan.json"})

    def record(b, plan_rel: str) -> PaddingInfo:
        """The decision as plan.json records it in the plan of bucket ``b`` (paths relative to
        that plan; ``env``: the padded sizes its model is imported with, ``Plan.model_env``)."""
        dj = decision.to_json()
        up = "" if b == top else "../"
        dj["buckets"] = [{**r, "plan": (up + r["plan"]) if r["plan"] else None} for r in rows]
        dj["this_bucket"] = {"nodes": b.nodes, "edges": b.edges, "plan": plan_rel}
        dj["env"] = {env_names["nodes"]: str(b.nodes), env_names["edges"]: str(b.edges)}
        return PaddingInfo.from_json(dj)

    plan = dataclasses.replace(main.plan, padding=record(top, "plan.json"))
    if main.plan_path is not None:
        write_plan(plan, main.plan_path)
    for b, res in written:
        write_plan(dataclasses.replace(res.plan, padding=record(b, "plan.json")), res.plan_path)
    return dataclasses.replace(main, plan=plan), decision
