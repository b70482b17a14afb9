"""The import graph follows the data flow (calibrate -> trace -> cost -> solve -> codegen ->
execute -> report): planning never loads the runtime, and the runtime (what generated code
imports) loads neither the solver, the tracer, the cost model nor calibration.

Each check runs in a fresh interpreter, so that modules loaded by other tests do not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "calibration" / "cpu-2core-gloo.json"


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT),
                                           "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


PLAN_IN_PROCESS = f"""
import json, sys
from autopar.planner import make_plan
from autopar.artifacts import PlanOptions
make_plan({str(ROOT / 'strategies/examples/cnn3d_large.py')!r},
          PlanOptions(world_size=4, calibration={str(PROFILE)!r}, write=False))
print(json.dumps(sorted(m for m in sys.modules if m.startswith('autopar.runtime'))))
"""


def test_planning_loads_no_runtime_module():
    loaded = _run(PLAN_IN_PROCESS)
    assert loaded == [], f"planning loaded runtime modules: {loaded}"


def test_runtime_loads_no_planning_module(tmp_path):
    # a generated module of a shipped plan, imported as a user's torchrun script would, and the
    # training library (autopar.train) a user's own loop imports
    gen = sorted((ROOT / "strategies" / "plans" / "cnn3d-w4").glob("*_dist.py"))[0]
    code = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("gen", {str(gen)!r})
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
import autopar.runtime
import autopar.train
bad = sorted(m for m in sys.modules
             if m.startswith(('autopar.cost', 'autopar.solve', 'autopar.trace', 'autopar.calibrate',
                              'autopar.planner', 'autopar.codegen', 'pulp', 'highspy')))
print(json.dumps(bad))
"""
    loaded = _run(code)
    assert loaded == [], f"the runtime loaded planning modules: {loaded}"
