"""``autopar execute`` of a pipeline-stage plan (plan.json ``runtime.expected == "stages"``): fresh
ranks run the stage layout with torch's schedule (``runtime.stages``), validate one step against
one process in the validation dtype (the loss, every gradient each rank holds, the parameters
after the SGD step execute uses everywhere), then time ``steps`` steps in float32 and report the
measured step and bubble beside the plan's prediction.

Idle share of the bottleneck stage: measured ``1 - M (f + b)_bottleneck / step``, with each
stage's forward and backward of one microbatch timed alone on its own ranks right after the timed
steps; predicted, the same quantity from plan.json's price, ``1 - ideal_s / step_s`` (ideal_s = M
max_s (f_s + b_s)): the schedule's bubble, the sends over the cuts, the gradient sync's tail and,
measured, any overhead of the step. The bubble alone (``price.bubble_s / step_s``) is reported as
predicted only: a run cannot time it apart from the sends.
"""

from __future__ import annotations

import copy
import datetime as _dt
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..artifacts import Baseline, Measured, Plan, RunResult, Validation
from ..artifacts import write_run
from ..io import atomic_write_text, sha256_file
from ..decomp.stages import StageLayout
from ..errors import PlanFileError
from ..modelfile import load_model_file, model_env
from ..runtime import launch as rank_launch
from ..decomp.stages import CutPlan
from ..runtime.fsdp import LiveBytes, state_tensors
from ..runtime.dtensor import whole
from ..runtime.stages import (_all_chunks, _static_metas, build_runner, check_cut_messages, record_sends, reference_step,
                              shard_of, stage_loss)
from ..runtime.comm import Comm
from ..runtime.stage_program import build_program_runner, local_metas
from . import timing
from .baseline import ddp_runner
from .validate import RULE, compare

#: interleaved rounds of the pipeline's and DDP's timed steps
ROUNDS = 4


def stage_layout(plan: Plan) -> tuple[StageLayout, dict[str, Any]]:
    """The plan's stage layout and price, or a ``PlanFileError`` naming what is missing."""
    rt = plan.runtime
    extra = dict(rt.extra) if rt is not None else {}
    if rt is None or rt.expected != "stages" or "stages" not in extra:
        raise PlanFileError("plan.json has no pipeline stages (runtime.stages)", "re-plan with --pipeline")
    if extra.get("executable") is False:
        raise PlanFileError(f"the plan's stages use sub-plans of kinds {extra.get('sub_plan_kinds')}, which the "
                            "stage runtime does not execute yet (it runs data parallelism inside a stage)",
                            "re-plan with a memory limit data-parallel stages fit, or more stages")
    return StageLayout.from_json(extra["stages"]), dict(extra.get("price") or {})


