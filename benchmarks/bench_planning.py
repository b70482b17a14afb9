"""Benchmark: how long planning takes, this tree against a base tree side by side, and whether
both find the same optimum.

Targets (issue 14): ResNet-50 (the shipped example and the untouched Hugging Face model) at
1024 simulated ranks with all CNN decompositions and the placement search in <= 2 s in-process
and <= 4 s from a cold shell (the Hugging Face import excluded), with the same optimum as the
base (or the gap printed); a 96-layer GPT (``strategies/examples/gpt.py``, embedding 1024, 16
heads, sequence 1024, vocabulary 50304, batch 1024) at 1024 ranks with every kind and the
placement search in <= 5 s from a shell.

    git worktree add /tmp/base 8da717a        # the planner before the planning-speed work
    python benchmarks/bench_planning.py --base /tmp/base [--repeats 3] [--no-shell]

Each tree runs in its own fresh process (``PYTHONPATH`` = the tree), one configuration after
the other, alternating trees, so that both meet the same machine load. With the CPU profile
(which holds raw samples) this tree also prices with the shape- and cache-aware kernel models,
so its predicted step time differs while the plan is compared choice by choice; with the
datasheet profile the prices are identical and the optimum must be too. In-process figures are
``make_plan`` wall times after torch (and transformers) are imported: "traced" traces the model
(no trace cache), "re-plan" hits the trace cache (the user changing a flag); the minimum of
``--repeats`` runs is printed with the median. Shell figures time ``python -m autopar plan``
end to end: "cold" with an empty trace cache (a fresh process), "warm" with the cache filled;
``--shell-repeats`` runs of each, min and median wall time and the min CPU time (user + system
of the child, which a loaded machine inflates less than the wall time). A busy machine
moves absolute figures by 1.5-3x; the ratios, measured side by side, move less.
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
R50 = "strategies/examples/resnet50.py"
HF = "benchmarks/models/hf_resnet50.py"
DATASHEET = "calibration/datasheet-a100-cluster.json"
CPU = "calibration/cpu-2core-gloo.json"

GPT = "strategies/examples/gpt.py"
GPT96_ENV = {"AUTOPAR_GPT_LAYERS": "96", "AUTOPAR_GPT_EMBED": "1024", "AUTOPAR_GPT_HEADS": "16",
             "AUTOPAR_GPT_SEQ": "1024", "AUTOPAR_GPT_VOCAB": "50304"}

# (label, model, world, options[, environment]); model paths and profiles are taken from THIS
# tree for both
CONFIGS = [
    ("ResNet-50 @1024 b2048, all kinds, placement search (the issue's command)", R50, 1024,
     {"batch_size": 2048, "calibration": CPU}),
    ("ResNet-50 @1024, all kinds, placement search, A100 cluster", R50, 1024,
     {"calibration": DATASHEET}),
    ("ResNet-50 @1024, all kinds, block placement, A100 cluster", R50, 1024,
     {"calibration": DATASHEET, "placement": "block"}),
    ("ResNet-50 @1024, sample+replicate, block, A100 cluster", R50, 1024,
     {"calibration": DATASHEET, "kinds": ["sample", "replicate"], "placement": "block"}),
    ("HF ResNet-50 @1024 b2048, all kinds, placement search", HF, 1024,
     {"batch_size": 2048, "calibration": CPU}),
    ("HF ResNet-50 @1024, all kinds, placement search, A100 cluster", HF, 1024,
     {"calibration": DATASHEET}),
    ("3-D CNN 1x1x512^3 @16, A100 cluster", "strategies/examples/cnn3d_large.py", 16,
     {"batch_size": 1, "calibration": DATASHEET}),
    ("GPT 96 layers (E1024 H16 S1024 V50304) @1024 b1024, all kinds, placement search", GPT, 1024,
     {"batch_size": 1024, "calibration": CPU}, GPT96_ENV),
]

# runs inside the tree's own process: prints one JSON line per configuration
DRIVER = r"""
import json, os, statistics, sys, tempfile, time, warnings
warnings.simplefilter("ignore")
import torch  # noqa: F401  (imported before timing, as in any long-lived process)
try:
    import transformers  # noqa: F401
except ImportError:
    pass
