#!/usr/bin/env bash
# One GPU node, under ten minutes: calibrate --quick on NCCL, plan, execute (validate against
# one process in float64, time against DDP), then print predicted against measured, and run
# the gpu-marked tests. WORLD defaults to the number of GPUs (NCCL wants one device per rank).
#
#   bash scripts/gpu-check.sh            # every GPU of this node
#   WORLD=1 MODEL=strategies/examples/wide_resnet.py bash scripts/gpu-check.sh
#   DRY=1 bash scripts/gpu-check.sh      # the same steps on CPU with gloo (checks the script)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BACKEND=nccl
GPUS=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "${DRY:-0}" = 1 ]; then
  BACKEND=gloo; GPUS=${WORLD:-2}
elif [ "$GPUS" -lt 1 ]; then
  echo "gpu-check: no CUDA device here (torch.cuda.is_available() is False)" >&2
  exit 2
fi
WORLD=${WORLD:-$GPUS}
MODEL=${MODEL:-strategies/examples/resnet2d.py}
BATCH=${BATCH:-$((8 * WORLD))}
OUT=${OUT:-/tmp/autopar-gpu-check}
NAME=$(basename "$MODEL" .py)
mkdir -p "$OUT"
T0=$SECONDS
echo "== 1/4 autopar calibrate --quick --backend $BACKEND --world-size $WORLD ($GPUS GPUs here)"
timeout 300 python -m autopar calibrate --quick --backend "$BACKEND" --world-size "$WORLD" \
  -o "$OUT/gpu-quick.json" --model "$MODEL" --batch-size "$BATCH"
echo "== 2/4 autopar plan $MODEL --world-size $WORLD --verbose"
timeout 120 python -m autopar plan "$MODEL" --world-size "$WORLD" --batch-size "$BATCH" \
  --calibration "$OUT/gpu-quick.json" -o "$OUT/plan-$NAME-w$WORLD" --verbose | tail -8
echo "== 3/4 autopar execute ($BACKEND; ranks spawned under nccl)"
timeout 300 python -m autopar execute "$OUT/plan-$NAME-w$WORLD/plan.json" --backend "$BACKEND" \
  --steps 10 --out "$OUT/run-$NAME-w$WORLD"
echo "== 4/4 predicted against measured"
python - "$OUT/run-$NAME-w$WORLD" <<'PY'
import sys
from autopar.artifacts import load_run
run = load_run(sys.argv[1])
p, m = run.predicted.step_time_s, run.measured.step_time_s
ddp = run.baseline.ddp_step_time_s if run.baseline else None
print(f"predicted {p * 1e3:.3f} ms, measured {m * 1e3:.3f} ms, error {100 * (p - m) / m:+.1f} %"
      + (f"; DDP {ddp * 1e3:.3f} ms, plan/DDP {m / ddp:.3f}x" if ddp else "")
      + f"; validation {'passed' if run.validation.passed else 'FAILED'} ({run.validation.checked} tensors)")
PY
echo "== gpu-marked tests"
[ "$BACKEND" = nccl ] && timeout 240 python -m pytest tests/test_gpu.py -q -p no:cacheprovider -m gpu -rs || true
echo "gpu-check: done in $((SECONDS - T0)) s"
