"""The thin CLI: ``main(argv) -> int``, one sub-command per verb, heavy imports inside each verb.

Every user-fixable error is an ``AutoparError``: one line on stderr, exit code 2 (3 for a failed
validation, 4 for a dead or hung rank), no traceback unless ``--debug``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path


_T_START = __import__("time").perf_counter()


def _p(*a, **k) -> None:
    print(*a, **k, flush=True)


def cmd_calibrate(args) -> int:
    if args.nodes is not None:
        return _print_cluster_command(args)
    from .calibrate.run import calibrate
    out = Path(args.output) if args.output else None
    kw = {}
    generic = []
    if args.model:
        specs = _exact_specs_for(args)
        kw["exact_specs"] = [s for s in specs if s["op"] in ("conv", "linear")]
        generic = [s for s in specs if s["op"] == "generic"]
    path = calibrate(quick=args.quick, world_size=args.world_size, backend=args.backend,
                     out=out, progress=_p, **kw)
    if generic:
        from .calibrate.exact_ops import add_op_shapes
        add_op_shapes(path, generic, progress=_p)
    _p(f"profile written to {path}")
    if not args.no_report:
        _write_calibration_report(path)
    return 0


def _write_calibration_report(path) -> None:
    from .profile import load_profile
    from .calibrate.report import default_report_dir, write_report
    rep = write_report(load_profile(path, check_machine=False), default_report_dir(path), Path(path).name)
    _p(f"calibration report (fits against measurements, held-out errors) written to {rep}")


def cmd_refine(args) -> int:
    """Refine a profile from measured runs (``calibrate.refine``): the factors that
    leave-one-run-out cross-validation says help, written to a copy of the profile."""
    from .artifacts import load_run
    from .calibrate.refine import refine_profile
    from .errors import AutoparError
    from .io import read_json, sha256_file
    runs = []
    for r in args.runs:
        p = Path(r)
        p = p / "run.json" if p.is_dir() else p
        run = load_run(p)
        plan = Path(run.plan)
        if not plan.is_file():
            raise AutoparError(f"the plan of run {p} is not at {plan}",
                               "run `autopar refine` from the folder `autopar execute` ran in")
        if run.plan_sha256 and sha256_file(plan) != run.plan_sha256:
            raise AutoparError(f"{plan} changed since run {p} measured it",
                               "execute the current plan again, or refine from runs of unchanged plans")
        runs.append(run)
    try:
        out = refine_profile(runs, args.profile, out=args.output)
    except ValueError as e:
        raise AutoparError(str(e), "measure more runs (`autopar execute`) and refine from all of them") from None
    info = read_json(out, AutoparError, "profile")["provenance"]["refined"]
    cv = info["cross_validation"]
    c = info["corrections"]
    if "table" in cv:
        _p(f"cross-validated over {len(runs)} runs: applied {info['kinds'] or 'nothing'} (leave-one-run-out "
           f"median error {100 * cv['uncorrected_loo_median_abs_error']:.1f}% as calibrated, "
           f"{100 * cv['chosen_loo_median_abs_error']:.1f}% refined)")
    else:
        _p(cv["note"])
    drift = ", ".join(f"{w} ranks x{a:.3f}" for w, a in sorted(c["drift_by_world"].items())) or "none"
    _p(f"drift {drift}, blocking collectives x{c['blocking_comm_scale']:.3f}, gradient all-reduce "
       f"x{c['grad_sync_scale']:.3f}, {c['exact_entries']} exact entries rescaled")
    _p(f"refined profile written to {out} (the measured profile is unchanged)")
    if not args.no_report:
        _write_calibration_report(out)
    return 0


def _print_cluster_command(args) -> int:
    """--nodes K: print the torchrun command that calibrates K nodes (measures nothing here)."""
    from .calibrate.cluster import torchrun_command
    from .errors import CalibrationError
    if args.nodes < 1 or not args.ranks_per_node or args.ranks_per_node < 1:
        raise CalibrationError("--nodes K needs --ranks-per-node R (both >= 1)",
                               "e.g. autopar calibrate --nodes 4 --ranks-per-node 8")
    out = args.output or f"calibration/cluster-{args.nodes}x{args.ranks_per_node}-{args.backend}.json"
    _p("# run on every node (HOST:PORT = an address of node 0 that all nodes reach):")
    _p(torchrun_command(args.nodes, args.ranks_per_node, out, quick=args.quick,
                        backend=args.backend, merge_into=args.merge_into))
    return 0


def _exact_specs_for(args) -> list:
    from .cost.exact import exact_specs_for_model
    return exact_specs_for_model(args.model, args.world_size, args.batch_size,
                                 ranks_per_node=args.ranks_per_node)


#: progress lines of ``make_plan`` that only say a routine stage finished, or that the printed
#: plan's summary repeats: shown under ``autopar plan --verbose`` only
_ROUTINE_PROGRESS = ("batch-norm statistics: local", "runtime: ", "priced ", "solved with ", "placement: ",
                     "graph parallelism", "exact shapes: ")


def _plan_progress(verbose: bool):
    """Where ``make_plan``'s progress lines go: all of them with ``--verbose``; otherwise the
    routine ones (``_ROUTINE_PROGRESS``) are dropped, but a shape measurement is announced
    before it runs and every other line (unregistered ops, a global batch norm) is kept."""
    if verbose:
        return _p

    def terse(line: str) -> None:
        if not line.startswith(_ROUTINE_PROGRESS):
            _p(line)
    return terse


def _pipeline_arg(value: str | None):
    """``--pipeline auto|off|S``: "auto", None (off) or the stage count."""
    if value is None or value == "off":
        return None
    if value == "auto":
        return "auto"
    try:
        s = int(value)
    except ValueError:
        from .errors import PipelineError
        raise PipelineError(f"--pipeline {value!r} is not auto, off or a stage count", "e.g. --pipeline 2") from None
    return None if s == 1 else s


def cmd_plan(args) -> int:
    import time as _time
    t_cmd = _time.perf_counter()
    from .planner import format_plan_table, format_timings, make_plan, parse_bytes
    if args.world_size < 1:
        from .errors import AutoparError
        raise AutoparError(f"--world-size must be >= 1, got {args.world_size}", "give a positive number of ranks")
    sweep = [int(w) for w in args.sweep.split(",")] if args.sweep else None
    kinds = args.kinds.split(",") if args.kinds else None
    if args.kinds:
        from .planner.strategies import check_kinds    # both registries: decompositions and strategies
        check_kinds(kinds)
    if args.cluster:
        _read_cluster(args)
    if args.exact:
        _add_exact_shapes(args)
    from .artifacts import PlanHooks, PlanOptions
    options = PlanOptions(world_size=args.world_size, batch_size=args.batch_size,
                          calibration=args.calibration, out_dir=args.output,
                          memory_limit_bytes=parse_bytes(args.memory_limit),
                          ranks_per_node=args.ranks_per_node, nodes=args.nodes, kinds=kinds,
                          time_limit_s=args.time_limit, solver=args.solver,
                          max_candidates=args.max_candidates, placement=args.placement,
                          trace_cache=not args.no_trace_cache, batch_norm=args.batch_norm,
                          bn_group=args.bn_group,
                          measure_budget_s=args.measure_budget, shapes=args.shapes,
                          speed_history=args.speed_history, pins=tuple(args.pin or ()),
                          pipeline=_pipeline_arg(args.pipeline), microbatches=args.microbatches,
                          schedule=args.schedule, stage_data=args.stage_data)
    if args.no_measure:
        warnings.warn("--no-measure is the default now and does nothing (planning starts no process; "
                      "--measure-shapes measures missing shapes as a step before planning)", FutureWarning)
    if args.measure_shapes:
        options = _measure_shapes_first(args, options)
    if args.no_speed_history:
        warnings.warn("--no-speed-history is the default now and does nothing (plans price the profile "
                      "as measured; --speed-history opts in to this machine's usual speed)", FutureWarning)
    if args.graph_sizes and (args.trainers is not None or sweep):
        from .errors import AutoparError
        raise AutoparError("--graph-sizes plans one padded GNN job: it does not combine with "
                           f"{'--trainers' if args.trainers is not None else '--sweep'}",
                           "plan the padding first, then the trainers or the sweep at its padded shape")
    job = _job_level_asked(args)
    if job is not None:
        return JOB_PLANNERS[job](args, options)
    res = make_plan(args.model, options, PlanHooks(progress=_plan_progress(args.verbose)))
    _p(format_plan_table(res.plan, verbose=args.verbose))
    _p(f"plan written to {res.plan_path}; generated module {res.module_path}")
    if res.missing_shapes and args.measure_shapes:
        # the measured shapes moved the plan to candidates whose shapes the step's rounds left
        _p(f"{len(res.missing_shapes)} competitive local shape(s) are still priced by the generic model "
           f"after the measuring step's rounds; run the same command again to measure them too")
    elif res.missing_shapes:
        _p(f"{len(res.missing_shapes)} competitive local shape(s) are priced by the generic model (the profile "
           f"lacks them; nothing was measured). To measure them before planning: autopar plan "
           f"{' '.join(_plan_argv(args))} --measure-shapes")
    if args.verbose:
        _p(format_timings(res.timings_s) + f"; {_time.perf_counter() - t_cmd:.2f} s in the plan "
           f"command, {_time.perf_counter() - _T_START:.2f} s since autopar.cli was imported")
    if sweep:
        from .sweep import scaling_sweep
        png, rows = scaling_sweep(args, sweep, res.plan_path.parent, pins=options.pins)
        for r in rows:
            _p(r)
        _p(f"scaling picture written to {png}")
    return 0


def _plan_argv(args) -> list[str]:
    """The plan command's own arguments (for the printed command that measures shapes first)."""
    argv = sys.argv[2:] if len(sys.argv) > 2 and sys.argv[1] == "plan" else [args.model, "--world-size",
                                                                              str(args.world_size)]
    return [a for a in argv if a not in ("--no-measure", "--measure-shapes")]


