"""``autopar execute``: run a plan on local processes, check one training step against one
process, time it, compare with torch DDP.

For each rank (fresh processes, gloo on CPU / NCCL on GPU), ``_rank_main`` builds the user's
model with the plan's seed and the generated module's ``PlannedModel``, then runs, in order:

1. the **validation step** (``execute.validate``; float64 by default): every tensor against one
   process, ``max|a-b| <= rtol * max|ref| + atol`` (``DEFAULT_TOL``);
2. **timing** (``execute.timing``; float32, a fresh copy of the model): ``warmup`` + ``steps``
   training steps, each the slowest rank's wall time, then ``instrumented_steps`` more for
   per-layer times (median per layer);
3. the **baseline** (``execute.baseline``): torch DDP on the same model and batch, its
   ``warmup`` + ``steps`` steps timed in the same rounds as the plan's (``interleaved``: a block
   of each per round, the order alternating), so that plan / DDP compares the same minutes.

``execute`` checks the plan and its model file before any process starts, launches the ranks,
and writes ``RUNDIR/run.json`` (a ``RunResult``, ``autopar.artifacts``) with report.md and plots
(``autopar.report``), atomically; a failed run never replaces a passing ``run.json``: it goes to
``RUNDIR/failed-*``.
"""

from __future__ import annotations

import dataclasses

import datetime as _dt
import importlib.util
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..artifacts import (RUN_SCHEMA, ExecutedRun, LayerTiming, Measured, Plan, RunResult,  # noqa: F401
                         TournamentRun, Validation, load_plan, load_run)
from ..errors import AutoparError, PlanFileError, ValidationFailed
from ..io import atomic_write_json, sha256_file
from .files import check_plan_files
from .validate import DEFAULT_TOL, RULE, validation_step, worst
from ..artifacts import load_runset
from ..calibrate.speed import probe_reading_s
from ..decomp.graph.inputs import check_edge_indices
from ..profile.history import record
from ..report.report import write_run_report
from .stages import execute_stages
from ..runtime.comm import Comm, create_groups
from .fsdp import fsdp_main, sharded_record
from ..runtime.entry import build_user_model, synthetic_batch
from ..runtime import launch as rank_launch  # looked up at each call: tests replace run_ranks
from ..runtime.model import plan_groups
from ..runtime.native import AUTOPAR_NATIVE, TORCH_DDP, use_engine
from ..tournament.run import execute_tournament
from ..tournament.runtime import TournamentRunOptions
from .baseline import ddp_runner, graph_split_roles
from . import timing  # ``timing.timed_steps`` looked up at each call: tests replace it


@dataclass
class ExecuteOptions:
    steps: int = 5
    warmup: int = 2
    seed: int = 0
    lr: float = 0.01
    momentum: float = 0.9
    validate_dtype: str = "float64"
    rtol: float | None = None      # default by dtype: float64 1e-9, float32 2e-5
    atol: float | None = None      # default by dtype: float64 1e-12, float32 1e-7
    timeout_s: float = 600.0
    instrumented_steps: int = 3
    ddp: bool = True
    backend: str = "gloo"
    batch_norm: str | None = None  # when set, the plan's batch-norm statistics must be these
    # tournament plans (a trainer level): rounds to run, validate against the simulation,
    # and a fault to inject (trainer, round) for tests and demos
    rounds: int = 3
    validate: bool = True
    kill_trainer: tuple[int, int] | None = None
    # a pure data-parallel plan's engine: "auto" (``runtime.native.DEFAULT_ENGINE``, the faster
    # measured), "torch-ddp" or "autopar" (``runtime.native``, "Engines")
    engine: str = "auto"

    def tolerances(self) -> tuple[float, float]:
        rt, at = DEFAULT_TOL[self.validate_dtype]
        return (self.rtol if self.rtol is not None else rt, self.atol if self.atol is not None else at)


