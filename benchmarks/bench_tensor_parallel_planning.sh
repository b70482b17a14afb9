#!/usr/bin/env bash
# Planning time of a 96-layer GPT (width 1024, 16 heads, sequence 1024, vocabulary 50304, batch
# 1024) at 1024 simulated ranks (the datasheet A100 cluster, 8 per node) with every decomposition,
# the tensor-parallel ones (head, sequence, vocab, vocab_head) included; writes
# reports/benchmarks/tensor_parallel_planning.txt from the plan's own timings (plan.json).
# Usage: bash benchmarks/bench_tensor_parallel_planning.sh [OUT_DIR]   (PYTHON=... to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-/tmp/autopar-tp-planning}
export AUTOPAR_GPT_LAYERS=96 AUTOPAR_GPT_EMBED=1024 AUTOPAR_GPT_HEADS=16 AUTOPAR_GPT_SEQ=1024 AUTOPAR_GPT_VOCAB=50304
REPEATS=${REPEATS:-3}
WALLS=""
for _ in $(seq "$REPEATS"); do     # the trace cache is warm after the first run
    START=$(date +%s.%N)
    PYTHONPATH=$PWD "$PY" -m autopar plan strategies/examples/gpt.py --world-size 1024 --batch-size 1024 \
        --calibration calibration/datasheet-a100-cluster.json -o "$OUT" > "$OUT.log" 2>&1
    END=$(date +%s.%N)
    WALLS="$WALLS $(echo "$END - $START" | bc)"
done
PYTHONPATH=$PWD "$PY" - "$OUT/plan.json" $WALLS <<'PYEOF'
import collections, json, os, statistics, sys
d = json.load(open(sys.argv[1]))
walls = [float(w) for w in sys.argv[2:]]
kinds = collections.Counter(l["choice"].split("(")[0] for l in d["layers"])
lines = [
    "96-layer GPT (E 1024, 16 heads, S 1024, V 50304, batch 1024) planned at 1024 simulated ranks",
    "(calibration/datasheet-a100-cluster.json, 8 ranks per node), every decomposition, placement search;",
    f"written by benchmarks/bench_tensor_parallel_planning.sh on a loaded 2-core CPU machine ({os.uname().nodename}, "
    "load average {:.1f} {:.1f} {:.1f}: absolute times move 1.5-3x with the load).".format(*os.getloadavg()),
    f"wall time of the plan command over {len(walls)} runs: min {min(walls):.1f} s, median "
    f"{statistics.median(walls):.1f} s (Python start and imports included); the last run's plan below:",
    "timings_s (plan.json): " + ", ".join(f"{k} {v:.2f}" for k, v in d["timings_s"].items()),
    "of total_s, in no phase above: {:.2f} s (the vocabulary-head check, which imports torch and runs the loss "
    "on meta tensors, and building the plan)".format(d["timings_s"]["total_s"] - sum(
        d["timings_s"].get(k, 0.0) for k in ("load_s", "trace_s", "price_s", "placements_s", "solve_s", "write_s"))),
    f"solver: {d['solver'].get('solver')} {d['solver'].get('status')} (sol_status {d['solver'].get('sol_status')}), "
    f"gap {d['solver'].get('gap')}, in {d['solver'].get('time_s', 0):.2f} s for the chosen placement",
    "solver notes: " + " | ".join(d["solver"].get("notes", [])),
    "placements: " + ", ".join(f"{t['name']} " + (f"{t['step_time_s'] * 1e3:.2f} ms" if t.get("step_time_s") else "bounded")
                               for t in d.get("placement_search", {}).get("tried", [])),
    f"layers (planning units): {len(d['layers'])}; chosen kinds: {dict(kinds)}",
    f"predicted step time: {d['predicted']['step_time_s'] * 1e3:.1f} ms, memory {d['predicted']['memory_per_rank_bytes'] / 2**20:.0f} MiB per rank",
]
os.makedirs("reports/benchmarks", exist_ok=True)
path = "reports/benchmarks/tensor_parallel_planning.txt"
open(path + ".tmp", "w").write("\n".join(lines) + "\n")
os.replace(path + ".tmp", path)
print("\n".join(lines))
PYEOF