def _measure_shapes_first(args, options):
    """``--measure-shapes``: the step before planning (``calibrate.shapes_step``) that measures
    the competitive local shapes the profile lacks into the shape file beside it; the plan then
    reads that file, named in its options and recorded in plan.json."""
    import dataclasses

    from .calibrate.shapes_step import measure_missing_shapes
    _p(f"measuring missing shapes first (--measure-shapes): the competitive local shapes the profile lacks, "
       f"at most {args.measure_budget:g} s, in one child process")
    m = measure_missing_shapes(args.model, options, progress=_p)
    if m.shapes_path is None:
        _p("measuring missing shapes: nothing to read; planning with the profile alone")
        return options
    _p(f"measuring missing shapes: {m.measured} measured in {m.spent_s:.1f} s over {m.rounds} round(s)"
       + (f", {len(m.left_out)} left to the generic model (budget)" if m.left_out else "")
       + f"; planning with {m.shapes_path}")
    return dataclasses.replace(options, shapes=str(m.shapes_path))


def _plan_padded(args, options) -> int:
    """``autopar plan --graph-sizes FILE``: padding chosen by the planner (``cost.padding``)."""
    from .artifacts import PlanHooks
    from .cost.padding import format_decision
    from .planner import PaddingOptions, format_plan_table, make_padded_plan
    popts = PaddingOptions(sizes_path=args.graph_sizes, max_buckets=args.max_buckets,
                           sampling=args.bucket_sampling, steps=args.train_steps,
                           shape_setup_s=args.shape_cost)
    res, decision = make_padded_plan(args.model, options, popts, PlanHooks(progress=_p))
    _p(format_plan_table(res.plan, verbose=args.verbose))
    _p(format_decision(decision))
    env = " ".join(f"{k}={v}" for k, v in (res.plan.padding.extra.get("env") or {}).items())
    _p(f"plan written to {res.plan_path} (the largest bucket's padded shape; its model is imported with "
       f"{env}, recorded in plan.json as padding.env and applied by autopar execute and torchrun); "
       f"generated module {res.module_path}")
    return 0