def _import_generated(path: Path):
    spec = importlib.util.spec_from_file_location(f"autopar_generated_{abs(hash(str(path))) % 10**8}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_kind(plan: Plan) -> str:
    """How a plan runs, as the strategy that made it recorded: "tournament" (a trainer level,
    ``planner.strategies.trainers``), else its runtime record's ``expected`` (the chosen
    candidate's ``runtime``: "native", "traced", "fsdp", "fsdp+traced", "stages"), "traced"
    for a plan without one. ``EXECUTORS`` and ``RANK_MAINS`` are keyed by it."""
    if plan.trainers is not None:
        return "tournament"
    return plan.runtime.expected if plan.runtime is not None else "traced"


def _rank_main(rank: int, world: int, plan_path: str, module_path: str, opts: ExecuteOptions) -> dict[str, Any]:
    """One rank of a single plan on the whole world: ``RANK_MAINS`` by the plan's ``run_kind``
    (a sharded plan on torch's FSDP2: ``execute.fsdp``), else ``_mesh_main``."""
    plan = load_plan(plan_path, world)
    return RANK_MAINS.get(run_kind(plan), _mesh_rank_main)(plan, plan_path, module_path, Comm.from_env(), opts)


def _mesh_rank_main(plan: Plan, plan_path: str, module_path: str, comm, opts: ExecuteOptions) -> dict[str, Any]:
    return _mesh_main(plan, plan_path, module_path, comm, opts)


def _fsdp_rank_main(plan: Plan, plan_path: str, module_path: str, comm, opts: ExecuteOptions) -> dict[str, Any]:
    return fsdp_main(plan, plan_path, comm, opts)


#: run kind -> one rank's work, where it is not ``_mesh_main`` (the generated module's model)
RANK_MAINS = {"fsdp": _fsdp_rank_main}


def _runset_rank_main(rank: int, world: int, runset_path: str, module_paths: list[str],
                      opts: ExecuteOptions) -> dict[str, Any]:
    """One rank of a run set: every process creates every group of every plan (collective, one
    order), then runs the plan whose sub-mesh holds it, on a ``Comm`` of that sub-mesh."""

    rs = load_runset(runset_path)
    create_groups([g for e in rs.entries for g in plan_groups(e.plan, e.ranks)])
    i = next(k for k, e in enumerate(rs.entries) if rank in e.ranks)
    e = rs.entries[i]
    out = _mesh_main(e.plan, str(e.plan_path), module_paths[i], Comm.from_env(ranks=e.ranks), opts)
    out["entry"] = i
    return out


def _mesh_main(plan: Plan, plan_path: str, module_path: str, comm, opts: ExecuteOptions) -> dict[str, Any]:
    """Validate, time, baseline on ``comm``'s mesh (each step collective over the mesh, in this
    order on every rank of it)."""
    import torch


    gen = _import_generated(Path(module_path))
    rank, world = comm.rank, comm.world
    device = comm.device
    vdt = getattr(torch, opts.validate_dtype)
    rtol, atol = opts.tolerances()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    barrier = comm.barrier

    def make(dtype):
        mf_, model_ = build_user_model(plan, plan_path, opts.seed)
        model_.to(device=device, dtype=dtype)
        with use_engine(opts.engine):
            dm_ = gen.PlannedModel(plan, model_, comm)
        dm_.train()
        return mf_, dm_

    def cast(ts, dtype):
        return [x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device) for x in ts]

    mf, dm = make(vdt)
    loss_fn = mf.loss_fn()
    xs32, ys32 = synthetic_batch(mf, plan.model.batch_size, opts.seed + 1)
    check_edge_indices(dm.graph, xs32)          # a GNN batch's edges inside their graphs
    ys = ys32.to(device) if ys32 is not None else None
    ys_v = ys.to(vdt) if ys is not None and ys.is_floating_point() else ys

    # 1. validation step
    # rank 0: the tolerances held to (a model computing in float32 inside: the float32 ones)
    precision: dict[str, Any] = {"tolerances_given": opts.rtol is not None or opts.atol is not None}
    checks = validation_step(dm, mf, cast(xs32, vdt), ys_v, loss_fn, comm, vdt, opts.seed,
                             opts.lr, opts.momentum, rtol, atol, precision)
    barrier()

    # 2. timing (float32, a fresh model unless validation ran in float32)
    if vdt != torch.float32:
        mf, dm = make(torch.float32)
    xs = [x.to(device) for x in xs32]
    ys_t = ys.to(torch.float32) if (ys is not None and ys.is_floating_point()) else ys
    opt = torch.optim.SGD(dm.parameters(), lr=opts.lr, momentum=opts.momentum)
    local = dm.shard_inputs(xs)
    plan_loss = lambda o: dm.local_loss(o, ys_t, loss_fn)  # noqa: E731
    plan_args = (dm, opt, local, plan_loss, dm.finish_grads)
    nat = getattr(dm, "_native", None)
    if nat is not None and nat.engine == TORCH_DDP:   # the plan's step is torch's DDP object's
        plan_args = nat.step_args(opt, local, ys_t, loss_fn)

    # 3. the DDP baseline, in the same processes
    # DDP splits every input along dim 0: only for a batch of samples, unless the model file
    # says how to split its batch (``ddp_shard``: a PyG batch's x [N, F] and edge_index [2, E]
    # split by whole graphs); otherwise no baseline
    roles = graph_split_roles(dm.graph)      # a PyG batch: whole graphs per rank
    samples = (len({int(x.shape[0]) for x in xs if x.dim()}) == 1 or mf.ddp_shard() is not None
               or (roles is not None and roles.graphs % world == 0))
    ddp = None
    if opts.ddp and world > 1 and plan.model.batch_size >= world and samples:
        ddp = ddp_runner(mf, xs, ys_t, loss_fn, comm, opts.seed, opts.lr, opts.momentum,
                         bn_stats=plan.bn_stats(), graph=dm.graph)

    # 4. timing: the plan's steps, and DDP's interleaved with them in rounds (``interleaved``)
    timing.timed_steps(*plan_args, opts.warmup, comm, sync, barrier)
    if ddp is None:
        plan_times = timing.timed_steps(*plan_args, opts.steps, comm, sync, barrier)
        baseline = None
    else:
        timing.timed_steps(*ddp.step_args(), opts.warmup, comm, sync, barrier)
        plan_times, ddp_times = interleaved(plan_args, ddp.step_args(), opts.steps, comm, sync, barrier)
        baseline = ddp.result(ddp_times)
    per_layer, phases = timing.instrumented_steps(dm, opt, local, plan_loss, opts.instrumented_steps, comm,
                                           sync, barrier)
    barrier()
    # the machine's speed now, by the probe the profile's kernel times are stated against
    # (``calibrate.speed``): rank 0 alone, the others waiting at the barrier
    probe_s = None
    if rank == 0 and device.type == "cpu" and plan.calibration.speed_probe_nominal_s:
        probe_s = probe_reading_s("cpu")
    barrier()
    return {"rank": rank, "checks": checks, "plan_step_times_s": plan_times, "per_layer": per_layer,
            "phases": phases, "baseline": baseline, "grad_sync_bytes_per_step": dm.gradsync.bytes_per_step,
            "runtime": _runtime_note(dm), "speed_probe_s": probe_s, "precision": precision}