from autopar.artifacts import PlanOptions
from autopar.planner import make_plan
root, label, model, world, opts, repeats = json.loads(sys.argv[1])
opts = dict(opts)
if "calibration" in opts:
    opts["calibration"] = os.path.join(root, opts["calibration"])
model = os.path.join(root, model)
cpu = []
def run(trace_cache):
    t, c = time.perf_counter(), time.process_time()
    r = make_plan(model, PlanOptions(world_size=world, write=False, trace_cache=trace_cache, **opts))
    cpu.append(time.process_time() - c)
    return time.perf_counter() - t, r
traced_s, r = run(False)                  # traces (and fills nothing: no cache)
run(True)                                 # fills the trace cache
cpu.clear()
times, last = [], None
for _ in range(repeats):
    s, last = run(True)
    times.append(s)
p = last.plan
import autopar
print("RESULT " + json.dumps({"autopar": autopar.__file__,
    "traced_s": traced_s, "replan_min_s": min(times), "replan_cpu_min_s": min(cpu), "replan_median_s": statistics.median(times),
    "timings": {k: round(v, 3) for k, v in last.timings_s.items()},
    "step_s": p.predicted.step_time_s, "choices": [l.choice for l in p.layers],
    "placement": p.placement_search.chosen_name if p.placement_search else None,
    "gap": p.solver.gap, "status": p.solver.status}))
"""


def in_process(tree: Path, cfg, repeats: int, cache: Path) -> dict:
    label, model, world, opts = cfg[:4]
    env = dict(os.environ, PYTHONPATH=str(tree), AUTOPAR_CACHE_DIR=str(cache), OMP_NUM_THREADS="1",
               **(cfg[4] if len(cfg) > 4 else {}))
    if opts.get("batch_size") == 1:
        env["AUTOPAR_CNN3D_SIZE"] = "512"
    arg = json.dumps([str(ROOT), label, model, world, opts, repeats])
    # cwd = the tree: ``python -c`` and ``-m`` put the working folder first on sys.path
    out = subprocess.run([sys.executable, "-c", DRIVER, arg], env=env, capture_output=True, text=True,
                         cwd=str(tree))
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}


def shell(tree: Path, model: str, extra: list[str], cache: Path, env_extra: dict | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child: user + system) of one ``python -m autopar plan``."""
    import resource
    env = dict(os.environ, PYTHONPATH=str(tree), AUTOPAR_CACHE_DIR=str(cache), **(env_extra or {}))
    with tempfile.TemporaryDirectory() as out:
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "autopar", "plan", str(ROOT / model), "--world-size", "1024",
                        "-o", out, *extra], env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, cwd=str(tree))
        wall = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def shell_rows(trees, model: str, extra: list[str], tmp: Path, label: str, env_extra, repeats: int) -> dict:
    """Per tree: cold (empty trace cache, fresh process) then warm, ``repeats`` times, the trees
    alternating run by run so that both meet the same load; min and median of the wall time,
    min of the CPU time."""
    runs = {name: ([], []) for name, _ in trees}
    for i in range(repeats):
        for name, tree in trees:
            cache = tmp / f"shell-{name}-{label.replace(' ', '_')}-{i}"
            runs[name][0].append(shell(tree, model, extra, cache, env_extra))
            runs[name][1].append(shell(tree, model, extra, cache, env_extra))

    def fmt_runs(rs):
        walls = [w for w, _ in rs]
        return (f"{min(walls):.2f} s (median {statistics.median(walls):.2f}, CPU "
                f"{min(c for _, c in rs):.2f})")
    return {name: f"cold {fmt_runs(cold)}, warm {fmt_runs(warm)}" for name, (cold, warm) in runs.items()}


def same_optimum(a: dict, b: dict) -> str:
    if "error" in a or "error" in b:
        return "n/a"
    if a["choices"] == b["choices"]:
        if abs(a["step_s"] - b["step_s"]) > 1e-9 * a["step_s"]:
            # a profile with raw samples gets the shape- and cache-aware kernel models on load:
            # the same plan, priced by the new models
            return (f"same plan (predicted {b['step_s'] * 1e3:.4g} vs {a['step_s'] * 1e3:.4g} ms: "
                    f"the new kernel models price it)")
        return "same plan"
    gap = (b["step_s"] - a["step_s"]) / a["step_s"]
    return ("same step time, other plan" if abs(gap) < 1e-9 else
            f"DIFFERENT: step {b['step_s'] * 1e3:.4g} vs {a['step_s'] * 1e3:.4g} ms ({100 * gap:+.3f} %)")


