"""Issue 41's must-show: ``autopar plan --pipeline auto`` on the datasheet A100 profile for the
96-layer GPT of the sharding benchmark (``strategies/examples/gpt.py`` with
``AUTOPAR_GPT_LAYERS=96 AUTOPAR_GPT_EMBED=256``, 4 heads) at 1024 ranks (8 per node), batch 256,
under 400 MiB per rank (``benchmarks/bench_fsdp.py``'s case), timed from a shell. Writes what
plan.json records -- the stage count, sub-mesh, cuts, microbatches and schedule it chose, and
every (stage count, tp, M) the search tried with its prediction, bound or refusal -- to
``reports/stages/gpt96-w1024-auto.{json,md}``.

    python benchmarks/stages_gpt96_plan.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "reports" / "stages"
sys.path.insert(0, str(ROOT))
ENV = {"AUTOPAR_GPT_LAYERS": "96", "AUTOPAR_GPT_EMBED": "256"}


def main() -> int:
    from autopar.io import atomic_write_json, atomic_write_text
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "autopar", "plan", "strategies/examples/gpt.py", "--world-size", "1024",
               "--batch-size", "256", "--cluster", "strategies/clusters/a100-128x8.json",
               "--calibration", "calibration/datasheet-a100-cluster.json", "--memory-limit", "400MiB",
               "--pipeline", "auto", "--out", str(Path(tmp) / "plan")]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            print(p.stderr, file=sys.stderr)
            return p.returncode
        plan = json.loads((Path(tmp) / "plan" / "plan.json").read_text())
    rt = plan["runtime"]
    shown = "AUTOPAR_GPT_LAYERS=96 AUTOPAR_GPT_EMBED=256 python " + " ".join(cmd[1:-1]) + " OUT"
    out = {"command": shown, "wall_s": wall, "expected_runtime": rt["expected"],
           "predicted_step_s": plan["predicted"]["step_time_s"],
           "predicted_memory_per_rank_bytes": plan["predicted"]["memory_per_rank_bytes"],
           "stages": rt.get("stages"), "price": rt.get("price"), "search": rt.get("search"),
           "sub_plan_kinds": rt.get("sub_plan_kinds"), "heads": rt.get("heads"),
           "options": rt.get("stage_counts_priced") or rt.get("pipeline_considered"),
           "strategies": [{"label": s.get("label"), "step_time_s": s.get("step_time_s"), "illegal": s.get("illegal"),
                           "chosen": s.get("chosen")} for s in plan["strategies"]]}
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT / "gpt96-w1024-auto.json", out)
    st = out["stages"]
    first = st["stages"][0]
    cuts = [s["layers"][0] for s in st["stages"][1:]]
    lines = ["# `--pipeline auto`: 96-layer GPT at 1024 ranks (written by benchmarks/stages_gpt96_plan.py)", "",
             f"Command (from a shell, {wall:.1f} s wall on this 2-core machine; the stage search itself "
             f"{out['search']['search_s']:.2f} s, {out['search']['sub_plans_solved']} sub-plan(s) solved):", "",
             f"    {shown}", "",
             f"Chosen: {len(st['stages'])} stages of dp {first['dp']} x tp {first['tp']} (sub-plan kinds "
             f"{out['sub_plan_kinds']}), {st['schedule']['name']} over M = {st['schedule']['microbatches']} "
             f"microbatches, cuts before blocks {cuts}; predicted step {out['predicted_step_s'] * 1e3:.3f} ms, "
             f"peak {out['predicted_memory_per_rank_bytes'] / 2**20:.1f} MiB per rank (limit 400 MiB).", "",
             f"Memory each stage count reaches at best: {out['search']['memory_reach']}.", "",
             "Plans beside it (the planner's other strategies):", "", "| plan | step (ms) | why not |", "|---|---|---|"]
    for s in out["strategies"]:
        t = "-" if s["step_time_s"] is None else f"{s['step_time_s'] * 1e3:.3f}"
        lines.append(f"| {s['label']}{' (chosen)' if s['chosen'] else ''} | {t} | {s['illegal'] or ''} |")
    lines += ["", "Every option the search tried (S stages of dp x tp, M microbatches):", "",
              "| S | dp x tp | M | step (ms) | bubble | peak MiB | lower bound (ms) | refused / pruned |",
              "|---|---|---|---|---|---|---|---|"]
    for o in sorted(out["options"], key=lambda o: (o["stages"], o["tp"], o["microbatches"])):
        lb = f"{o['lower_bound_s'] * 1e3:.3f}" if "lower_bound_s" in o else "-"
        if "refused" in o:
            lines.append(f"| {o['stages']} | {o['dp']} x {o['tp']} | {o['microbatches']} | - | - | - | {lb} | {o['refused']} |")
        else:
            lines.append(f"| {o['stages']} | {o['dp']} x {o['tp']} | {o['microbatches']} | {o['step_s'] * 1e3:.3f} | "
                         f"{100 * o['bubble_fraction']:.1f} % | {o['peak_bytes_max'] / 2**20:.1f} | {lb} | |")
    lines += ["", "With batch 256 over 1024 ranks, stages that are data parallel only (tp 1) leave a per-replica "
              "batch smaller than the stage count, so 1F1B has no M >= S: tensor parallelism inside the stages "
              "is what makes every stage count feasible here."]
    atomic_write_text(OUT / "gpt96-w1024-auto.md", "\n".join(lines) + "\n")
    print("\n".join(lines[:12]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