def _rank(rank: int, world: int, model_path: str, env: dict, layout_json: dict, opts) -> dict[str, Any]:
    import torch

    layout = StageLayout.from_json(layout_json)
    with model_env(env):
        mf = load_model_file(model_path)
    st = layout.stage_of(rank)
    m = layout.schedule.microbatches
    batch = opts["batch"]
    loss_fn = mf.loss_fn()
    dtype = getattr(torch, opts["dtype"])
    torch.manual_seed(opts["seed"])
    model = mf.build_model().to(dtype)
    xs = tuple(t.to(dtype) if torch.is_floating_point(t) else t for t in mf.example_inputs(batch))
    x = xs[0]                   # block stages feed one input; a stage plan takes every one
    y = mf.example_targets(batch)
    program = st.data == "plan"          # every stage runs the solver's plan (``runtime.stage_program``)
    # one microbatch's rows: of a dp replica's block (block stages), of the whole batch (a stage plan)
    mb = batch // m if program else batch // st.dp // m
    ref = copy.deepcopy(model)
    ref_loss = reference_step(ref, xs if program else x, y, loss_fn, m, dp=1 if program else st.dp)
    ref_p = dict(ref.named_parameters())
    ref_g = {n: p.grad.detach().clone() for n, p in ref_p.items()}
    torch.optim.SGD(ref.parameters(), lr=opts["lr"], momentum=opts["momentum"]).step()
    if program:
        return _program_rank(rank, world, mf, layout, opts, model, xs, y, loss_fn, ref, ref_loss, ref_g, mb)
    runner = build_runner(model, layout, rank, loss_fn, heads=opts.get("heads"), example_microbatch=x[:mb])
    sends = record_sends(runner)
    loss = runner.step(x, y)
    # what torch sent over this rank's cut is what plan.json's cut steps say (shapes; the plan's
    # bytes per element when the validation runs in the traced dtype): CutMessageMismatch otherwise
    cuts = [CutPlan.from_json(c) for c in opts.get("cuts") or ()]
    cut_messages = check_cut_messages(runner, sends, cuts) if cuts else 0
    held = list(runner.held_parameters(model).items())

    def want(n, t):          # the reference's tensor, cut to this rank's tp slice where it holds one
        return shard_of(t, runner.sharded[n], st.tp) if n in runner.sharded else t
    rtol, atol = opts["rtol"], opts["atol"]
    checks = [compare(f"rank {rank}: loss", loss.reshape(1), ref_loss.to(loss.dtype).reshape(1), rtol, atol)]
    # FSDP2 stages hold DTensor shards: ``whole`` gathers each over the stage's dp group
    checks += [compare(f"rank {rank}: grad {n}", whole(p.grad), want(n, ref_g[n]), rtol, atol) for n, p in held]
    torch.optim.SGD([p for _, p in held], lr=opts["lr"], momentum=opts["momentum"]).step()
    checks += [compare(f"rank {rank}: param {n} after step", whole(p.detach()), want(n, ref_p[n].detach()), rtol, atol)
               for n, p in held]
    # batch norm: the running statistics this stage holds after the step (per microbatch, averaged
    # over the dp replicas) against the reference's
    mine = {id(b) for _, mod in runner.modules for b in mod.buffers()}
    ref_b = dict(ref.named_buffers())
    checks += [compare(f"rank {rank}: buffer {n} after step", b.detach(), ref_b[n].detach().to(b.dtype), rtol, atol)
               for n, b in model.named_buffers() if id(b) in mine and n in ref_b and b.is_floating_point()
               and ("running_mean" in n or "running_var" in n)]

    # timing, float32, a fresh model and schedule
    torch.manual_seed(opts["seed"])
    model = mf.build_model()
    x32 = mf.example_inputs(batch)[0]
    # every chunk's inputs for the stage-alone timing below, taken before the runner shards the
    # model (an FSDP2 stage's parameters are DTensors outside its own modules' hooks)
    metas = _static_metas(_all_chunks(model, layout), x32[:mb])
    runner = build_runner(model, layout, rank, loss_fn, heads=opts.get("heads"), example_microbatch=x32[:mb])
    times, baseline, peak_bytes = _timed(runner, x32, y, mf, opts, world,
                                         lambda opt: [t for _, m in runner.modules for t in state_tensors(m, opt)])
    # this stage alone on one microbatch, every chunk it holds (every rank at once, as in the step)
    n_last = layout.num_stages * layout.schedule.virtual - 1        # the chunk with the head and loss
    last_loss = stage_loss(model, loss_fn)                          # as the schedule calls it (HF: .logits)
    fwd_s, bwd_s = _stage_alone(runner, opts["steps"], n_last,
                                lambda c, mod: tuple(t.detach().clone().requires_grad_(t.is_floating_point())
                                                     for t in metas[c][0]),
                                lambda out: last_loss(out, y[:mb]))
    return {"rank": rank, "stage": st.index, "checks": checks, "step_times_s": times,
            "fwd_s": fwd_s, "bwd_s": bwd_s, "loss": float(loss),
            "cut_messages_checked": cut_messages, "peak_bytes": peak_bytes, "baseline": baseline}


def _stage_alone(runner, steps: int, n_last: int, inputs, loss) -> tuple[float, float]:
    """This stage alone on one microbatch, every chunk it holds (every rank at once, as in the
    step): the medians over ``steps`` of its forward and of its backward (of ``loss(out)`` on the
    last chunk, of the outputs' sum elsewhere); ``inputs(c, module)`` makes a chunk's inputs."""
    import torch.distributed as dist
    fw, bw = [], []
    for _ in range(steps):
        f_s = b_s = 0.0
        for c, mod in runner.modules:
            inp = inputs(c, mod)
            dist.barrier()
            t0 = time.perf_counter()
            out = mod(*inp)
            t1 = time.perf_counter()
            (loss(out) if c == n_last else
             sum(o.float().sum() for o in (out if isinstance(out, tuple) else (out,)))).backward()
            f_s += t1 - t0
            b_s += time.perf_counter() - t1
        fw.append(f_s)
        bw.append(b_s)
    return statistics.median(fw), statistics.median(bw)