def fmt(r: dict) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    t = r["timings"]
    return (f"re-plan {r['replan_min_s']:.2f} s (median {r['replan_median_s']:.2f}, CPU "
            f"{r['replan_cpu_min_s']:.2f}), traced "
            f"{r['traced_s']:.2f} s [pricing {t.get('price_s', t.get('cost_s', 0)):.2f}, placements "
            f"{t.get('placements_s', 0):.2f}, ILP {t.get('solve_s', 0):.2f}]; step "
            f"{r['step_s'] * 1e3:.4g} ms, {r['placement']} ({Path(r['autopar']).parent.parent})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="a checkout of the base commit (git worktree add /tmp/base 9dfc078)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-shell", action="store_true")
    ap.add_argument("--only", help="comma-separated indices of CONFIGS to run")
    ap.add_argument("--shell-only", help="comma-separated shell rows: r50-search, r50-block, hf-search, gpt96-search")
    ap.add_argument("--shell-repeats", type=int, default=1, help="cold (and warm) shell runs per tree")
    args = ap.parse_args(argv)
    trees = [("new", ROOT)] + ([("base", Path(args.base).resolve())] if args.base else [])
    print(f"load average {os.getloadavg()[0]:.2f} at start; {os.cpu_count()} cores")
    only = {int(i) for i in args.only.split(",")} if args.only else None
    with tempfile.TemporaryDirectory() as tmp:
        for i, cfg in enumerate(CONFIGS):
            if only is not None and i not in only:
                continue
            res = {name: in_process(tree, cfg, args.repeats, Path(tmp) / f"cache-{name}") for name, tree in trees}
            print(f"[{i}] {cfg[0]}")
            for name, _ in trees:
                print(f"    {name:>4}: {fmt(res[name])}")
            if "base" in res and "error" not in res["base"] and "error" not in res["new"]:
                print(f"    speed-up: re-plan x{res['base']['replan_min_s'] / res['new']['replan_min_s']:.1f} "
                      f"(CPU x{res['base']['replan_cpu_min_s'] / res['new']['replan_cpu_min_s']:.1f}), "
                      f"traced x{res['base']['traced_s'] / res['new']['traced_s']:.1f}; "
                      f"optimum: {same_optimum(res['base'], res['new'])}")
        if not args.no_shell:
            shells = {
                "r50-search": (R50, ["--batch-size", "2048"], "resnet50 b2048, search", None),
                "r50-block": (R50, ["--batch-size", "2048", "--placement", "block"], "resnet50 b2048, block", None),
                "hf-search": (HF, ["--batch-size", "2048"], "HF resnet50 b2048, search", None),
                "gpt96-search": (GPT, ["--batch-size", "1024"], "GPT 96 layers b1024, search", GPT96_ENV)}
            pick = args.shell_only.split(",") if args.shell_only else list(shells)
            for key in pick:
                model, extra, label, env_extra = shells[key]
                rows = shell_rows(trees, model, extra, Path(tmp), label, env_extra, args.shell_repeats)
                print(f"shell: autopar plan {label} @1024 ({args.shell_repeats} cold + warm runs each): "
                      + "; ".join(f"{name} {row}" for name, row in rows.items()))
            # each ends with os._exit, as ``autopar`` does since cli.run: the interpreter's
            # teardown (0.3-0.5 s once torch is imported) is in neither figure
            for what, code in (("torch", "import torch"),
                               ("torch + transformers", "import transformers, torch"),
                               ("torch + transformers + the HF ResNet classes",
                                "import transformers, torch; from transformers import ResNetConfig, "
                                "ResNetForImageClassification")):
                t = time.perf_counter()
                subprocess.run([sys.executable, "-c", code + "; import os; os._exit(0)"], check=True)
                print(f"  (import {what} alone, no teardown: {time.perf_counter() - t:.2f} s"
                      + (", the Hugging Face import to subtract from the HF shell figures)" if "trans" in what
                         else ")"))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
