"""Freed memory kept mapped (``autopar.runtime.memory``) against glibc's defaults, side by side.

For each model file and batch, one process per setting (``AUTOPAR_MALLOC=system`` / ``keep``),
the settings alternating over ``--rounds`` rounds so that both meet the same machine load; each
runs the user's module for a few training steps (SGD, the model file's loss, one thread) and
reports the median step time and the minor page faults per step. Prints the median over the
rounds of each and the keep / system ratio of the step times.

    python benchmarks/bench_freed_memory.py [--rounds 3] [--steps 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [("strategies/examples/gnn_pcqm4m.py", 4), ("strategies/examples/gnn_pcqm4m.py", 8),
         ("strategies/examples/pyg_nnconv.py", 8), ("strategies/examples/gpt.py", 8),
         ("strategies/examples/resnet2d.py", 8)]

CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(1)
from autopar.runtime.memory import keep_freed_memory
kept = keep_freed_memory()
from autopar.modelfile import load_model_file
from autopar.runtime.entry import synthetic_batch
mf = load_model_file(sys.argv[1]); n = int(sys.argv[2]); steps = int(sys.argv[3])
torch.manual_seed(0)
m = mf.build_model(); m.train()
xs, ys = synthetic_batch(mf, n, 1)
opt = torch.optim.SGD(m.parameters(), lr=1e-4)
lf = mf.loss_fn()
def step():
    opt.zero_grad(set_to_none=True)
    o = m(*xs)
    (lf(o, ys) if ys is not None else lf(o)).backward()
    opt.step()
for _ in range(3):
    step()
ts = []
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(steps):
    t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
print(json.dumps({"kept": kept, "step_s": sorted(ts)[steps // 2], "faults": faults}))
"""


def one(model: str, batch: int, setting: str, steps: int) -> dict:
    env = dict(os.environ, AUTOPAR_MALLOC=setting, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / model), str(batch), str(steps)],
                         env=env, check=True, capture_output=True, text=True, cwd=str(ROOT))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lines = [f"machine load at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min) on "
             f"{os.cpu_count()} cores; one process, one thread, {a.steps} steps per run (median), "
             f"{a.rounds} rounds alternating the settings; figures: median over the rounds"]
    print(lines[0], flush=True)
    for model, batch in CASES:
        res = {"system": [], "keep": []}
        for _ in range(a.rounds):
            for s in ("system", "keep"):
                res[s].append(one(model, batch, s, a.steps))
        med = {s: (statistics.median(r["step_s"] for r in rs), statistics.median(r["faults"] for r in rs))
               for s, rs in res.items()}
        line = (f"{Path(model).stem:12s} batch {batch:2d}: glibc defaults {med['system'][0] * 1e3:7.2f} ms "
                f"({med['system'][1]:7.0f} faults/step), kept {med['keep'][0] * 1e3:7.2f} ms "
                f"({med['keep'][1]:6.0f} faults/step); kept / defaults = {med['keep'][0] / med['system'][0]:.3f}")
        print(line, flush=True)
        lines.append(line)
    lines.append(f"machine load at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(lines[-1])
    if a.out:
        tmp = Path(a.out).with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