def _plan_trainers(args, options) -> int:
    """``autopar plan --trainers T|auto``: one trainer of N/T ranks planned by the ILP, the
    trainer level priced (``autopar.tournament.pricing``) and written into plan.json."""
    from .planner import format_plan_table, make_tournament_plan, parse_bytes
    from .tournament.pricing import IngestionModel, TournamentOptions, format_table
    from .artifacts import PlanHooks
    trainers = args.trainers if args.trainers == "auto" else _int_arg("--trainers", args.trainers)
    ing = None
    if args.storage_rate:
        ing = IngestionModel(node_read_bytes_per_s=parse_bytes(args.storage_rate), source="--storage-rate")
    topts = TournamentOptions(
        trainers=trainers, interval_steps=args.interval, pairing_seed=args.pairing_seed,
        exchange=args.exchange, metric=args.metric, tournament_samples=args.tournament_samples,
        train_samples_per_trainer=args.train_samples, dataset_samples=args.dataset_samples,
        sample_bytes=parse_bytes(args.sample_bytes), data_store_bytes_per_rank=parse_bytes(args.data_store_memory),
        ingestion=ing)
    res = make_tournament_plan(args.model, options, topts, PlanHooks(progress=_p), say=_p)
    _p(format_plan_table(res.plan, verbose=args.verbose))
    _p(f"trainer level: {len(res.rows)} trainer count(s) priced at world {options.world_size}")
    _p(format_table(res.rows, res.chosen))
    tl = res.plan.trainers
    _p(f"{tl.trainers} trainers x {tl.ranks_per_trainer} ranks, a tournament every {tl.interval_steps} steps "
       f"(exchange {tl.exchange}, metric {tl.metric}); plan written to {res.plan_path}")
    return 0


