"""Benchmark: how long planning takes (trace + price + solve + write), printed per stage.

Targets: ResNet-50 at --world-size 1024 in at most 5 s (sample + replicate: issue 2) and at most
2 s for the solve with sample, spatial and hybrid choices (issue 3); a 1x1x512^3 3-D CNN in
seconds. Run on a quiet machine; the figures are wall times of this process.

    python benchmarks/bench_planning.py [--calibration calibration/datasheet-a100-cluster.json]

In-process figures trace every time (no trace cache); the shell figures time ``autopar plan``
end to end (torch import included), cold and then re-planning an unchanged model file with
the trace cache, with the default placement search and with ``--placement block``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(label, model, world, **kw):
    from autopar.artifacts import PlanOptions
    from autopar.pipeline import make_plan
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        r = make_plan(model, PlanOptions(world_size=world, out_dir=tmp, **kw))
    total = time.perf_counter() - t
    tm = r.timings_s
    s = r.plan.solver
    print(f"{label}: total {total:.2f} s (trace {tm['trace_s']:.2f}, cost {tm['cost_s']:.2f}, "
          f"solve {tm['solve_s']:.2f}, write {tm.get('write_s', 0):.2f}); {len(r.plan.layers)} layers, "
          f"{s.candidates['choices']} choices, solver {s.solver} {s.status} gap {s.gap}; "
          f"predicted step {r.plan.predicted.step_time_s * 1e3:.1f} ms; "
          f"decompositions {sorted({l.choice.split('(')[0] for l in r.plan.layers})}")


def shell(label, argv, env):
    t = time.perf_counter()
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    print(f"{label}: {time.perf_counter() - t:.2f} s from a shell")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", default=str(ROOT / "calibration/datasheet-a100-cluster.json"))
    args = ap.parse_args(argv)
    import autopar.trace.tracer  # noqa: F401  (import torch before timing)
    r50 = ROOT / "strategies/examples/resnet50.py"
    one("ResNet-50 @1024, sample+replicate, block placement", r50, 1024, calibration=args.calibration,
        kinds=["sample", "replicate"], placement="block", trace_cache=False)
    one("ResNet-50 @1024, all decompositions, placement search", r50, 1024,
        calibration=args.calibration, trace_cache=False)
    one("ResNet-50 @1024, all decompositions, block placement", r50, 1024,
        calibration=args.calibration, trace_cache=False, placement="block")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, AUTOPAR_CACHE_DIR=str(Path(tmp) / "cache"))
        cmd = [sys.executable, "-m", "autopar", "plan", str(r50), "--world-size", "1024",
               "--calibration", args.calibration, "-o", str(Path(tmp) / "plan")]
        shell("autopar plan resnet50 --world-size 1024 (cold: traced)", cmd, env)
        shell("autopar plan resnet50 --world-size 1024 (re-plan: trace cache)", cmd, env)
        shell("autopar plan resnet50 --world-size 1024 --placement block (re-plan: trace cache)",
              cmd + ["--placement", "block"], env)
    os.environ["AUTOPAR_CNN3D_SIZE"] = "512"
    one("3-D CNN 1x1x512^3 @16", ROOT / "strategies/examples/cnn3d_large.py", 16, batch_size=1,
        calibration=args.calibration, trace_cache=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