def _timed(runner, x32, y, mf, opts, world: int, state) -> tuple[list[float], dict | None, int]:
    """The pipeline's timed steps (float32, SGD) and, with ``opts["ddp"]``, torch DDP on the whole
    model and batch over the world in interleaved rounds (the machine's drift falls on both
    alike); then the peak memory of one more step: live tensor bytes of ``state(opt)`` (the
    stage's parameters, gradients, buffers and optimizer state) plus what the step allocates.
    Returns (step times, DDP baseline JSON or None, peak bytes)."""
    import torch
    import torch.distributed as dist
    opt = torch.optim.SGD(list(runner.parameters()), lr=opts["lr"], momentum=opts["momentum"])

    def pipeline_steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            opt.zero_grad()
            dist.barrier()
            t0 = time.perf_counter()
            runner.step(x32, y)
            dist.barrier()
            opt.step()
            out.append(time.perf_counter() - t0)
        return out
    pipeline_steps(opts["warmup"])
    ddp = comm = None
    if opts.get("ddp") and world > 1:
        comm = Comm.from_env()
        xs = list(x32) if isinstance(x32, tuple) else [x32]
        ddp = ddp_runner(mf, xs, y, mf.loss_fn(), comm, opts["seed"], opts["lr"], opts["momentum"])
        timing.timed_steps(*ddp.step_args(), opts["warmup"], comm, lambda: None, dist.barrier)
    runs = {"pipeline": pipeline_steps}
    if ddp is not None:
        runs["ddp"] = lambda n: timing.timed_steps(*ddp.step_args(), n, comm, lambda: None, dist.barrier)
    timed = timing.interleaved_rounds(runs, opts["steps"], ROUNDS)
    baseline = None if ddp is None else ddp.result(timed["ddp"]).to_json()
    opt.zero_grad(set_to_none=True)
    dist.barrier()
    with LiveBytes(also=state(opt)) as live:
        runner.step(x32, y)
        opt.step()
    dist.barrier()
    opt.zero_grad(set_to_none=True)
    return timed["pipeline"], baseline, int(live.peak_bytes)


def _program_rank(rank, world, mf, layout, opts, model, x, y, loss_fn, ref, ref_loss, ref_g, mb) -> dict[str, Any]:
    """``_rank`` for stages running a plan (``Stage.data == "plan"``): validation from the stage's
    ``DistModel`` (every parameter this rank's layers use, rebuilt whole over the stage's mesh),
    then the same timing, memory and stage-alone measures."""
    import torch
    st = layout.stage_of(rank)
    record = opts["stage_plan"]
    runner = build_program_runner(model, layout, record, rank, loss_fn)
    sends = record_sends(runner)
    loss = runner.step(x, y)
    cuts = [CutPlan.from_json(c) for c in opts.get("cuts") or ()]
    cut_messages = check_cut_messages(runner, sends, cuts) if cuts else 0
    rtol, atol = opts["rtol"], opts["atol"]
    dm = runner.dm
    checks = [compare(f"rank {rank}: loss", loss.reshape(1), ref_loss.to(loss.dtype).reshape(1), rtol, atol)]
    checks += [compare(f"rank {rank}: grad {n}", g, ref_g[n], rtol, atol) for n, g in sorted(dm.full_grads().items())]
    torch.optim.SGD(list(runner.parameters()), lr=opts["lr"], momentum=opts["momentum"]).step()
    ref_p = dict(ref.named_parameters())
    checks += [compare(f"rank {rank}: param {n} after step", p, ref_p[n].detach(), rtol, atol)
               for n, p in sorted(dm.full_params().items())]
    ref_b = dict(ref.named_buffers())        # batch norm: running statistics per microbatch, in order
    checks += [compare(f"rank {rank}: buffer {n} after step", b, ref_b[n].detach().to(b.dtype), rtol, atol)
               for n, b in sorted(dm.full_buffers().items()) if "running_mean" in n or "running_var" in n]

    torch.manual_seed(opts["seed"])
    model = mf.build_model()
    x32 = tuple(mf.example_inputs(opts["batch"]))
    runner = build_program_runner(model, layout, record, rank, loss_fn)
    times, baseline, peak_bytes = _timed(runner, x32, y, mf, opts, world, lambda opt: state_tensors(runner.dm, opt))
    # this stage alone on one microbatch (its chunks' inputs: random blocks shaped as the plan says)
    n_last = layout.num_stages * layout.schedule.virtual - 1
    run_dtype = next(iter(runner.parameters())).dtype
    dm = runner.dm

    def inputs(c, mod):
        if c == 0:
            return tuple(t[:mb] for t in x32)
        return tuple(torch.randn(t.shape, dtype=t.dtype).requires_grad_(True) if t.is_floating_point() else
                     torch.zeros(t.shape, dtype=t.dtype) for t in local_metas(dm, mod.ins, run_dtype))
    fwd_s, bwd_s = _stage_alone(runner, opts["steps"], n_last, inputs,
                                lambda out: dm.local_loss(dm.structured(out), y[:mb], loss_fn))
    return {"rank": rank, "stage": st.index, "checks": checks, "step_times_s": times,
            "fwd_s": fwd_s, "bwd_s": bwd_s, "loss": float(loss),
            "cut_messages_checked": cut_messages, "peak_bytes": peak_bytes, "baseline": baseline}


