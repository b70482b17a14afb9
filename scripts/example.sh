#!/usr/bin/env bash
# The main job on the shipped example, on CPU with gloo and local processes:
# calibrate (quick) -> plan -> execute (validate against one process, time against DDP) -> report.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
WORLD=${WORLD:-2}
PROFILE=calibration/local-quick.json
echo "== 1/4 autopar calibrate --quick --world-size $WORLD"
autopar calibrate --quick --world-size "$WORLD" -o "$PROFILE"
echo "== 2/4 autopar plan strategies/examples/resnet2d.py --world-size $WORLD"
autopar plan strategies/examples/resnet2d.py --world-size "$WORLD" --calibration "$PROFILE" \
  -o "strategies/plans/resnet2d-w$WORLD"
echo "== 3/4 autopar execute strategies/plans/resnet2d-w$WORLD/plan.json"
autopar execute "strategies/plans/resnet2d-w$WORLD/plan.json" --steps 30 --out "reports/resnet2d-w$WORLD"
echo "== 4/4 autopar report"
autopar report "reports/resnet2d-w$WORLD" "strategies/plans/resnet2d-w$WORLD/plan.json"