#: rounds the timed steps of ``autopar execute`` are split into when DDP is timed beside the plan
INTERLEAVE_ROUNDS = 6


def interleaved(plan_args: tuple, ddp_args: tuple, steps: int, comm, sync, barrier
                ) -> tuple[list[float], list[float]]:
    """``steps`` timed steps of the plan and of DDP each, in ``INTERLEAVE_ROUNDS`` rounds of a
    block of each, the order alternating round by round: machine drift over the run (this
    2-core VM's speed moves by tens of percent within minutes) falls on both alike, where
    timing all of the plan's steps and then all of DDP's read the same native plan at 1.03x
    and at 1.20x DDP in two fresh-clone runs of the example."""
    t = timing.interleaved_rounds({"plan": lambda n: timing.timed_steps(*plan_args, n, comm, sync, barrier),
                                   "ddp": lambda n: timing.timed_steps(*ddp_args, n, comm, sync, barrier)},
                                  steps, INTERLEAVE_ROUNDS)
    return t["plan"], t["ddp"]


def _runtime_note(dm) -> dict[str, Any]:
    """How the timed model ran: natively (pure data parallelism, ``runtime.native``) or the
    traced program op by op, and why."""
    nat = getattr(dm, "_native", None)
    if nat is not None:
        how = getattr(nat, "reducer", None) or ("torch DDP's reducer (SUM hook)" if nat.ddp is not None
                                                else "autopar's GradSync")
        what = "whole graphs (graph parallelism)" if getattr(dm, "_graph_roles", None) is not None else "samples"
        engine = getattr(nat, "engine", AUTOPAR_NATIVE)
        verb = "averaged" if engine == TORCH_DDP else "summed"
        return {"native": True, "engine": engine, "engine_reason": getattr(nat, "engine_reason", ""),
                "note": f"runtime: native on engine {engine} ({getattr(nat, 'engine_reason', '')}; the user's "
                        f"module on each rank's {what}, gradients {verb} by {how})"}
    return {"native": False, "engine": "autopar-traced", "engine_reason": getattr(dm, "native_off_reason", None),
            "note": f"runtime: traced program op by op ({getattr(dm, 'native_off_reason', None)})"}