#: job-level strategy name (``planner.strategies``, ``level == "job"``) -> the ``autopar plan``
#: path that plans and prints it; which one a command asks for is the strategy's ``cli_flag``
JOB_PLANNERS = {"padding_buckets": _plan_padded, "trainers": _plan_trainers}


def _flag_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _job_level_asked(args) -> str | None:
    """The job-level strategy whose ``cli_flag`` this ``autopar plan`` command gives, if any
    (registration order; the flags that do not combine are refused before)."""
    from .planner.strategies import STRATEGIES, level_of
    for s in STRATEGIES.values():
        flag = getattr(s, "cli_flag", None)
        if level_of(s) == "job" and flag and getattr(args, _flag_dest(flag), None) not in (None, False):
            return s.name
    return None


def _int_arg(flag: str, text: str) -> int:
    from .errors import AutoparError
    try:
        return int(text)
    except ValueError:
        raise AutoparError(f"{flag} must be an integer or 'auto', got {text!r}", f"give e.g. {flag} 2") from None


def _read_cluster(args) -> None:
    """--cluster FILE: ranks per node and nodes of the cluster to plan for (flags win)."""
    from .errors import AutoparError
    from .io import read_json
    c = read_json(args.cluster, AutoparError, "cluster description")
    try:
        rpn, nodes = int(c["ranks_per_node"]), int(c["nodes"])
    except (KeyError, TypeError, ValueError):
        raise AutoparError(f"cluster description {args.cluster} needs integer ranks_per_node and nodes",
                           'write e.g. {"ranks_per_node": 8, "nodes": 128}') from None
    args.ranks_per_node = args.ranks_per_node or rpn
    args.nodes = args.nodes or nodes


def _add_exact_shapes(args) -> None:
    """Measure the exact local shapes this plan's candidates need into the profile first."""
    from .calibrate.exact_ops import add_op_shapes
    from .calibrate.run import add_exact_shapes
    from .planner import load_calibration
    specs = _exact_specs_for(args)
    cal_path, _ = load_calibration(args.calibration)
    add_exact_shapes(cal_path, [s for s in specs if s["op"] in ("conv", "linear")], progress=_p)
    add_op_shapes(cal_path, [s for s in specs if s["op"] == "generic"], progress=_p)


def cmd_execute(args) -> int:
    from .errors import AutoparError
    from .execute.runner import ExecuteOptions, execute, execute_runset
    from .io import read_json
    opts = ExecuteOptions(steps=args.steps, warmup=args.warmup, seed=args.seed,
                          timeout_s=args.timeout, ddp=not args.no_ddp, backend=args.backend,
                          rtol=args.rtol, validate_dtype=args.validate_dtype,
                          batch_norm=args.batch_norm, rounds=args.rounds, engine=args.engine,
                          validate=not args.no_validate, kill_trainer=_kill_arg(args.kill_trainer))
    head = read_json(args.plan, AutoparError, "plan or run set file")
    if isinstance(head, dict) and str(head.get("schema", "")).startswith("autopar.runset/"):
        runs, out = execute_runset(args.plan, opts, out_dir=args.out, progress=_p)
        for run in runs:
            _p(f"{run.plan}: validation PASSED ({run.validation.checked} tensors), step "
               f"{run.measured.step_time_s * 1e3:.2f} ms measured, {run.predicted.step_time_s * 1e3:.2f} ms "
               f"predicted" + (f", plan/DDP {run.ratio_to_ddp:.3f}x" if run.ratio_to_ddp else ""))
        _p(f"run set results in {out / 'runset.json'}")
        return 0
    run, out = execute(args.plan, opts, out_dir=args.out, progress=_p)
    return RUN_PRINTERS[run.kind](run, out, args, opts)


