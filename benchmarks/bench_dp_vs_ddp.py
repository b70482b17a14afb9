"""Benchmark: autopar's pure data-parallel plan against torch DDP, side by side in one run.

For each model and world size, the plan with every layer ``sample(W)`` is executed once by
``autopar execute`` (validation against one process, float64), then three runners train in the
SAME processes, one timed step each per round, in an order rotated every round (so machine
drift hits all alike):

* ``native/ddp-reducer``  a pure data-parallel plan running the user's module on the plan's
              parameters (``autopar.runtime.native``), gradients summed by torch DDP's reducer
              (the default: what ``autopar execute`` runs where every parameter gets a gradient);
* ``native/gradsync``  the same with autopar's ``GradSync`` (``AUTOPAR_NATIVE_REDUCER=gradsync``);
* ``traced``  the same plan through the traced program op by op (``native=False``: what every
              plan ran before the native path, and what mixed plans still run);
* ``DDP``     torch DDP on the same model and batch, timed twice per round (A and B: the noise).

Each ratio is taken per round against that round's DDP (mean of A and B), then the median over
the rounds; noise = median over rounds of |A / B - 1|. After the rounds, the native and traced
runners (same start, same batches, same number of steps) must hold the same parameters: the
largest relative difference is printed. With batch norm the plans use local statistics over the
samples of a rank (the default), so DDP computes the same function. Target: native/ddp-reducer
/ DDP <= 1.0 within the noise.

    python benchmarks/bench_dp_vs_ddp.py [--models resnet2d,cnn3d_large,nobn] [--worlds 2 4]
        [--rounds 12] [--calibration PROFILE] [--out reports/benchmarks/dp_vs_ddp.txt]

Measured figures: the 2 cores of this machine are shared, so only ratios within one run mean
anything; say whether the machine was quiet.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"resnet2d": ROOT / "strategies/examples/resnet2d.py",
          "cnn3d_large": ROOT / "strategies/examples/cnn3d_large.py",
          "wide_resnet": ROOT / "strategies/examples/wide_resnet.py",
          "nobn": ROOT / "benchmarks/models/resnet2d_nobn.py"}


def _rank_main(rank: int, world: int, plan_path: str, rounds: int, seed: int) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopar.artifacts import load_plan
    from autopar.decomp.sharding import Partial, Shard, Sharding
    from autopar.execute.runner import _import_generated
    from autopar.execute.timing import timed_steps
    from autopar.runtime.comm import Comm, local_slice
    from autopar.runtime.entry import build_user_model, synthetic_batch

    comm = Comm.from_env()
    plan = load_plan(plan_path)
    gen = _import_generated(Path(plan_path).parent / plan.generated)
    import os
    runners, dms = [], []
    mf = None
    for native, reducer in ((None, "ddp"), (None, "gradsync"), (False, "ddp")):
        mf, model = build_user_model(plan, plan_path, seed)
        os.environ["AUTOPAR_NATIVE_REDUCER"] = reducer
        dm = gen.PlannedModel(plan, model, comm, native=native)
        os.environ.pop("AUTOPAR_NATIVE_REDUCER")
        dm.train()
        dms.append(dm)
        loss_fn = mf.loss_fn()
        xs, ys = synthetic_batch(mf, plan.model.batch_size, seed + 1)
        local = dm.shard_inputs(xs)
        opt = torch.optim.SGD(dm.parameters(), lr=0.01, momentum=0.9)
        runners.append((dm, opt, local, (lambda o, dm=dm, ys=ys, lf=loss_fn: dm.local_loss(o, ys, lf)),
                        dm.finish_grads))
    for _ in range(2):
        torch.manual_seed(seed)
        base = mf.build_model()
        base.train()
        ddp = DDP(base, process_group=comm.mesh_group)
        xs, ys = synthetic_batch(mf, plan.model.batch_size, seed + 1)
        lay = Sharding.of((Shard(0), comm.world))
        bx = [local_slice(x, lay, comm) for x in xs]
        by = local_slice(ys, lay, comm) if ys is not None else None
        lf = mf.loss_fn()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        runners.append((ddp, opt, bx, (lambda o, lf=lf, by=by: lf(o, by) if by is not None else lf(o)),
                        lambda: None))
    times: list[list[float]] = [[] for _ in runners]
    for r in runners:
        timed_steps(*r, 2, comm, lambda: None, comm.barrier)
    for k in range(rounds):
        order = list(range(len(runners)))
        order = order[k % len(order):] + order[:k % len(order)]
        for i in order:
            times[i] += timed_steps(*runners[i], 1, comm, lambda: None, comm.barrier)
    full = [dm.full_params() for dm in dms]
    diff = max(float((a[q] - full[-1][q]).abs().max() / full[-1][q].abs().max().clamp_min(1e-30))
               for a in full[:-1] for q in a)
    return {"times": times, "native": [dm.native for dm in dms], "why_not": dms[0].native_off_reason,
            "ddp_reducer": dms[0]._native is not None and dms[0]._native.ddp is not None,
            "param_rel_diff": diff}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet2d,cnn3d_large,nobn")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--out", default=None, help="also write the lines printed to this file")
    args = ap.parse_args(argv)
    from autopar.artifacts import PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan
    from autopar.runtime.launch import run_ranks

    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    import os
    t_all = time.perf_counter()
    say(f"machine load at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) on "
        f"{os.cpu_count()} cores")
    say(f"pure data parallelism against torch DDP, side by side ({args.rounds} interleaved rounds; "
        f"DDP twice per round); batch norm: local statistics over a rank's samples (DDP's function)")
    summary = []
    for name in args.models.split(","):
        model = MODELS.get(name, Path(name))
        for world in args.worlds:
            with tempfile.TemporaryDirectory() as tmp:
                r = make_plan(str(model), PlanOptions(world_size=world, calibration=args.calibration,
                                                      out_dir=str(Path(tmp) / "plan"), kinds=["sample"],
                                                      placement="block"))
                run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, ddp=False),
                                 out_dir=Path(tmp) / "run", progress=lambda s: None)
                res = run_ranks(_rank_main, world, args=(str(r.plan_path), args.rounds, 0), timeout_s=900)[0]
            t_nat, t_gs, t_tr, d_a, d_b = res["times"]
            ddp_k = [(a + b) / 2 for a, b in zip(d_a, d_b)]
            noise = statistics.median(abs(a / b - 1.0) for a, b in zip(d_a, d_b))
            nat = statistics.median(x / d for x, d in zip(t_nat, ddp_k))
            tr = statistics.median(x / d for x, d in zip(t_tr, ddp_k))
            gs = statistics.median(x / d for x, d in zip(t_gs, ddp_k))
            gain = statistics.median(x / y for x, y in zip(t_gs, t_tr))
            say(f"{Path(model).stem} world {world}: validation {'passed' if run.validation.passed else 'FAILED'} "
                f"({run.validation.checked} tensors, float64); native path "
                f"{'on' if res['native'][0] else 'OFF: ' + str(res['why_not'])}"
                f"{'' if res['ddp_reducer'] or not res['native'][0] else ' (DDP reducer declined: GradSync)'}\n"
                f"   medians: native/ddp-reducer {statistics.median(t_nat) * 1e3:.2f} ms, native/gradsync "
                f"{statistics.median(t_gs) * 1e3:.2f} ms, traced {statistics.median(t_tr) * 1e3:.2f} ms, "
                f"DDP {statistics.median(d_a + d_b) * 1e3:.2f} ms (noise {noise * 100:.1f} %)\n"
                f"   per round against DDP: native/ddp-reducer {nat:.3f}, native/gradsync {gs:.3f}, traced "
                f"{tr:.3f}; native/gradsync / traced {gain:.3f}\n"
                f"   parameters after {args.rounds + 2} steps, native runners vs traced: max rel diff "
                f"{res['param_rel_diff']:.1e}")
            summary.append((Path(model).stem, world, nat, noise, run.validation.passed))
    say("summary, the default (native/ddp-reducer) against DDP (target <= 1.0 within the noise):")
    for m, w, nat, noise, ok in summary:
        verdict = "ok" if nat <= 1.0 + noise else "SLOWER than DDP beyond the noise"
        say(f"   {m:<14} world {w}: native/ddp-reducer / DDP {nat:.3f} (noise {noise * 100:.1f} %) {verdict}"
            f"{'' if ok else ' VALIDATION FAILED'}")
    say(f"total {time.perf_counter() - t_all:.0f} s; machine load at end: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    if args.out:
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
