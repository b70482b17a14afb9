"""Benchmark: the ILP's plan for the large-sample 3-D CNN (spatial / hybrid layers chosen where
they pay) against sample-only torch DDP, measured side by side in the same processes.

    python benchmarks/bench_hybrid_vs_ddp.py [--world 2 4] [--size 32] [--batch 4]
        [--calibration PROFILE] [--memory-limit 8MiB]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--memory-limit", default=None)
    args = ap.parse_args(argv)
    os.environ["AUTOPAR_CNN3D_SIZE"] = str(args.size)
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.artifacts import PlanOptions
    from autopar.planner import make_plan, parse_bytes
    for world in args.world:
        with tempfile.TemporaryDirectory() as tmp:
            r = make_plan(ROOT / "strategies/examples/cnn3d_large.py",
                          PlanOptions(world_size=world, batch_size=args.batch, calibration=args.calibration,
                                      out_dir=Path(tmp) / "plan",
                                      memory_limit_bytes=parse_bytes(args.memory_limit)))
            run, _ = execute(r.plan_path, ExecuteOptions(steps=args.steps, warmup=2),
                             out_dir=Path(tmp) / "run", progress=lambda s: None)
        kinds = r.plan.decompositions()
        b = run.baseline
        print(f"world {world}, {args.batch}x1x{args.size}^3: plan {kinds}; validation "
              f"{'passed' if run.validation.passed else 'FAILED'}; measured {run.measured.step_time_s * 1e3:.1f} ms "
              f"(predicted {run.predicted.step_time_s * 1e3:.1f} ms), sample-only DDP "
              f"{b.ddp_step_time_s * 1e3:.1f} ms; plan/DDP = {run.ratio_to_ddp:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