def check_batch_norm(plan: Plan, plan_path, want: str | None) -> None:
    """A plan made with one batch-norm choice is never executed with another."""
    have = plan.bn_stats()
    if want is not None and want != have.mode:
        raise PlanFileError(f"{plan_path} was planned with --batch-norm {have.mode} ({have}), "
                            f"executed with --batch-norm {want}: they compute different functions",
                            f"re-plan with --batch-norm {want}, or execute without --batch-norm")


def run_result(plan: Plan, plan_path: Path, opts: ExecuteOptions, r0: dict[str, Any], placement,
               wall_s: float) -> RunResult:
    """The typed run of rank 0's figures (checks, step times, per layer, baseline)."""
    checks = tuple(r0["checks"])
    measured = statistics.median(r0["plan_step_times_s"])
    predicted = plan.predicted.step_time_s
    trans_into: dict[int, float] = {}
    for t in plan.transitions:
        trans_into[t.dst] = trans_into.get(t.dst, 0.0) + t.fwd_s + t.bwd_s
    per_layer = []
    for m in r0["per_layer"]:
        lay = plan.layer(m["layer"])
        per_layer.append(LayerTiming(
            layer=m["layer"], module=lay.module or lay.name, choice=lay.choice,
            measured_s=m["fwd_s"] + m["bwd_s"], measured_fwd_s=m["fwd_s"], measured_bwd_s=m["bwd_s"],
            predicted_s=lay.fwd_s + lay.bwd_s + trans_into.get(m["layer"], 0.0),
            source=lay.predicted.source))
    rtol, atol = opts.tolerances()
    prec = r0.get("precision") or {}
    rtol, atol = prec.get("rtol", rtol), prec.get("atol", atol)
    base = r0["baseline"]
    return RunResult(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        plan=str(plan_path), plan_sha256=sha256_file(plan_path), model=plan.model.name,
        world_size=plan.world_size, backend=opts.backend, placement=placement.to_json(),
        batch_size=plan.model.batch_size, options=asdict(opts), decompositions=tuple(plan.decompositions()),
        validation=Validation(passed=all(c.passed for c in checks), dtype=opts.validate_dtype, rtol=rtol,
                              atol=atol, rule=RULE, checked=len(checks), checks=checks),
        measured=Measured(step_time_s=measured, step_times_s=tuple(r0["plan_step_times_s"]),
                          phases=r0["phases"], per_layer=tuple(per_layer),
                          grad_sync_bytes_per_step=r0["grad_sync_bytes_per_step"]),
        predicted=plan.predicted,
        prediction_error=(predicted - measured) / measured if measured > 0 else None,
        baseline=base, ratio_to_ddp=(measured / base.ddp_step_time_s) if base else None, wall_s=wall_s,
        notes=((r0["runtime"]["note"],) if "runtime" in r0 else ()) + ((prec["note"],) if "note" in prec else ()),
        extra={**({"native_runtime": r0["runtime"]["native"]} if "runtime" in r0 else {}),
               **({"engine": {"engine": r0["runtime"]["engine"], "reason": r0["runtime"].get("engine_reason")}}
                  if "engine" in r0.get("runtime", {}) else {}),
               **({"validation_float32_inside": prec["float32_inside"]} if "float32_inside" in prec else {}),
               **speed_note(plan, r0.get("speed_probe_s"))})


def speed_note(plan: Plan, probe_s: float | None) -> dict[str, Any]:
    """``{"speed_probe": ...}`` of a run whose rank 0 read the machine-speed probe after
    timing: the reading, the profile's nominal one and their ratio (> 1: the machine ran
    slower than when the profile's kernels were measured, by the probe), and the reading the
    plan's compute was priced at (the nominal, or where the plan used the speed history the
    reading between it and the machine's usual one, ``profile.history``) with the ratio to it;
    {} without both."""
    nominal = plan.calibration.speed_probe_nominal_s
    if not probe_s or not nominal:
        return {}
    ms = plan.calibration.machine_speed or {}
    # plans of the first speed-history code priced at the usual reading itself (no priced_at_s)
    priced_at = float(ms.get("priced_at_s") or ms.get("usual_probe_s") or nominal)
    return {"speed_probe": {"execute_s": float(probe_s), "profile_nominal_s": float(nominal),
                            "slowdown_vs_calibration": float(probe_s) / float(nominal),
                            "priced_at_s": priced_at, "slowdown_vs_pricing": float(probe_s) / priced_at}}


