#!/usr/bin/env bash
# What autopar is for, on CPU with gloo and local processes (about 2 minutes on 2 cores):
#   1. measure this machine (calibrate --quick, with the exact layer shapes of the model's
#      candidate decompositions);
#   2. plan a 3-D CNN for large volumes (one 32^3 volume per rank under data parallelism) with
#      no memory limit;
#   3. plan the same model under a per-rank memory limit that data parallelism cannot meet
#      (it needs 12.0 MiB per rank): the planner splits the large early layers spatially or
#      over filters instead;
#   4. run both plans: each is validated against one process (one float64 step: outputs, loss,
#      every gradient, the parameters after the step) and timed against torch DDP;
#   5. print both side by side: predicted, measured, prediction error, plan / DDP.
# Outputs go to reports/_scratch/example-w$WORLD/ (ignored by git); the profile to
# calibration/local-quick.json (ignored too). WORLD=4 runs the same at 4 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
WORLD=${WORLD:-2}
MODEL=strategies/examples/cnn3d_large.py
BATCH=$WORLD          # one 32^3 volume per rank under data parallelism
LIMIT=${LIMIT:-9MiB}  # data parallelism needs 12.0 MiB per rank here; the best split plan 8.2 MiB
PROFILE=calibration/local-quick.json
OUT=reports/_scratch/example-w$WORLD
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== 1/5 autopar calibrate --quick --world-size $WORLD --model $MODEL --batch-size $BATCH"
autopar calibrate --quick --world-size "$WORLD" --model "$MODEL" --batch-size "$BATCH" -o "$PROFILE" --no-report

echo "== 2/5 autopar plan $MODEL --world-size $WORLD --batch-size $BATCH   (no memory limit)"
autopar plan "$MODEL" --world-size "$WORLD" --batch-size "$BATCH" --calibration "$PROFILE" \
  --measure-shapes --measure-budget 10 -o "$OUT/plan-default"

echo "== 3/5 autopar plan $MODEL --world-size $WORLD --batch-size $BATCH --memory-limit $LIMIT"
autopar plan "$MODEL" --world-size "$WORLD" --batch-size "$BATCH" --calibration "$PROFILE" \
  --measure-shapes --measure-budget 10 --memory-limit "$LIMIT" -o "$OUT/plan-limited"

echo "== 4/5 autopar execute (validate against one process, time against DDP), both plans"
autopar execute "$OUT/plan-default/plan.json" --steps 20 --out "$OUT/run-default"
autopar execute "$OUT/plan-limited/plan.json" --steps 20 --out "$OUT/run-limited"

echo "== 5/5 autopar report: the plan without a limit, then the plan under $LIMIT per rank"
autopar report "$OUT/run-default" "$OUT/run-limited"
echo "(DDP does not fit $LIMIT: it is timed without the limit, as the reference a user has today)"
