"""Benchmark: autopar's generated data-parallel step against torch DDP, measured side by side in
the same processes (gloo, CPU). Target: plan / DDP <= 1.05.

The model has no batch norm, so DDP computes exactly the single-process function too (with
batch norm, plans made with the default local statistics compute what DDP computes, and
``bench_plan_quality.py`` compares them; global statistics are DDP + SyncBatchNorm's function).

    python benchmarks/bench_dp_vs_ddp.py [--world 2] [--steps 20] [--calibration PROFILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default=str(ROOT / "benchmarks/models/resnet2d_nobn.py"))
    ap.add_argument("--calibration", default=None)
    args = ap.parse_args(argv)
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.artifacts import PlanOptions
    from autopar.pipeline import make_plan
    for world in args.world:
        with tempfile.TemporaryDirectory() as tmp:
            r = make_plan(args.model, PlanOptions(world_size=world, calibration=args.calibration,
                                                  out_dir=Path(tmp) / "plan", kinds=["sample"]))
            run, _ = execute(r.plan_path, ExecuteOptions(steps=args.steps, warmup=3),
                             out_dir=Path(tmp) / "run", progress=lambda s: None)
        plan_t = run.measured.step_times_s
        ddp_t = run.baseline.ddp_step_times_s
        print(f"world {world}: validation {'passed' if run.validation.passed else 'FAILED'}; "
              f"generated data-parallel step median {statistics.median(plan_t) * 1e3:.2f} ms, "
              f"torch DDP median {statistics.median(ddp_t) * 1e3:.2f} ms; "
              f"ratio plan/DDP = {statistics.median(plan_t) / statistics.median(ddp_t):.3f} (target <= 1.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