def execute(plan_path: str | Path, opts: ExecuteOptions, out_dir: str | Path | None = None,
            progress=print) -> tuple[ExecutedRun, Path]:
    """Run, validate, time; write run.json + report; return (the run, the folder written): a
    ``RunResult`` (``kind`` "plan"), or for a plan with a trainer level (``autopar plan
    --trainers``), run as a tournament (``autopar.tournament.run.execute_tournament``), a
    ``TournamentRun`` (``kind`` "tournament"); both are ``artifacts.ExecutedRun``."""

    plan_path = Path(plan_path)
    plan = load_plan(plan_path)        # checked before any process starts
    check_batch_norm(plan, plan_path, opts.batch_norm)
    return EXECUTORS.get(run_kind(plan), _execute_mesh)(plan_path, plan, opts, out_dir, progress)


def _execute_tournament(plan_path: Path, plan: Plan, opts: ExecuteOptions, out_dir, progress):
    """Tournament training (LTFB): T trainers on sub-meshes (``tournament.run``)."""
    tour, out = execute_tournament(plan_path, TournamentRunOptions(
        rounds=opts.rounds, seed=opts.seed, lr=opts.lr, momentum=opts.momentum, dtype=opts.validate_dtype,
        timeout_s=opts.timeout_s, kill=opts.kill_trainer), out_dir, progress, validate=opts.validate)
    return TournamentRun.from_json(tour, str(out / "run.json")), out


def _execute_stages(plan_path: Path, plan: Plan, opts: ExecuteOptions, out_dir, progress):
    """Pipeline stages on sub-meshes (issue 41, ``execute.stages``)."""
    return execute_stages(plan_path, plan, opts, out_dir, progress, _choose_out_dir, write_run_report)


def _execute_sharded(plan_path: Path, plan: Plan, opts: ExecuteOptions, out_dir, progress):
    """A sharded plan (``planner.strategies.sharded``): refused before any process starts when
    not runnable, run on the whole world, its measured memory against the prediction."""
    sharded_record(plan)
    return _execute_mesh(plan_path, plan, opts, out_dir, progress, sharded=True)


def _execute_mesh(plan_path: Path, plan: Plan, opts: ExecuteOptions, out_dir, progress, sharded: bool = False):
    """One plan on the whole world (natively or op by op: the generated module's model)."""
    world = plan.world_size
    module_path = check_plan_files(plan_path, plan)
    progress(f"executing {plan_path} on {world} processes ({opts.backend}): validation, "
             f"{opts.warmup}+{opts.steps} timed steps, DDP baseline")
    t0 = time.perf_counter()
    placement = plan.placement()   # ranks relabeled at init; results in logical order
    results = rank_launch.run_ranks(_rank_main, world, args=(str(plan_path), str(module_path), opts),
                        backend=opts.backend, timeout_s=opts.timeout_s, placement=placement)
    run = run_result(plan, plan_path, opts, results[0], placement, time.perf_counter() - t0)
    if sharded:
        sh = results[0]["sharded"]
        run = dataclasses.replace(run, extra={**run.extra, "sharded": sh})
        progress(f"sharded: measured peak {sh['measured_peak_bytes_per_rank'] / 2**20:.2f} MiB per rank, predicted "
                 f"{sh['predicted_memory_per_rank_bytes'] / 2**20:.2f} MiB ({sh['memory_measured_by']}); plan / FSDP2 "
                 f"on every block {sh['ratio_to_fsdp2']:.2f}x" + (f", plan / DDP {sh['ratio_to_ddp']:.2f}x"
                                                                 if sh["ratio_to_ddp"] is not None else ""))
    # the probe read after the timed steps joins this machine's speed history, which only plans
    # made with ``--speed-history`` read (``profile.history``)
    record(results[0].get("speed_probe_s"), "execute")
    for note in run.notes:
        progress(note)
    v = run.validation
    out = _choose_out_dir(plan, out_dir, passed=v.passed)
    run = write_run_report(run, out)
    if not v.passed:
        w = worst(list(v.failures))
        raise ValidationFailed(
            f"validation failed: {len(v.failures)} of {v.checked} tensors differ; worst {w.tensor}: "
            f"max |diff| {w.max_abs_diff:.3g} vs max |ref| {w.max_abs_ref:.3g} "
            f"(rel {w.rel:.3g} > rtol {v.rtol:g}, {v.dtype}); details in {out / 'run.json'}",
            "the plan does not compute the single-process function: report it with the plan file")
    return run, out


