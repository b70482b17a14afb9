"""``autopar execute``: run a plan on local processes, prove it equivalent, time it, compare.

For each rank (fresh processes, gloo on CPU / NCCL on GPU):

1. build the user's model with the plan's seed and the generated module's ``PlannedModel``;
2. **validation step** (float64 by default, the model and batch converted): the same synthetic
   batch on every rank, sliced to the input layout;
   forward, the local loss share, backward, gradient sync; assemble the output, the loss, the
   input gradients and every parameter gradient, then one SGD-with-momentum step and every
   parameter after it; rank 0 computes the same with the single-process model and compares
   (``max|a-b| <= rtol * max|b| + atol`` per tensor; ``DEFAULT_TOL``: float64 rtol 1e-9, float32
   rtol 2e-5);
3. **timing** (float32, a fresh copy of the model): ``warmup`` + ``steps`` training steps, each
   fenced by a barrier and taken as the slowest rank's wall time; ``instrumented_steps`` more
   give per-layer times (median per layer);
4. **baseline**: torch DDP on the same model and batch (samples split over the world), timed
   the same way in the same processes.

Results go to ``RUNDIR/run.json`` (+ report.md and plots, see ``autopar.report``), written
atomically; a failed run never replaces a passing ``run.json``: it goes to ``RUNDIR/failed-*``.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..codegen.plan import load_plan
from ..errors import PlanFileError, ValidationFailed
from ..io import atomic_write_json, read_json, sha256_file

RUN_SCHEMA = "autopar.run/1"
#: (rtol, atol) of each tensor's max magnitude. In float64 a decomposition must agree to
#: rounding (it is the same function); in float32 a ReLU whose input sits within rounding of 0
#: can flip, so ill-conditioned models differ by more than rounding: validate in float64 by
#: default and time in float32.
DEFAULT_TOL = {"float64": (1e-9, 1e-12), "float32": (2e-5, 1e-7)}


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

    def tolerances(self) -> tuple[float, float]:
        rt, at = DEFAULT_TOL[self.validate_dtype]
        return (self.rtol if self.rtol is not None else rt, self.atol if self.atol is not None else at)
    timeout_s: float = 600.0
    instrumented_steps: int = 3
    ddp: bool = True
    backend: str = "gloo"


def _import_generated(path: Path):
    spec = importlib.util.spec_from_file_location(f"autopar_generated_{abs(hash(str(path))) % 10**8}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compare(name: str, got, ref, rtol: float, atol: float) -> dict[str, Any]:
    import torch
    got = got.detach().double()
    ref = ref.detach().double()
    if tuple(got.shape) != tuple(ref.shape):
        return {"tensor": name, "passed": False, "max_abs_diff": math.inf, "max_abs_ref": 0.0,
                "rel": math.inf, "note": f"shape {tuple(got.shape)} != {tuple(ref.shape)}"}
    diff = float((got - ref).abs().max()) if got.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    ok = diff <= rtol * scale + atol
    return {"tensor": name, "passed": bool(ok), "max_abs_diff": diff, "max_abs_ref": scale,
            "rel": diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)}


def _rank_main(rank: int, world: int, plan_path: str, module_path: str, opts: ExecuteOptions) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ..decomp.layout import Layout
    from ..runtime.comm import Comm, assemble, local_slice
    from ..runtime.entry import build_user_model, synthetic_batch
    from ..runtime.model import LayerTimer

    plan = load_plan(plan_path, world)
    gen = _import_generated(Path(module_path))
    comm = Comm.from_env()
    device = comm.device
    vdt = getattr(torch, opts.validate_dtype)
    rtol, atol = opts.tolerances()

    def make(dtype):
        mf_, model_ = build_user_model(plan, plan_path, opts.seed)
        model_.to(device=device, dtype=dtype)
        dm_ = gen.PlannedModel(plan, model_, comm)
        dm_.train()
        return mf_, dm_

    mf, dm = make(vdt)
    batch = int(plan["model"]["batch_size"])
    xs32, ys = synthetic_batch(mf, batch, opts.seed + 1)
    xs = [x.to(device=device, dtype=vdt) if x.is_floating_point() else x.to(device) for x in xs32]
    ys = ys.to(device) if ys is not None else None
    if ys is not None and ys.is_floating_point():
        ys = ys.to(vdt)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    loss_fn = mf.loss_fn()

    def barrier():
        if world > 1:
            dist.barrier()

    # ---- 1. validation step -------------------------------------------------------------
    local = dm.shard_inputs(xs)
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in local]
    out = dm(*leaves)
    loss_r = dm.local_loss(out, ys, loss_fn)
    loss_r.backward()
    dm.finish_grads()
    out_shape = dm.graph.value_shape(dm.graph.output)
    out_full = assemble(out.detach(), dm.loss_layout(), out_shape, comm, "value")
    loss_t = loss_r.detach().clone().reshape(1).to(device)
    if world > 1:
        dist.all_reduce(loss_t)
    in_grads = {}
    for gi, leaf in zip(dm.graph.inputs, leaves):
        if leaf.grad is not None:
            in_grads[gi.name] = assemble(leaf.grad, dm.input_layout(gi.name), gi.shape, comm, "sum")
    grads = dm.full_grads()
    opt = torch.optim.SGD(dm.parameters(), lr=opts.lr, momentum=opts.momentum)
    opt.step()
    after = dm.full_params()
    full_bufs = dm.full_buffers()
    checks: list[dict[str, Any]] = []
    if rank == 0:
        torch.manual_seed(opts.seed)
        ref = mf.build_model().to(device=device, dtype=vdt)
        ref.train()
        rx = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
        rout = ref(*rx)
        rloss = loss_fn(rout, ys) if ys is not None else loss_fn(rout)
        rloss.backward()
        checks.append(_compare("output", out_full, rout, rtol, atol))
        checks.append(_compare("loss", loss_t.reshape(()), rloss, rtol, atol))
        for gi, x in zip(dm.graph.inputs, rx):
            if x.grad is not None and gi.name in in_grads:
                checks.append(_compare(f"input_grad:{gi.name}", in_grads[gi.name], x.grad, rtol, atol))
        for name, p in ref.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            checks.append(_compare(f"grad:{name}", grads[name], g, rtol, atol))
        ropt = torch.optim.SGD(ref.parameters(), lr=opts.lr, momentum=opts.momentum)
        ropt.step()
        for name, p in ref.named_parameters():
            checks.append(_compare(f"param_after_step:{name}", after[name], p, rtol, atol))
        for name, b in ref.named_buffers():
            if b.is_floating_point() and name in full_bufs:
                checks.append(_compare(f"buffer:{name}", full_bufs[name], b, rtol, atol))
    barrier()

    # ---- 2. timing (float32, fresh model) ---------------------------------------------------
    if vdt != torch.float32:
        mf, dm = make(torch.float32)
        xs = [x.to(device) for x in xs32]
        ys = ys.to(torch.float32) if (ys is not None and ys.is_floating_point()) else ys
        opt = torch.optim.SGD(dm.parameters(), lr=opts.lr, momentum=opts.momentum)
        local = dm.shard_inputs(xs)

    def step_once(model, optim, inputs, loss_of, finish):
        optim.zero_grad(set_to_none=True)
        o = model(*inputs)
        l = loss_of(o)
        l.backward()
        finish()
        optim.step()

    def timed(model, optim, inputs, loss_of, finish, n):
        ts = []
        for _ in range(n):
            barrier()
            sync()
            t0 = time.perf_counter()
            step_once(model, optim, inputs, loss_of, finish)
            sync()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            if world > 1:
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            ts.append(float(dt))
        return ts

    plan_loss = lambda o: dm.local_loss(o, ys, loss_fn)  # noqa: E731
    timed(dm, opt, local, plan_loss, dm.finish_grads, opts.warmup)
    plan_times = timed(dm, opt, local, plan_loss, dm.finish_grads, opts.steps)

    # instrumented steps: per-layer forward/backward segments, the median of each over the
    # steps (of the slowest rank in each step)
    n_layers = len(dm.graph.layers)
    samples = []
    for _ in range(max(1, opts.instrumented_steps)):
        dm.timer = LayerTimer(sync)
        barrier()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        o = dm(*local)
        t_fwd_end = time.perf_counter()
        plan_loss(o).backward()
        t_bwd_end = time.perf_counter()
        dm.finish_grads()
        t_sync_end = time.perf_counter()
        opt.step()
        t_end = time.perf_counter()
        per = dm.timer.per_layer_s(t_fwd_end, t_bwd_end)
        dm.timer = None
        arr = torch.zeros(2 * n_layers + 4, dtype=torch.float64)
        for li, d in per.items():
            arr[2 * li] = d["fwd_s"]
            arr[2 * li + 1] = d["bwd_s"]
        arr[-4] = t_fwd_end - t0
        arr[-3] = t_bwd_end - t_fwd_end
        arr[-2] = t_sync_end - t_bwd_end
        arr[-1] = t_end - t_sync_end
        if world > 1:
            arr = arr.to(device)
            dist.all_reduce(arr, op=dist.ReduceOp.MAX)
            arr = arr.cpu()
        samples.append(arr)
    arr = torch.stack(samples).median(dim=0).values
    per_layer = [{"layer": li, "fwd_s": float(arr[2 * li]), "bwd_s": float(arr[2 * li + 1])}
                 for li in range(n_layers)]
    phases = {"fwd_s": float(arr[-4]), "bwd_s": float(arr[-3]), "grad_sync_wait_s": float(arr[-2]),
              "optimizer_s": float(arr[-1])}

    # ---- 3. DDP baseline ------------------------------------------------------------------
    baseline: dict[str, Any] = {}
    if opts.ddp and world > 1 and batch >= world:
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(opts.seed)
        base = mf.build_model().to(device)
        base.train()
        ddp = DDP(base, device_ids=[device.index] if device.type == "cuda" else None)
        lay = Layout(((0, world),))
        bx = [local_slice(x, lay, comm) for x in xs]
        by = local_slice(ys, lay, comm) if ys is not None else None
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=opts.lr, momentum=opts.momentum)
        ddp_loss = (lambda o: loss_fn(o, by)) if by is not None else (lambda o: loss_fn(o))
        timed(ddp, ddp_opt, bx, ddp_loss, lambda: None, opts.warmup)
        ddp_times = timed(ddp, ddp_opt, bx, ddp_loss, lambda: None, opts.steps)
        has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in base.modules())
        baseline = {"ddp_step_times_s": ddp_times, "ddp_step_time_s": statistics.median(ddp_times),
                    "ddp_allreduce_bytes_per_step": sum(p.numel() * p.element_size()
                                                        for p in base.parameters() if p.requires_grad),
                    "equivalent": not has_bn,
                    "note": ("torch DDP with local batch-norm statistics (SyncBatchNorm has no CPU "
                             "path): a timing baseline that computes a slightly different function")
                    if has_bn else "torch DDP, samples split over the world"}
    barrier()
    return {"rank": rank, "checks": checks, "plan_step_times_s": plan_times, "per_layer": per_layer,
            "phases": phases, "baseline": baseline,
            "grad_sync_bytes_per_step": dm.gradsync.bytes_per_step}


def execute(plan_path: str | Path, opts: ExecuteOptions, out_dir: str | Path | None = None,
            progress=print) -> tuple[dict[str, Any], Path]:
    """Run, validate, time; write run.json + report; return (run, the folder written)."""
    from ..runtime.launch import run_ranks

    plan_path = Path(plan_path)
    plan = load_plan(plan_path)
    world = int(plan["world_size"])
    module_path = plan_path.parent / plan["generated"]
    if not module_path.is_file():
        from ..codegen.generate import generate_module
        from ..io import atomic_write_text
        atomic_write_text(module_path, generate_module(plan))
    from ..runtime.entry import model_path
    mpath = model_path(plan, plan_path)
    if not mpath.is_file():
        raise PlanFileError(f"the plan's model file {mpath} is missing", "re-plan from the model file")
    if sha256_file(mpath) != plan["model"]["sha256"]:
        raise PlanFileError(f"the model file {mpath} changed since the plan was made",
                            "re-plan it (autopar plan) so that the plan matches the model")
    progress(f"executing {plan_path} on {world} processes ({opts.backend}): validation, "
             f"{opts.warmup}+{opts.steps} timed steps, DDP baseline")
    t0 = time.perf_counter()
    from ..runtime.entry import plan_placement
    placement = plan_placement(plan)   # ranks relabeled at init; results in logical order
    results = run_ranks(_rank_main, world, args=(str(plan_path), str(module_path), opts),
                        backend=opts.backend, timeout_s=opts.timeout_s, placement=placement)
    wall = time.perf_counter() - t0
    r0 = results[0]
    checks = r0["checks"]
    failures = [c for c in checks if not c["passed"]]
    measured = statistics.median(r0["plan_step_times_s"])
    predicted = float(plan["predicted"]["step_time_s"])
    per_pred = {l["layer"]: l["predicted"] for l in plan["layers"]}
    trans_into: dict[int, float] = {}
    for t in plan.get("transitions", []):
        trans_into[t["dst"]] = trans_into.get(t["dst"], 0.0) + t["fwd_s"] + t["bwd_s"]
    per_layer = []
    for m in r0["per_layer"]:
        p = per_pred[m["layer"]]
        lay = plan["layers"][m["layer"]]
        per_layer.append({"layer": m["layer"], "module": lay["module"] or lay["name"], "choice": lay["choice"],
                          "measured_s": m["fwd_s"] + m["bwd_s"],
                          "measured_fwd_s": m["fwd_s"], "measured_bwd_s": m["bwd_s"],
                          "predicted_s": p["fwd_compute_s"] + p["fwd_comm_s"] + p["bwd_compute_s"] +
                          p["bwd_comm_s"] + trans_into.get(m["layer"], 0.0),
                          "source": p.get("source", "")})
    run = {
        "schema": RUN_SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "plan": str(plan_path), "plan_sha256": sha256_file(plan_path),
        "model": plan["model"]["name"], "world_size": world, "backend": opts.backend,
        "placement": placement.to_json(),
        "batch_size": plan["model"]["batch_size"],
        "options": asdict(opts),
        "decompositions": sorted({l["choice"] for l in plan["layers"]}),
        "validation": {"passed": not failures, "dtype": opts.validate_dtype,
                       "rtol": opts.tolerances()[0], "atol": opts.tolerances()[1],
                       "rule": "max|a-b| <= rtol*max|ref| + atol per tensor",
                       "checked": len(checks), "failures": failures, "checks": checks},
        "measured": {"step_time_s": measured, "step_times_s": r0["plan_step_times_s"],
                     "phases": r0["phases"], "per_layer": per_layer,
                     "grad_sync_bytes_per_step": r0["grad_sync_bytes_per_step"]},
        "predicted": {"step_time_s": predicted, **{k: v for k, v in plan["predicted"].items() if k != "step_time_s"}},
        "prediction_error": (predicted - measured) / measured if measured > 0 else None,
        "baseline": r0["baseline"],
        "ratio_to_ddp": (measured / r0["baseline"]["ddp_step_time_s"]) if r0["baseline"] else None,
        "wall_s": wall,
    }
    out = _choose_out_dir(plan, out_dir, passed=not failures)
    from ..report.report import write_run_report
    write_run_report(run, out)
    if failures:
        worst = max(failures, key=lambda c: c["rel"] if c["rel"] == c["rel"] else math.inf)
        raise ValidationFailed(
            f"validation failed: {len(failures)} of {len(checks)} tensors differ; worst {worst['tensor']}: "
            f"max |diff| {worst['max_abs_diff']:.3g} vs max |ref| {worst['max_abs_ref']:.3g} "
            f"(rel {worst['rel']:.3g} > rtol {opts.tolerances()[0]:g}, {opts.validate_dtype}); details in {out / 'run.json'}",
            "the plan does not compute the single-process function: report it with the plan file")
    return run, out


def _choose_out_dir(plan: dict[str, Any], out_dir: str | Path | None, passed: bool) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if out_dir is None:
        out = Path("reports") / f"{plan['model']['name']}-w{plan['world_size']}-{stamp}"
    else:
        out = Path(out_dir)
    prev = out / "run.json"
    if not passed and prev.is_file():
        try:
            if read_json(prev, ValueError, "run")["validation"]["passed"]:
                out = out / f"failed-{stamp}"
        except Exception:
            pass
    out.mkdir(parents=True, exist_ok=True)
    return out
