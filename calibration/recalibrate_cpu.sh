#!/usr/bin/env bash
# Re-measure calibration/cpu-2core-gloo.json from scratch: the full sweep at world 4, then the
# exact local shapes of every shipped example and benchmark configuration (the shapes the
# candidate decompositions of each need). Run on a quiet machine after `bash scripts/setup.sh`;
# about 5 minutes on 2 cores. The profile is replaced atomically at each stage.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${1:-calibration/cpu-2core-gloo.json}
python -m autopar.calibrate.run --world-size 4 --out "$OUT"
exact() {  # model world batch
  autopar plan "strategies/examples/$1.py" --world-size "$2" --batch-size "$3" --calibration "$OUT" \
      --exact -o "/tmp/autopar-recal-$1-$2-$3" --placement block > /dev/null
}
for w in 1 2 4; do
  exact resnet2d "$w" 16
  exact wide_resnet "$w" 8
  exact cnn3d_large "$w" 4
done
exact resnet2d 2 32
exact cnn3d_large 4 2
autopar plan benchmarks/models/resnet2d_nobn.py --world-size 2 --calibration "$OUT" --exact \
    -o /tmp/autopar-recal-nobn-2 --placement block > /dev/null
autopar plan benchmarks/models/resnet2d_nobn.py --world-size 4 --calibration "$OUT" --exact \
    -o /tmp/autopar-recal-nobn-4 --placement block > /dev/null
python -c "from autopar.calibrate.report import write_report, default_report_dir; \
from autopar.profile import load_profile; import sys; \
print(write_report(load_profile('$OUT', check_machine=False), default_report_dir('$OUT'), '$(basename "$OUT")'))"