def _print_plan_run(run, out, args, opts) -> int:
    """One plan's run (``artifacts.RunResult``): validation, step times, the DDP baseline, and
    ``--refine``."""
    m, p = run.measured.step_time_s, run.predicted.step_time_s
    _p(f"validation PASSED: one {opts.validate_dtype} training step against one process, "
       f"{run.validation.checked} tensors (output, loss, gradients, parameters after the step) within "
       f"rtol {run.validation.rtol:g}")
    _p(f"step time: measured {m * 1e3:.2f} ms, predicted {p * 1e3:.2f} ms, prediction error "
       f"{100 * run.prediction_error:+.1f}%")
    if run.baseline:
        _p(f"torch DDP: {run.baseline.ddp_step_time_s * 1e3:.2f} ms; plan/DDP = {run.ratio_to_ddp:.3f}x "
           f"({run.baseline.note})")
    _p(f"report written to {out / 'report.md'}")
    if args.refine:
        from .calibrate.refine import refine_profile
        path = refine_profile(run, args.refine)
        _p(f"profile refined from this run: {path}")
    return 0


def _kill_arg(text):
    if not text:
        return None
    from .errors import AutoparError
    try:
        t, k = (int(x) for x in text.split(":"))
    except ValueError:
        raise AutoparError(f"--kill-trainer takes TRAINER:ROUND, got {text!r}", "give e.g. --kill-trainer 1:2") from None
    return (t, k)


def _print_tournament(run, out, args=None, opts=None) -> int:
    """A tournament run (``artifacts.TournamentRun``) in a few lines."""
    from .artifacts import TrainerPrediction
    v = run.validation
    _p("validation: " + (f"skipped ({v.skipped})" if v.skipped else
       f"{'PASSED' if v.passed else 'FAILED'} ({v.checked} tensors (parameters and buffers) and every "
       f"round's winners against the single-process simulation"
       + (f" of the survivors {list(v.survivors or ())}" if run.stopped else "") + f", max rel diff {v.max_rel_diff:.2g})"))
    for lg in run.rounds_log:
        _p(f"round {lg.round} (step {lg.step}): pairs {[list(q) for q in lg.pairs]}; " + ", ".join(
            f"t{x.trainer} kept {x.kept}" for x in lg.results))
    for tr in run.trainers_detail:
        if tr.stopped:
            s = tr.stopped
            _p(f"trainer {tr.trainer} STOPPED at round {s.round} (step {s.step}): {s.reason}")
    m, p = run.measured, run.predicted or TrainerPrediction()
    fmt = lambda x, f=1e3: "n/a" if x is None else f"{x * f:.3f}"  # noqa: E731
    if m.exchange_bytes is not None:
        pb = p.exchange_bytes_per_rank
        _p(f"exchange: {m.exchange_bytes} bytes sent in all, {m.exchange_bytes_per_rank} per rank per exchange "
           f"(predicted {'n/a' if pb is None else f'{pb:.0f}'}, priced in {p.priced_dtype or 'the plan' + chr(39) + 's'} dtype)")
    _p(f"measured: step {fmt(m.step_s)} ms, exchange {fmt(m.exchange_s)} ms, evaluation "
       f"{fmt(m.eval_s)} ms, {fmt(m.samples_per_s, 1)} samples/s; predicted: step "
       f"{fmt(p.step_s)} ms, exchange {fmt(p.exchange_s)} ms, evaluation {fmt(p.eval_s)} ms")
    _p(f"report written to {out / 'report.md'}")
    return 0


#: what ``autopar execute`` prints, by the run's ``kind`` (``RunResult`` "plan", ``TournamentRun``
#: "tournament": the runner's ``EXECUTORS`` return one of these)
RUN_PRINTERS = {"plan": _print_plan_run, "tournament": _print_tournament}


def cmd_check(args) -> int:
    """Load and check plans, runs and run sets (``autopar.artifacts``) without starting anything."""
    from .artifacts import load_plan, load_run, load_runset, load_tournament_run
    from .errors import AutoparError
    from .io import read_json
    for f in args.paths:
        p = Path(f)
        schema = str((read_json(p, AutoparError, "artifact") or {}).get("schema", "")) if p.is_file() else ""
        if schema.startswith("autopar.runset/"):
            rs = load_runset(p)
            _p(f"{p}: run set of {len(rs.entries)} plans on {rs.world_size} ranks: " + "; ".join(
                f"{e.plan_path} on ranks {list(e.ranks)}" for e in rs.entries))
        elif schema.startswith("autopar.tournament-run/"):
            r = load_tournament_run(p)
            _p(f"{p}: tournament of {r.model}: {r.trainers} trainers x {r.ranks_per_trainer} ranks, "
               f"{r.rounds} rounds, stopped: {list(r.stopped) or 'none'}")
        elif schema.startswith("autopar.run/"):
            r = load_run(p)
            _p(f"{p}: run of {r.model} at world {r.world_size}, validation "
               f"{'passed' if r.validation.passed else 'FAILED'}")
        else:
            pl = load_plan(p)
            _p(f"{p}: plan of {pl.model.name} for world {pl.world_size} ({len(pl.layers)} layers, "
               f"{', '.join(pl.decompositions())}): ok")
    return 0


