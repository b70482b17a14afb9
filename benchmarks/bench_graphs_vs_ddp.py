"""Benchmark: the GNN plans autopar chooses against torch DDP, side by side in one run.

For each GNN model (the untouched PyG NNConv, ``pyg_nnconv``: graph parallelism ``graphs(P)``
when chosen; the padded dense NNConv, ``gnn_pcqm4m``: pure ``sample(P)``) and world size, the
plan ``autopar plan`` chooses (default options, the given profile) is executed once by
``autopar execute`` (validation against one process, float64), then these runners train in
the SAME processes, one timed step each per round, in an order rotated every round (so machine
drift hits all alike):

* ``plan``       the chosen plan as ``autopar execute`` runs it (native: autopar's GradSync);
* ``plan/ddp-reducer``  the same with torch DDP's reducer (``AUTOPAR_NATIVE_REDUCER=ddp``);
* ``DDP``        torch DDP on the same model and batch, split as ``autopar execute``'s baseline
                 splits it (``execute.baseline.ddp_split``: ddp_shard, else whole graphs by the
                 generic split, else dim 0), timed twice per round (A and B: the noise).

Each ratio is taken per round against that round's DDP (mean of A and B), then the median over
the rounds; noise = median over rounds of |A / B - 1|. Target: plan / DDP <= 1.05.

    python benchmarks/bench_graphs_vs_ddp.py [--models pyg_nnconv,gnn_pcqm4m] [--worlds 2 4]
        [--rounds 20] [--calibration calibration/cpu-2core-gloo.json] [--out FILE]

Measured figures: the 2 cores of this machine are shared, so only ratios within one run mean
anything; the load average is printed at start and end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rank_main(rank: int, world: int, plan_path: str, rounds: int, seed: int) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autopar.artifacts import load_plan
    from autopar.execute.baseline import ddp_split
    from autopar.execute.runner import _import_generated
    from autopar.execute.timing import timed_steps
    from autopar.runtime.comm import Comm
    from autopar.runtime.entry import build_user_model, synthetic_batch

    comm = Comm.from_env()
    plan = load_plan(plan_path)
    gen = _import_generated(Path(plan_path).parent / plan.generated)
    runners, dms = [], []
    mf = None
    for reducer in ("gradsync", "ddp"):
        mf, model = build_user_model(plan, plan_path, seed)
        os.environ["AUTOPAR_NATIVE_REDUCER"] = reducer
        dm = gen.PlannedModel(plan, model, comm)
        os.environ.pop("AUTOPAR_NATIVE_REDUCER")
        dm.train()
        dms.append(dm)
        xs, ys = synthetic_batch(mf, plan.model.batch_size, seed + 1)
        local = dm.shard_inputs(xs)
        opt = torch.optim.SGD(dm.parameters(), lr=0.01, momentum=0.9)
        runners.append((dm, opt, local, (lambda o, dm=dm, ys=ys, lf=mf.loss_fn(): dm.local_loss(o, ys, lf)),
                        dm.finish_grads))
    for _ in range(2):
        xs, ys = synthetic_batch(mf, plan.model.batch_size, seed + 1)
        torch.manual_seed(seed)
        base, bx, by, rows, how = ddp_split(mf, xs, ys, comm, dms[0].graph)
        base.train()
        ddp = DDP(base, process_group=comm.mesh_group)
        lf = mf.loss_fn()
        cut = rows or (lambda o: o)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        runners.append((ddp, opt, bx, (lambda o, lf=lf, by=by, cut=cut: lf(cut(o), by)), lambda: None))
    times: list[list[float]] = [[] for _ in runners]
    for r in runners:
        timed_steps(*r, 2, comm, lambda: None, comm.barrier)
    for k in range(rounds):
        order = list(range(len(runners)))
        order = order[k % len(order):] + order[:k % len(order)]
        for i in order:
            times[i] += timed_steps(*runners[i], 1, comm, lambda: None, comm.barrier)
    return {"times": times, "native": dms[0].native, "why_not": dms[0].native_off_reason,
            "ddp_reducer": dms[1]._native is not None and dms[1]._native.ddp is not None,
            "split": how.lstrip("; ") or "samples along dim 0"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="pyg_nnconv,gnn_pcqm4m")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calibration", default=str(ROOT / "calibration/cpu-2core-gloo.json"))
    ap.add_argument("--out", default=None, help="also write the lines printed to this file")
    args = ap.parse_args(argv)
    from autopar.artifacts import PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.pipeline import make_plan
    from autopar.runtime.launch import run_ranks

    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    t_all = time.perf_counter()
    say(f"machine load at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) on "
        f"{os.cpu_count()} cores")
    say(f"GNN plans against torch DDP, side by side ({args.rounds} interleaved rounds; DDP twice per round)")
    summary = []
    for name in args.models.split(","):
        model = ROOT / f"strategies/examples/{name}.py"
        for world in args.worlds:
            with tempfile.TemporaryDirectory() as tmp:
                r = make_plan(str(model), PlanOptions(world_size=world, calibration=args.calibration,
                                                      out_dir=str(Path(tmp) / "plan"), measure_shapes=False))
                kinds = sorted({d.choice for d in r.plan.layers})
                run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, ddp=False),
                                 out_dir=Path(tmp) / "run", progress=lambda s: None)
                res = run_ranks(_rank_main, world, args=(str(r.plan_path), args.rounds, 0), timeout_s=900)[0]
            t_gs, t_dr, d_a, d_b = res["times"]
            ddp_k = [(a + b) / 2 for a, b in zip(d_a, d_b)]
            noise = statistics.median(abs(a / b - 1.0) for a, b in zip(d_a, d_b))
            gs = statistics.median(x / d for x, d in zip(t_gs, ddp_k))
            dr = statistics.median(x / d for x, d in zip(t_dr, ddp_k))
            say(f"{name} world {world}: plan {', '.join(kinds)} (predicted {r.plan.predicted.step_time_s * 1e3:.2f} ms); "
                f"validation {'passed' if run.validation.passed else 'FAILED'} ({run.validation.checked} tensors, "
                f"float64); native {'on' if res['native'] else 'OFF: ' + str(res['why_not'])}; DDP split: {res['split']}\n"
                f"   medians: plan {statistics.median(t_gs) * 1e3:.2f} ms, plan/ddp-reducer "
                f"{statistics.median(t_dr) * 1e3:.2f} ms{'' if res['ddp_reducer'] else ' (declined: GradSync)'}, "
                f"DDP {statistics.median(d_a + d_b) * 1e3:.2f} ms (noise {noise * 100:.1f} %)\n"
                f"   per round against DDP: plan {gs:.3f}, plan/ddp-reducer {dr:.3f}")
            summary.append((name, world, gs, noise, run.validation.passed))
    say("summary, the plan as autopar execute runs it against DDP (target <= 1.05):")
    for m, w, g, noise, ok in summary:
        verdict = "ok" if g <= 1.05 else ("within the noise" if g <= 1.05 + noise else "SLOWER than 1.05x DDP")
        say(f"   {m:<12} world {w}: plan / DDP {g:.3f} (noise {noise * 100:.1f} %) {verdict}"
            f"{'' if ok else ' VALIDATION FAILED'}")
    say(f"total {time.perf_counter() - t_all:.0f} s; machine load at end: "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    if args.out:
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