#: run kind (``run_kind``) -> how ``execute`` runs the plan, where it is not ``_execute_mesh``
#: (one plan on the whole world: "native", "traced"); a strategy whose plans run differently
#: adds its row here (and to ``RANK_MAINS`` for one rank's work)
EXECUTORS = {"tournament": _execute_tournament, "stages": _execute_stages,
             "fsdp": _execute_sharded, "fsdp+traced": _execute_sharded}


def execute_runset(runset_path: str | Path, opts: ExecuteOptions, out_dir: str | Path | None = None,
                   progress=print) -> tuple[list[RunResult], Path]:
    """Run the plans of a run set (``autopar.runset/1``) at once, each on its own sub-mesh of
    one world, each validated against its own single-process reference and timed on its own
    mesh (its DDP baseline too). Writes ``OUT/<i>-<model>-w<n>/run.json`` per plan and
    ``OUT/runset.json`` (every plan's validation and step time); raises ``ValidationFailed``
    naming the plan when any fails. Plans in a run set use block placement."""

    runset_path = Path(runset_path)
    rs = load_runset(runset_path)
    modules = []
    for e in rs.entries:
        if not e.plan.placement().is_identity:
            raise PlanFileError(f"{e.plan_path} has rank placement {e.plan.placement()}; plans in a "
                                f"run set run on the sub-mesh the run set gives them",
                                "re-plan it with --placement block")
        check_batch_norm(e.plan, e.plan_path, opts.batch_norm)
        modules.append(str(check_plan_files(e.plan_path, e.plan)))
    progress(f"executing run set {runset_path}: {len(rs.entries)} plans at once on {rs.world_size} "
             f"processes ({', '.join(f'{e.plan.model.name} on ranks {list(e.ranks)}' for e in rs.entries)})")
    t0 = time.perf_counter()
    results = rank_launch.run_ranks(_runset_rank_main, rs.world_size, args=(str(runset_path), modules, opts),
                        backend=opts.backend, timeout_s=opts.timeout_s)
    wall = time.perf_counter() - t0
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = Path(out_dir) if out_dir is not None else Path("reports") / f"runset-{stamp}"
    runs: list[RunResult] = []
    summary = []
    for i, e in enumerate(rs.entries):
        r0 = results[e.ranks[0]]
        run = run_result(e.plan, e.plan_path, opts, r0, e.plan.placement(), wall)
        out = _choose_out_dir(e.plan, root / f"{i}-{e.plan.model.name}-w{len(e.ranks)}", run.validation.passed)
        run = write_run_report(run, out)
        runs.append(run)
        summary.append({"plan": str(e.plan_path), "ranks": list(e.ranks), "run": str(out / "run.json"),
                        "validation_passed": run.validation.passed,
                        "step_time_s": run.measured.step_time_s,
                        "predicted_step_time_s": run.predicted.step_time_s})
    atomic_write_json(root / "runset.json", {"schema": "autopar.runset-result/1", "runset": str(runset_path),
                                             "world_size": rs.world_size, "wall_s": wall, "plans": summary})
    bad = [(s["plan"], r) for s, r in zip(summary, runs) if not r.validation.passed]
    if bad:
        plan, r = bad[0]
        w = worst(list(r.validation.failures))
        raise ValidationFailed(f"validation failed for {plan} in the run set: worst {w.tensor} "
                               f"(rel {w.rel:.3g}); details in {root / 'runset.json'}",
                               "the plan does not compute the single-process function: report it")
    return runs, root


def _choose_out_dir(plan: Plan, out_dir: str | Path | None, passed: bool) -> Path:
    """The run folder; a failed run goes to ``failed-*`` inside it when a passing run is there."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if out_dir is None:
        out = Path("reports") / f"{plan.model.name}-w{plan.world_size}-{stamp}"
    else:
        out = Path(out_dir)
    if not passed and (out / "run.json").is_file():
        try:
            if load_run(out / "run.json").validation.passed:
                out = out / f"failed-{stamp}"
        except AutoparError:
            pass
    out.mkdir(parents=True, exist_ok=True)
    return out