def cmd_explain(args) -> int:
    """Why one layer got its decomposition (``autopar.explain``); starts no process."""
    from .explain import explain
    _p(explain(args.plan, args.layer))
    return 0


def cmd_report(args) -> int:
    from .report.report import summarize
    _p(summarize(args.paths))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autopar", description="Performance-model-driven parallelization autotuner")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("calibrate", help="measure kernels and collectives, write a profile")
    c.add_argument("--quick", action="store_true", help="a short sweep (about a minute)")
    c.add_argument("--world-size", type=int, default=4)
    c.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    c.add_argument("-o", "--output", help="profile path (default calibration/<machine>.json)")
    c.add_argument("--model", help="also measure the exact local shapes this model's plans need")
    c.add_argument("--batch-size", type=int)
    c.add_argument("--ranks-per-node", type=int)
    c.add_argument("--nodes", type=int, help="with --ranks-per-node: print the torchrun command "
                   "that calibrates a cluster of this many nodes (measures nothing here)")
    c.add_argument("--merge-into", help="with --nodes: the single-node profile the cluster "
                   "calibration is merged into")
    c.add_argument("--no-report", action="store_true", help="do not write the calibration report")
    c.set_defaults(fn=cmd_calibrate)

    r = sub.add_parser("refine", help="correct a profile from measured runs (cross-validated)")
    r.add_argument("profile", help="the profile the runs were planned with")
    r.add_argument("runs", nargs="+", help="run.json files (or run folders) written by `autopar execute`")
    r.add_argument("-o", "--output", help="refined profile path (default <profile>-refined.json)")
    r.add_argument("--no-report", action="store_true", help="do not write the calibration report")
    r.set_defaults(fn=cmd_refine)

    p = sub.add_parser("plan", help="trace a model file, price every decomposition, solve, generate code")
    p.add_argument("model", help="a .py file defining build_model() and example_inputs(batch_size)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--calibration", help="profile JSON (default: calibration/cpu-2core-gloo.json)")
    p.add_argument("-o", "--output", help="plan folder (default strategies/plans/<model>-w<N>)")
    p.add_argument("--memory-limit", help="per-rank memory limit, e.g. 512MiB or 16GiB")
    p.add_argument("--ranks-per-node", type=int, help="ranks per node of the cluster planned for")
    p.add_argument("--nodes", type=int, help="nodes of the cluster planned for")
    p.add_argument("--cluster", help='cluster description JSON: {"ranks_per_node": R, "nodes": K}')
    p.add_argument("--kinds", help="comma-separated kinds to consider: decomposition kinds and plan-level "
                   "strategy kinds (graphs, sharded, zero1); default all")
    p.add_argument("--pipeline", default=None, metavar="auto|off|S",
                   help="cut the model into pipeline stages on sub-meshes (torch's schedules): auto searches "
                        "the stage count, cuts and microbatches; S forces S stages")
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="microbatches per step under --pipeline (default: tried)")
    p.add_argument("--schedule", default=None, metavar="NAME",
                   help="torch pipeline schedule under --pipeline: gpipe, 1f1b (default), interleaved_1f1b, "
                        "looped_bfs, interleaved_zb, zbv, dualpipev")
    p.add_argument("--stage-data", default=None, metavar="auto|replicate|fsdp|plan",
                   help="under --pipeline, what each stage's ranks do: replicate (data parallel, all-reduce) "
                        "or fsdp (FSDP2 sharding) of whole blocks, or plan (the solver's per-layer plan of the "
                        "model on the stage's ranks: spatial, channel, tensor... inside every stage); "
                        "default: the planner chooses (stage plans where the block runtime cannot cut the model or "
                        "few solves price them)")
    p.add_argument("--pin", action="append", metavar="PATTERN=KIND|CHOICE",
                   help="fix the layers whose module or layer name matches the glob PATTERN ('*': all) "
                        "to KIND where legal (the solver picks among that kind's choices) or to the exact "
                        "CHOICE as plans print it, e.g. --pin '*=sample' --pin 'layer1.*=channel' "
                        "--pin 'h.0.attn=head(2,2)'; repeatable, the last pin taking a layer wins; "
                        "the other layers are left to the solver")
    p.add_argument("--time-limit", type=float, default=60.0, help="ILP time limit in seconds")
    p.add_argument("--solver", choices=["highs", "ilp", "cbc"], default="highs",
                   help="highs: dynamic program first, ILP where its bound leaves a gap (default); "
                        "ilp: HiGHS ILP only; cbc: CBC ILP only")
    p.add_argument("--max-candidates", type=int, default=8,
                   help="decompositions kept per layer after pruning (more: slower, never worse)")
    p.add_argument("--exact", action="store_true", help="measure exact local shapes into the profile first")
    p.add_argument("--sweep", help="also plan these world sizes (e.g. 1,2,4,...,1024) and draw the scaling picture")
    p.add_argument("--measure-shapes", action="store_true",
                   help="a step before planning: measure the competitive local shapes the profile lacks "
                        "(only a profile made on this machine) into PROFILE-shapes.json beside it, then "
                        "plan with that file (recorded in plan.json). Planning itself starts no process")
    p.add_argument("--shapes", metavar="FILE",
                   help="a shape file (PROFILE-shapes.json, written by --measure-shapes) to price with; "
                        "recorded in plan.json (default: the profile alone)")
    p.add_argument("--no-measure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure-budget", type=float, default=30.0, metavar="SEC",
                   help="with --measure-shapes: at most this long measuring (default 30)")
    p.add_argument("--speed-history", action="store_true",
                   help="price the profile's kernels at this machine's usual speed (the median "
                        "speed-probe reading of earlier calibrations and runs here, kept in "
                        "~/.cache/autopar/speed_history.json or AUTOPAR_SPEED_HISTORY) instead of "
                        "as measured (the default: a plan depends on the profile alone)")
    p.add_argument("--no-speed-history", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true",
                   help="print every layer row (by default parameter-free layers under 1 %% of the "
                        "step are folded), every progress line, and where planning time went "
                        "(also in plan.json, timings_s)")
    p.add_argument("--no-trace-cache", action="store_true",
                   help="trace the model again even if an unchanged copy was traced before")
    p.add_argument("--placement", default="search", metavar="{search,block,N}",
                   help="rank placement: search (default: plan under block and each candidate local "
                        "stride, keep the fastest; only block on one node), block (logical rank = "
                        "physical rank), or N (local stride N: logical ranks N apart share a node)")
    p.add_argument("--batch-norm", choices=["local", "global"], default="local",
                   help="batch-norm statistics: local (default; per group of --bn-group samples, what "
                        "torch DDP computes) or global (over the whole batch, the single-process "
                        "function: DDP + SyncBatchNorm)")
    p.add_argument("--bn-group", type=int, default=None, metavar="G",
                   help="samples per statistics group with --batch-norm local (default: the samples "
                        "one rank holds under data parallelism, batch / world size)")
    g = p.add_argument_group("padded graphs (GNN)")
    g.add_argument("--graph-sizes", metavar="FILE",
                   help="node and edge counts of the data set's graphs ('nodes,edges[,count]' per line): "
                        "the planner chooses one global maximum or size buckets for the padding")
    g.add_argument("--max-buckets", type=int, default=4, help="most size buckets to price (default 4)")
    g.add_argument("--bucket-sampling", choices=["random", "grouped"], default="random",
                   help="random: mini-batches as drawn, padded to the bucket of their largest graph; "
                        "grouped: mini-batches formed within a bucket")
    g.add_argument("--train-steps", type=int, help="training steps the shapes serve (default one epoch)")
    g.add_argument("--shape-cost", type=float, metavar="SEC",
                   help="seconds one more padded shape costs (plan, trace, warm-up; default 2)")
    t = p.add_argument_group("tournament training (LTFB)")
    t.add_argument("--trainers", help="T trainers of world/T ranks each (tournament training), or 'auto': "
                   "price every divisor of the world and keep the most samples per second")
    t.add_argument("--interval", type=int, default=10, help="training steps between tournaments")
    t.add_argument("--pairing-seed", type=int, default=0, help="seed of the random pairing")
    t.add_argument("--exchange", choices=["weights", "weights+optimizer"], default="weights")
    t.add_argument("--metric", choices=["loss", "model_file"], default=None,
                   help="tournament metric (default: the model file's tournament_metric if defined, "
                   "else the loss on the held-out tournament set)")
    t.add_argument("--tournament-samples", type=int, help="held-out samples per trainer (default 2 batches)")
    t.add_argument("--train-samples", type=int, help="training samples per trainer (default 8 batches)")
    t.add_argument("--dataset-samples", type=int, help="samples of the whole data set, for the ingestion model")
    t.add_argument("--sample-bytes", help="bytes of one sample in storage (default: the model file's SAMPLE_BYTES)")
    t.add_argument("--data-store-memory", help="per-rank memory for the in-memory data store (default --memory-limit)")
    t.add_argument("--storage-rate", help="read rate from storage per node, e.g. 2GB (default: profile or 1 GB/s)")
    p.set_defaults(fn=cmd_plan)

    e = sub.add_parser("execute", help="run a plan, check one training step (float64 by default) against one "
                                       "process (output, loss, every gradient, parameters after the step), time it "
                                       "against DDP")
    e.add_argument("plan", help="plan.json, or a run set (autopar.runset/1: several plans at once on "
                                "disjoint sub-meshes of one world)")
    e.add_argument("--steps", type=int, default=5)
    e.add_argument("--warmup", type=int, default=2)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", help="run folder (default reports/<model>-w<N>-<time>)")
    e.add_argument("--timeout", type=float, default=600.0, help="seconds before a hung run is stopped")
    e.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    e.add_argument("--validate-dtype", choices=["float64", "float32"], default="float64",
                   help="dtype of the validation step (timing always runs float32)")
    e.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance of validation, of each tensor's max magnitude "
                        "(default 1e-9 in float64, 2e-5 in float32)")
    e.add_argument("--no-ddp", action="store_true", help="skip the DDP baseline")
    e.add_argument("--batch-norm", choices=["local", "global"], default=None,
                   help="refuse to run unless the plan was made with these batch-norm statistics")
    e.add_argument("--engine", choices=["auto", "torch-ddp", "autopar"], default="auto",
                   help="engine of a pure data-parallel plan (default: the faster measured, "
                        "reports/benchmarks/engines.md)")
    e.add_argument("--refine", metavar="PROFILE", help="refine this profile from the run's measurements")
    e.add_argument("--rounds", type=int, default=3, help="tournament plans: rounds to run")
    e.add_argument("--no-validate", action="store_true",
                   help="tournament plans: skip the check against the single-process simulation")
    e.add_argument("--kill-trainer", metavar="TRAINER:ROUND",
                   help="tournament plans: kill that trainer at that round (a fault drill)")
    e.set_defaults(fn=cmd_execute)

    k = sub.add_parser("check", help="check plans, runs and run sets (names the unit and field at fault)")
    k.add_argument("paths", nargs="+", help="plan.json, run.json or run set files")
    k.set_defaults(fn=cmd_check)

    x = sub.add_parser("explain", help="why a layer got its decomposition: every candidate priced (forward, "
                       "backward, communication, memory, transitions) and the step with each")
    x.add_argument("plan", help="plan.json written by `autopar plan`")
    x.add_argument("layer", help="a layer index, a layer name or a module name")
    x.set_defaults(fn=cmd_explain)

    r = sub.add_parser("report", help="summarize runs and plans side by side")
    r.add_argument("paths", nargs="+")
    r.set_defaults(fn=cmd_report)
    return ap


def main(argv: list[str] | None = None) -> int:
    from .errors import AutoparError
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.debug:
        warnings.filterwarnings("default")
        warnings.formatwarning = lambda m, c, *a, **k: f"warning: {m}\n"
    try:
        return int(args.fn(args) or 0)
    except AutoparError as e:
        if args.debug:
            raise
        print(f"autopar: {e.__class__.__name__}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """The console entry point (``autopar``, ``python -m autopar``): ``main()``, then leave
    without tearing the interpreter down.

    Freeing every module and object of a process that imported torch takes 0.3-0.6 s after
    the command's work is done (ResNet-50 planned at 1024 ranks: 0.55 s of a 4.2 s command),
    time a user waits for nothing. The exit handlers still run (``atexit``: logging's flush,
    temporary folders, multiprocessing's joins) and the output streams are flushed, then the
    process ends with ``main``'s exit code; every file autopar writes is closed (and renamed
    into place) before ``main`` returns. ``main(argv)`` itself returns normally, for callers
    in a process that goes on (tests, notebooks). An exception out of ``main`` (argparse's
    ``SystemExit``, a bug's traceback) leaves the ordinary way."""
    code = main()
    try:
        import atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        import os
        os._exit(code)


if __name__ == "__main__":
    run()