def _frac(x, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _mesh_words(st, stage_plan: dict | None) -> str:
    """How a stage uses its ranks, for the report: dp x tp of whole blocks, or the stage plan."""
    if st.data == "plan" and stage_plan:
        return f"the solver's plan on {len(st.ranks)} ranks: {', '.join(sorted(set(stage_plan.get('choices', ()))))}"
    return f"dp {st.dp}{' FSDP2' if st.data == 'fsdp' else ''} x tp {st.tp}"


def _stage_plan_lines(stage_plan: dict | None, cuts) -> list[str]:
    """The report's lines on a stage plan: each choice and how many layers take it, and what
    crosses each cut (each rank sends its block as its producer's layout leaves it)."""
    if not stage_plan:
        return []
    count: dict[str, int] = {}
    for c in stage_plan.get("choices", ()):
        count[c] = count.get(c, 0) + 1
    out = ["- stage plan (the model planned on each stage's ranks for one microbatch; every stage runs its "
           "layers of it): " + ", ".join(f"{c} x {n} layers" for c, n in sorted(count.items()))]
    for c in cuts or ():
        vals = ", ".join(f"{v['name']} {tuple(v['shape'])} ({v['steps_str']})" for v in c["values"])
        out.append(f"- cut {c['cut']} (stage {c['from_stage']} -> {c['to_stage']}): {vals}")
    return out


def execute_stages(plan_path: Path, plan: Plan, opts, out_dir, progress, choose_out_dir, write_report
                   ) -> tuple[RunResult, Path]:
    layout, price = stage_layout(plan)
    world = plan.world_size
    heads = dict(plan.runtime.extra).get("heads")
    rtol, atol = opts.tolerances()
    ropts = {"batch": plan.model.batch_size, "dtype": opts.validate_dtype, "seed": opts.seed, "lr": opts.lr,
             "momentum": opts.momentum, "rtol": rtol, "atol": atol, "warmup": opts.warmup, "steps": opts.steps, "heads": heads,
             "ddp": opts.ddp,
             "cuts": dict(plan.runtime.extra).get("cuts"), "stage_plan": dict(plan.runtime.extra).get("stage_plan")}
    progress(f"executing {plan_path} on {world} processes ({opts.backend}): {layout.num_stages} pipeline stages "
             f"({_mesh_words(layout.stages[0], ropts.get('stage_plan'))} each), "
             f"{layout.schedule.torch_class} over {layout.schedule.microbatches} microbatches; validation, "
             f"{opts.warmup}+{opts.steps} timed steps")
    t0 = time.perf_counter()
    res = rank_launch.run_ranks(_rank, world, args=(str(plan.model_file(plan_path)), plan.model_env(),
                                                     layout.to_json(), ropts),
                                backend=opts.backend, timeout_s=opts.timeout_s)
    checks = tuple(c for r in res for c in r["checks"])
    step = statistics.median(statistics.median(r["step_times_s"]) for r in res if r["step_times_s"])
    per_stage = {}
    for r in res:
        per_stage.setdefault(r["stage"], []).append(r["fwd_s"] + r["bwd_s"])
    bott = max(statistics.median(v) for v in per_stage.values())
    m = layout.schedule.microbatches
    measured_bubble = max(0.0, 1.0 - m * bott / step) if step > 0 else None
    p_step, p_ideal = price.get("step_s"), price.get("ideal_s")
    predicted_idle = 1.0 - p_ideal / p_step if p_step and p_ideal is not None else None
    predicted = plan.predicted.step_time_s
    baseline = Baseline.from_json(res[0]["baseline"]) if res[0].get("baseline") else None
    stages_rec = {"layout": layout.to_json(), "measured_step_s": step, "predicted_step_s": predicted,
                  "measured_bubble_fraction": measured_bubble,
                  "predicted_idle_fraction": predicted_idle,
                  "predicted_bubble_fraction": price.get("bubble_fraction"),
                  "stage_fwd_plus_bwd_s_alone": {str(k): statistics.median(v) for k, v in per_stage.items()},
                  "bubble_rule": "measured_bubble_fraction is the bottleneck stage's idle share, 1 - M (f + b)_bottleneck "
                                 "/ step (f, b: one microbatch on its stage alone): the schedule's bubble, the sends, the "
                                 "gradient sync's tail and any overhead; predicted_idle_fraction is the same quantity "
                                 "from the price (1 - ideal_s / step_s); predicted_bubble_fraction the bubble alone",
                  "cut_messages_checked": sum(r["cut_messages_checked"] for r in res),
                  "measured_peak_bytes_per_stage": {str(k): max(r["peak_bytes"] for r in res if r["stage"] == k)
                                                    for k in per_stage},
                  "predicted_peak_bytes_per_stage": {str(k): v for k, v in enumerate(price.get("peak_bytes") or ())},
                  "memory_measured_by": "live tensor bytes of one float32 step (runtime.fsdp.LiveBytes): the "
                                        "stage's parameters, gradients, buffers, optimizer state and what the step "
                                        "allocates; the max over the stage's ranks"}
    run = RunResult(
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        plan=str(plan_path), plan_sha256=sha256_file(plan_path), model=plan.model.name, world_size=world,
        backend=opts.backend, placement={"kind": "block"}, batch_size=plan.model.batch_size, options=asdict(opts),
        decompositions=(f"stages({layout.num_stages})",),
        validation=Validation(passed=all(c.passed for c in checks), dtype=opts.validate_dtype, rtol=rtol, atol=atol,
                              rule=RULE, checked=len(checks), checks=checks),
        measured=Measured(step_time_s=step, step_times_s=tuple(res[0]["step_times_s"]),
                          phases={"pipeline_step_s": step}, per_layer=(), grad_sync_bytes_per_step=0.0),
        predicted=plan.predicted, prediction_error=(predicted - step) / step if step > 0 else None,
        baseline=baseline, ratio_to_ddp=step / baseline.ddp_step_time_s if baseline is not None else None,
        wall_s=time.perf_counter() - t0,
        notes=(f"runtime: pipeline stages ({layout.schedule.torch_class}); the bottleneck stage idle "
               f"{measured_bubble:.2f} of the step, predicted {_frac(predicted_idle)} (of which the bubble "
               f"{_frac(price.get('bubble_fraction'))})",),
        extra={"stages": stages_rec})
    progress(run.notes[0])
    progress(f"step: measured {step * 1e3:.2f} ms, predicted {predicted * 1e3:.2f} ms")
    out = choose_out_dir(plan, out_dir, passed=run.validation.passed)
    write_run(run, out / "run.json")
    v = run.validation
    lines = [f"# {plan.model.name}: {layout.num_stages} pipeline stages on {world} ranks", "",
             f"- stages: " + "; ".join(f"{s.index}: blocks [{s.first_layer}, {s.stop_layer}) on ranks {list(s.ranks)} "
                                       f"({_mesh_words(s, ropts.get('stage_plan'))})" for s in layout.stages),
             *_stage_plan_lines(ropts.get("stage_plan"), ropts.get("cuts")),
             f"- schedule: {layout.schedule.torch_class}, {m} microbatches",
             f"- validation ({v.dtype}, {v.rule}, rtol {v.rtol:g}, atol {v.atol:g}): "
             f"{'passed' if v.passed else 'FAILED'}, {v.checked} tensors",
             "", "| | measured | predicted |", "|---|---|---|",
             f"| step | {step * 1e3:.3f} ms | {predicted * 1e3:.3f} ms |",
             *([f"| torch DDP step (whole model on every rank, interleaved rounds) | "
                f"{baseline.ddp_step_time_s * 1e3:.3f} ms (plan / DDP {step / baseline.ddp_step_time_s:.2f}) | |"]
               if baseline is not None else []),
             f"| bottleneck stage idle (bubble + sends + sync tail + overhead), share of the step | "
             f"{measured_bubble:.3f} | {_frac(predicted_idle, 3)} |",
             f"| of which the schedule's bubble | (not separable) | {_frac(price.get('bubble_fraction'), 3)} |",
             *[f"| peak memory per rank, stage {k} | {stages_rec['measured_peak_bytes_per_stage'][k] / 2**20:.2f} MiB | "
               f"{v / 2**20:.2f} MiB |" for k, v in stages_rec["predicted_peak_bytes_per_stage"].items()
               if k in stages_rec["measured_peak_bytes_per_stage"]], "",
             f"Idle share: {stages_rec['bubble_rule']}. Memory measured by "
             f"{stages_rec['memory_measured_by']}."]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    return run, out


__all__ = ["execute_stages", "stage_layout"]
