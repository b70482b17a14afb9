"""Benchmark: sharded data parallelism (issue 40), every figure written to one file.

1. **Chosen plan vs torch DDP vs torch FSDP2, side by side** (no memory limit): for the shipped
   GPT and Hugging Face GPT-2 at world 2 and 4, ``autopar plan`` chooses a plan; then three
   runners train in the SAME processes, one timed step each per round, the order rotated every
   round (machine drift falls on all alike): the chosen plan through ``autopar.parallelize`` (a
   DistModel stepped as ``autopar execute`` steps it, or for a sharded plan the module on FSDP2),
   torch DDP, and torch FSDP2 with
   ``fully_shard`` on every block and the root; same model, batch and SGD. Ratios per round,
   then the median; noise = the median over rounds of |t_r / t_(r-1) - 1| of DDP.
2. **HF GPT-2 under half of the data-parallel plan's memory** (world 4, batch 4; sizes
   ``AUTOPAR_HF_EMBED=128 AUTOPAR_HF_VOCAB=2048 AUTOPAR_HF_LAYERS=8``: at the shipped default
   sizes activations dominate and no sharding halves the memory): planned under half the native
   plan's own estimate, executed by ``autopar execute`` (float64 validation, measured peak memory
   per rank beside the prediction, plan / DDP / FSDP2).
3. **The 96-layer GPT at 1024 ranks** (8 per node, ``strategies/clusters/a100-128x8.json``),
   batch 256, under 400 MiB: ``autopar plan`` with the default kinds timed from a shell (wall
   clock, interpreter start included); which units are sharded on which axis, where the
   process's time went and the solver's notes (the memory-limited ILP is skipped when its
   Lagrangian bound proves the sharded plan faster: ``planner.solve``).

    python benchmarks/bench_fsdp.py [--rounds 12] [--out reports/benchmarks/fsdp.md]

The machine has 2 shared cores: only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODELS = {"gpt": ROOT / "strategies/examples/gpt.py", "hf_gpt2": ROOT / "strategies/examples/hf_gpt2.py"}
HF_BIG = {"AUTOPAR_HF_EMBED": "128", "AUTOPAR_HF_VOCAB": "2048", "AUTOPAR_HF_LAYERS": "8"}


def _rank(rank, world, plan_path, model_file, rounds):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import autopar
    from autopar.artifacts import load_plan
    from autopar.execute.fsdp import every_block
    from autopar.modelfile import load_model_file
    from autopar.runtime import fsdp as rf
    plan = load_plan(plan_path)
    mf = load_model_file(model_file, env=plan.model_env())
    b = plan.model.batch_size
    torch.manual_seed(1)
    x = mf.example_inputs(b)[0]
    y = mf.example_targets(b)
    xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
    loss_fn = mf.loss_fn()

    def build():
        torch.manual_seed(0)
        return mf.build_model()
    runs = {}
    pm = autopar.parallelize(build(), plan_path)       # the default engine (runtime.native)
    engine = getattr(pm, "engine", "torch-fsdp2")
    if getattr(pm, "autopar_plan", None) is not None:          # sharded: the module on FSDP2
        runs["plan"] = (pm, lambda: loss_fn(pm(xb), yb))
    elif engine == "torch-ddp":      # as ``autopar execute`` times it: the DDP object on the block
        ddp_e, _, local, loss_of, _ = pm._native.step_args(None, pm.shard_inputs([x]), y, loss_fn)
        runs["plan"] = (pm, lambda: loss_of(ddp_e(*local)))
    else:     # as ``autopar execute`` times a plan: this rank's inputs, its local loss, no loss all-reduce
        local = pm.shard_inputs([x])
        runs["plan"] = (pm, lambda: pm.local_loss(pm(*local), y, loss_fn))
    ddp = DDP(build())
    runs["ddp"] = (ddp, lambda: loss_fn(ddp(xb), yb))
    f2 = build()
    eb = every_block(f2)
    rf.parallelize(f2, rf.make_mesh(world), {k: v for k, v in eb.items() if k}, root=eb[""])
    runs["fsdp2"] = (f2, lambda: loss_fn(f2(xb), yb))
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, (m, _) in runs.items()}

    def step(k):
        opts[k].zero_grad(set_to_none=True)
        runs[k][1]().backward()
        opts[k].step()

    def timed(k):
        dist.barrier()
        t0 = time.perf_counter()
        step(k)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt)
    names = list(runs)
    for k in names:
        for _ in range(2):
            step(k)
    times = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % 3:] + names[:r % 3]:
            times[k].append(timed(k))
    return {"times": times, "engine": engine}


def side_by_side(model: str, world: int, rounds: int, work: Path) -> dict:
    from autopar.artifacts import PlanOptions
    from autopar.planner import make_plan
    from autopar.runtime.launch import run_ranks
    r = make_plan(MODELS[model], PlanOptions(world_size=world, out_dir=str(work / f"{model}-w{world}")))
    chosen = next(s for s in r.plan.strategies if s.chosen)
    got = run_ranks(_rank, world, args=(str(r.plan_path), str(MODELS[model]), rounds), timeout_s=900)[0]
    times = got["times"]
    per = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
    d = times["ddp"]
    noise = statistics.median(abs(d[i] / d[i - 1] - 1) for i in range(1, len(d)))
    med = {k: statistics.median(v) for k, v in times.items()}
    plan_vs_best = statistics.median(p / min(a, b) for p, a, b in zip(times["plan"], times["ddp"], times["fsdp2"]))
    return {"model": model, "world": world, "chosen": chosen.label, "runtime": r.plan.runtime.expected,
            "engine": got["engine"],
            "predicted_s": r.plan.predicted.step_time_s, "median_s": med,
            "plan_over_ddp": per("plan", "ddp"), "plan_over_fsdp2": per("plan", "fsdp2"),
            "plan_over_faster": plan_vs_best, "noise": noise,
            "candidates": [(s.strategy, s.label, s.step_time_s, s.illegal) for s in r.plan.strategies]}


def hf_half_memory(work: Path) -> dict:
    from autopar.artifacts import PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.modelfile import model_env
    from autopar.planner import make_plan
    with model_env(HF_BIG):
        dp = make_plan(MODELS["hf_gpt2"], PlanOptions(world_size=4, batch_size=4, write=False))
        dp_mem = next(s for s in dp.plan.strategies if s.strategy == "native").memory_per_rank_bytes
        limit = 0.5 * dp_mem
        t0 = time.perf_counter()
        r = make_plan(MODELS["hf_gpt2"], PlanOptions(world_size=4, batch_size=4, memory_limit_bytes=limit,
                                                     out_dir=str(work / "hf_gpt2-w4-half")))
        plan_s = time.perf_counter() - t0
        run, _ = execute(r.plan_path, ExecuteOptions(steps=6, warmup=1), out_dir=work / "hf_gpt2-w4-half-run",
                         progress=lambda s: None)
    sh = dict(run.extra)["sharded"]
    return {"sizes": HF_BIG, "dp_memory_bytes": dp_mem, "limit_bytes": limit, "plan_s": plan_s,
            "chosen": next(s.label for s in r.plan.strategies if s.chosen),
            "units": dict(r.plan.runtime.extra)["sharded"]["units"],
            "predicted_memory_bytes": r.plan.predicted.memory_per_rank_bytes,
            "measured_peak_bytes": sh["measured_peak_bytes_per_rank"],
            "memory_error": sh["measured_peak_bytes_per_rank"] / r.plan.predicted.memory_per_rank_bytes - 1,
            "validation_passed": run.validation.passed, "validated_tensors": run.validation.checked,
            "validation_dtype": run.validation.dtype,
            "plan_over_ddp": sh["ratio_to_ddp"], "plan_over_fsdp2": sh["ratio_to_fsdp2"]}


def gpt96(work: Path) -> dict:
    env = {**os.environ, "AUTOPAR_GPT_LAYERS": "96", "AUTOPAR_GPT_EMBED": "256"}
    out = work / "gpt96-w1024"
    cmd = [sys.executable, "-m", "autopar", "plan", str(MODELS["gpt"]), "--world-size", "1024", "--batch-size", "256",
           "--cluster", str(ROOT / "strategies/clusters/a100-128x8.json"), "--memory-limit", "400MiB",
           "--out", str(out)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"command": " ".join(cmd), "wall_s": wall, "error": p.stderr.strip().splitlines()[-1]}
    plan = json.loads((out / "plan.json").read_text())
    sh = plan["runtime"]["sharded"]
    levels: dict[str, list[str]] = {}
    for u, d in [("<root>", sh["root"])] + list(sh["units"].items()):
        key = "data parallel" if d is None else (f"ZeRO-{d['level']} over {d['data_axis']} ({d['dp']} ranks)")
        levels.setdefault(key, []).append(u)
    shown = " ".join(cmd[1:]).replace(str(ROOT) + "/", "").replace(str(out), "OUT")
    return {"command": "AUTOPAR_GPT_LAYERS=96 AUTOPAR_GPT_EMBED=256 python " + shown,
            "wall_s": wall, "memory_mib": plan["predicted"]["memory_per_rank_bytes"] / 2**20,
            "step_s": plan["predicted"]["step_time_s"], "runtime": plan["runtime"]["expected"],
            "timings_s": plan["timings_s"], "solver_notes": plan["solver"]["notes"],
            "units_by_decision": {k: len(v) for k, v in levels.items()},
            "examples": {k: v[:3] for k, v in levels.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", default=str(ROOT / "reports/benchmarks/fsdp.md"))
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args(argv)
    from autopar.io import atomic_write_json, atomic_write_text
    res: dict = {"created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": a.rounds}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        res["gpt96"] = gpt96(work)
        print("gpt96:", res["gpt96"], flush=True)
        res["hf_half"] = hf_half_memory(work)
        print("hf_half:", res["hf_half"], flush=True)
        res["side_by_side"] = []
        for model in MODELS:
            for w in a.worlds:
                row = side_by_side(model, w, a.rounds, work)
                print(model, w, row["plan_over_faster"], flush=True)
                res["side_by_side"].append(row)
    out = Path(a.out)
    atomic_write_json(out.with_suffix(".json"), res)
    M = 2**20
    h, g = res["hf_half"], res["gpt96"]
    lines = [f"# Sharded data parallelism (issue 40): figures of `benchmarks/bench_fsdp.py`", "",
             f"Made {res['created']} on this machine (2 shared CPU cores, gloo); ratios within one run only.", "",
             "## HF GPT-2 at world 4, batch 4, under half of the data-parallel plan's memory", "",
             f"- sizes {h['sizes']}; data-parallel plan {h['dp_memory_bytes'] / M:.2f} MiB per rank, limit "
             f"{h['limit_bytes'] / M:.2f} MiB; planned in {h['plan_s']:.1f} s: {h['chosen']}",
             f"- validation {'PASSED' if h['validation_passed'] else 'FAILED'} ({h['validated_tensors']} tensors, "
             f"{h['validation_dtype']}, against one process)",
             f"- peak memory per rank: measured {h['measured_peak_bytes'] / M:.2f} MiB, predicted "
             f"{h['predicted_memory_bytes'] / M:.2f} MiB ({h['memory_error'] * 100:+.1f} %)",
             f"- plan / DDP {h['plan_over_ddp']:.2f}x, plan / FSDP2 on every block {h['plan_over_fsdp2']:.2f}x", "",
             "## 96-layer GPT at 1024 ranks (8 per node), batch 256, under 400 MiB", ""]
    if "error" in g:
        lines += [f"- `{g['command']}` failed after {g['wall_s']:.1f} s: {g['error']}", ""]
    else:
        lines += [f"- `{g['command']}`", f"- planned in {g['wall_s']:.1f} s from a shell; predicted "
                  f"{g['memory_mib']:.1f} MiB per rank, step {g['step_s'] * 1e3:.0f} ms; runtime {g['runtime']}",
                  "- inside the process (plan.json timings_s): " + ", ".join(
                      f"{k} {v:.2f}" for k, v in g["timings_s"].items() if k.endswith("_s")),
                  "- solver notes: " + " / ".join(g["solver_notes"]),
                  "- units by decision: " + "; ".join(f"{k}: {n} (e.g. {', '.join(g['examples'][k])})"
                                                       for k, n in g["units_by_decision"].items()), ""]
    lines += ["## Chosen plan vs torch DDP vs torch FSDP2 (every block), no memory limit", "",
              "The plan runs on its default engine (`runtime.native`: `reports/benchmarks/engines.md`), timed "
              "as `autopar execute` times it.", "",
              "| model | world | chosen | engine | plan ms | DDP ms | FSDP2 ms | plan/DDP | plan/FSDP2 | plan/faster | noise |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["side_by_side"]:
        m = r["median_s"]
        lines.append(f"| {r['model']} | {r['world']} | {r['chosen']} | {r.get('engine', '')} | {m['plan'] * 1e3:.2f} | {m['ddp'] * 1e3:.2f} | "
                     f"{m['fsdp2'] * 1e3:.2f} | {r['plan_over_ddp']:.3f} | {r['plan_over_fsdp2']:.3f} | "
                     f"{r['plan_over_faster']:.3f} | {r['noise'] * 100:.1f} % |")
    atomic_write_text(out, "\n".join(lines) + "\n")
    print(f"written {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
