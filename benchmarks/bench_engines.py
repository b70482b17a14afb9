"""The engines of a pure data-parallel plan side by side (issue 40, ``autopar.runtime.native``,
"Engines"): which one ``autopar execute`` and ``autopar.parallelize`` run by default.

For the shipped GPT and HF GPT-2 (``strategies/examples``, default sizes) at world 2 and 4 the
default plan (``autopar plan``, no memory limit: native data parallelism) is built on each
engine in the same processes and timed as ``autopar execute`` times it (``execute.runner``):

* ``torch-ddp``: torch's ``DistributedDataParallel`` itself (its averaging reducer), the DDP
  object on the rank's block with the model file's loss (``NativeDataParallel.step_args``);
* ``autopar-native``: the planned module (autopar's wrapper, DDP's reducer with a SUM hook),
  its ``local_loss`` and ``finish_grads``;
* ``user DDP``: torch DDP as a user writes it (defaults: buffers broadcast every forward), the
  baseline ``execute`` and ``bench_fsdp`` compare with.

Each round times a block of ``--steps`` consecutive SGD steps of each (``execute.timing.
timed_block``: the slowest rank's mean step), the order rotating round by round so that drift
falls on all alike. Per model and world: the median over rounds of the per-round ratio
torch-ddp / autopar-native, its 25-75 % spread, and the noise (the median round-to-round
change of user DDP). The verdict, the default engine (``runtime.native.DEFAULT_ENGINE``, held
to this file by ``tests/test_engines.py``): torch-ddp when the median of the rows' ratios is
<= 1.0 (it is the faster or equal), else autopar-native.

    python benchmarks/bench_engines.py [--rounds 40] [--steps 4] [--out reports/benchmarks/engines.md]

The machine has 2 shared cores: only ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODELS = {"gpt": ROOT / "strategies/examples/gpt.py", "hf_gpt2": ROOT / "strategies/examples/hf_gpt2.py"}
NAMES = ("torch-ddp", "autopar-native", "user DDP")


def _rank(rank, world, plan_path, model_file, rounds, steps):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import autopar
    from autopar.artifacts import load_plan
    from autopar.execute import timing
    from autopar.modelfile import load_model_file
    from autopar.runtime.comm import Comm
    plan = load_plan(plan_path)
    mf = load_model_file(model_file, env=plan.model_env())
    comm = Comm.from_env()
    b = plan.model.batch_size
    torch.manual_seed(1)
    x = mf.example_inputs(b)[0]
    y = mf.example_targets(b)
    loss_fn = mf.loss_fn()

    def build():
        torch.manual_seed(0)
        return mf.build_model()

    def sgd(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    args = {}
    engines = {}
    for name, eng in (("torch-ddp", "torch-ddp"), ("autopar-native", "autopar")):
        dm = autopar.parallelize(build(), plan_path, engine=eng)
        engines[name] = dm.engine
        opt = sgd(dm.parameters())
        local = dm.shard_inputs([x])
        if dm.engine == "torch-ddp":           # as ``execute`` times it (``execute.runner``)
            args[name] = dm._native.step_args(opt, local, y, loss_fn)
        else:
            args[name] = (dm, opt, local, lambda o, dm=dm: dm.local_loss(o, y, loss_fn), dm.finish_grads)
    ddp = DDP(build())
    xb, yb = x.chunk(world)[rank], y.chunk(world)[rank]
    args["user DDP"] = (ddp, sgd(ddp.parameters()), [xb], lambda o: loss_fn(o, yb), lambda: None)
    none = lambda: None  # noqa: E731
    for k in NAMES:
        timing.timed_block(*args[k], 2, comm, none, comm.barrier)
    times = {k: [] for k in NAMES}
    for r in range(rounds):
        order = NAMES[r % 3:] + NAMES[:r % 3]
        for k in order:
            times[k].append(timing.timed_block(*args[k], steps, comm, none, comm.barrier))
    return {"times": times, "engines": engines}


def _quantile(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def side_by_side(model: str, world: int, rounds: int, steps: int, work: Path) -> dict:
    from autopar.artifacts import PlanOptions
    from autopar.planner import make_plan
    from autopar.runtime.launch import run_ranks
    r = make_plan(MODELS[model], PlanOptions(world_size=world, out_dir=str(work / f"{model}-w{world}")))
    res = run_ranks(_rank, world, args=(str(r.plan_path), str(MODELS[model]), rounds, steps), timeout_s=900)[0]
    t = res["times"]
    ratio = [a / b for a, b in zip(t["torch-ddp"], t["autopar-native"])]
    vs_user = [a / b for a, b in zip(t["torch-ddp"], t["user DDP"])]
    nat_user = [a / b for a, b in zip(t["autopar-native"], t["user DDP"])]
    d = t["user DDP"]
    noise = statistics.median(abs(d[i] / d[i - 1] - 1) for i in range(1, len(d)))
    return {"model": model, "world": world, "runtime": r.plan.runtime.expected,
            "chosen": next(s.label for s in r.plan.strategies if s.chosen), "engines_built": res["engines"],
            "median_s": {k: statistics.median(v) for k, v in t.items()},
            "torch_ddp_over_autopar": statistics.median(ratio),
            "spread_25_75": [_quantile(ratio, 0.25), _quantile(ratio, 0.75)],
            "torch_ddp_over_user_ddp": statistics.median(vs_user),
            "autopar_over_user_ddp": statistics.median(nat_user), "noise": noise, "times_s": t}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=4, help="consecutive steps timed per block")
    ap.add_argument("--out", default=str(ROOT / "reports/benchmarks/engines.md"))
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args(argv)
    import torch

    from autopar.io import atomic_write_json, atomic_write_text
    res: dict = {"created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": a.rounds,
                 "steps_per_block": a.steps, "torch": torch.__version__, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for model in MODELS:
            for w in a.worlds:
                row = side_by_side(model, w, a.rounds, a.steps, Path(tmp))
                print(model, w, f"torch-ddp/autopar {row['torch_ddp_over_autopar']:.3f}", flush=True)
                res["rows"].append(row)
    overall = statistics.median(r["torch_ddp_over_autopar"] for r in res["rows"])
    res["median_ratio_over_rows"] = overall
    res["verdict"] = "torch-ddp" if overall <= 1.0 else "autopar-native"
    out = Path(a.out)
    atomic_write_json(out.with_suffix(".json"), res)
    lines = ["# Engines of a pure data-parallel plan: figures of `benchmarks/bench_engines.py`", "",
             f"Made {res['created']} on this machine (2 shared CPU cores, gloo, torch {res['torch']}); "
             f"{a.rounds} interleaved rounds of {a.steps} steps per engine; ratios within one run only.", "",
             "| model | world | chosen | torch-ddp ms | autopar-native ms | user DDP ms | torch-ddp / autopar "
             "(25-75 %) | torch-ddp / user DDP | autopar / user DDP | noise |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        m = r["median_s"]
        lo, hi = r["spread_25_75"]
        lines.append(f"| {r['model']} | {r['world']} | {r['chosen']} | {m['torch-ddp'] * 1e3:.2f} | "
                     f"{m['autopar-native'] * 1e3:.2f} | {m['user DDP'] * 1e3:.2f} | "
                     f"{r['torch_ddp_over_autopar']:.3f} ({lo:.3f}-{hi:.3f}) | {r['torch_ddp_over_user_ddp']:.3f} | "
                     f"{r['autopar_over_user_ddp']:.3f} | {r['noise'] * 100:.1f} % |")
    lines += ["", f"Median over the rows of torch-ddp / autopar-native: {overall:.3f}. Verdict: "
              f"**{res['verdict']}** is the default engine (`autopar.runtime.native.DEFAULT_ENGINE`, held to "
              f"this file's JSON by `tests/test_engines.py`; `autopar execute --engine` overrides it)."]
    atomic_write_text(out, "\n".join(lines) + "\n")
    print(f"written {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
