#!/usr/bin/env bash
# Re-make every shipped plan (strategies/plans/) and every shipped run (reports/) with the
# committed profiles. The CPU runs measure this machine: run it on a quiet machine, after
# `bash scripts/setup.sh`. About 10 minutes on 2 cores. Options: --plans-only skips execution;
# --measure-shapes first measures the local shapes the CPU plans need into the committed shape
# file (calibration/cpu-2core-gloo-shapes.json; a profile made on this machine only), then
# plans with it.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
# the shipped plans are priced by the committed profiles as measured, not at this machine's
# usual speed (autopar.profile.history), so that they do not depend on where they were re-made
export AUTOPAR_SPEED_HISTORY=off
# planning reads committed files only: the profile and its committed shape file (exact local
# shapes measured once by --measure-shapes, with the profile's fingerprint), so a plan re-made
# here is the same anywhere; benchmarks/compare_core.py re-makes every shipped plan in process
# and compares it with the file
CPU=calibration/cpu-2core-gloo.json
SHAPES=calibration/cpu-2core-gloo-shapes.json
A100=calibration/datasheet-a100-cluster.json
PLANS=strategies/plans
ONLY_PLANS=0
MEASURE=0
for arg in "$@"; do
  case "$arg" in
    --plans-only) ONLY_PLANS=1 ;;
    --measure-shapes) MEASURE=1 ;;
    *) echo "unknown option $arg (--plans-only, --measure-shapes)" >&2; exit 2 ;;
  esac
done
PASS=plan

# --- CPU plans, executed (validated against one process, timed against DDP) ---------------
cpu() {  # name model world [plan options...]
  local name=$1 model=$2 world=$3; shift 3
  if [ "$PASS" = measure ]; then    # measure this plan's missing shapes into $SHAPES; keep no plan
    autopar plan "strategies/examples/$model.py" --world-size "$world" --calibration "$CPU" \
        -o "$(mktemp -d)" --measure-shapes --measure-budget 90 "$@" > /dev/null
    return
  fi
  autopar plan "strategies/examples/$model.py" --world-size "$world" --calibration "$CPU" \
      --shapes "$SHAPES" -o "$PLANS/$name" "$@" > /dev/null
  if [ "$ONLY_PLANS" = 0 ]; then
    autopar execute "$PLANS/$name/plan.json" --steps 20 --out "reports/$name"
  fi
}
cpu_plans() {
cpu resnet2d-w4 resnet2d 4
cpu wide_resnet-w2 wide_resnet 2
cpu wide_resnet-w4 wide_resnet 4
cpu cnn3d-w2 cnn3d_large 2
cpu cnn3d-w4 cnn3d_large 4
cpu cnn3d-w4-mem5MiB cnn3d_large 4 --batch-size 2 --memory-limit 5MiB
cpu gpt-w2 gpt 2
cpu gpt-w4 gpt 4
cpu gnn_pcqm4m-w2 gnn_pcqm4m 2
cpu gnn_pcqm4m-w4 gnn_pcqm4m 4
cpu pyg_nnconv-w2 pyg_nnconv 2
cpu pyg_nnconv-w4 pyg_nnconv 4
# a small batch under a memory limit: two graphs cannot fill four ranks, so edges are split
cpu gnn_pcqm4m-w4-mem3MiB gnn_pcqm4m 4 --batch-size 2 --memory-limit 3MiB
AUTOPAR_GNN_GRAPHS=2 cpu pyg_nnconv-w4-mem3MiB pyg_nnconv 4 --batch-size 2 --memory-limit 3MiB
cpu hf_gpt2-w2 hf_gpt2 2
cpu hf_gpt2-w4 hf_gpt2 4
# replicated weights (data parallelism: 6.3 MiB per rank) over the limit: head/tensor parallel
AUTOPAR_GPT_EMBED=128 AUTOPAR_GPT_VOCAB=512 cpu gpt-w4-mem4MiB gpt 4 --batch-size 4 --memory-limit 4MiB
}
[ "$MEASURE" = 1 ] && { PASS=measure; cpu_plans; PASS=plan; }
cpu_plans

# pipeline stages (issue 41's must-show): an 8-layer GPT at world 4, batch 8, two stages
AUTOPAR_GPT_LAYERS=8 autopar plan strategies/examples/gpt.py --world-size 4 --batch-size 8 --pipeline 2 \
    --calibration "$CPU" --shapes "$SHAPES" -o reports/stages/gpt8-w4-pp2 > /dev/null
if [ "$ONLY_PLANS" = 0 ]; then
  AUTOPAR_GPT_LAYERS=8 autopar execute reports/stages/gpt8-w4-pp2/plan.json --steps 20 \
      --out reports/stages/gpt8-w4-pp2/run
fi
# stages running the solver's plan on their sub-mesh (--stage-data plan): tensor-parallel layers
# (pinned: on this CPU profile the solver keeps them data parallel), spatial convolutions with
# halos, and torch's TransformerEncoder, which the block runtime cannot cut (auto: stage plans)
stage_plan() {   # name, model file, then plan options
  local name=$1 model=$2; shift 2
  autopar plan "strategies/examples/$model.py" --world-size 4 --batch-size 8 --pipeline 2 \
      --calibration "$CPU" --shapes "$SHAPES" -o "reports/stages/$name" "$@" > /dev/null
  if [ "$ONLY_PLANS" = 0 ]; then
    autopar execute "reports/stages/$name/plan.json" --steps 20 --out "reports/stages/$name/run" > /dev/null
  fi
}
AUTOPAR_GPT_LAYERS=8 stage_plan gpt8-w4-pp2-tp gpt --stage-data plan --pin 'blocks.*.attn=head' \
    --pin 'blocks.*.fc=filter' --pin 'blocks.*.out=row_parallel'
AUTOPAR_CONV_SIDE=32 stage_plan conv-w4-pp2-spatial conv_blocks --stage-data plan --pin 'blocks.*=spatial'
AUTOPAR_ENC_LAYERS=4 stage_plan encoder-w4-pp2 torch_encoder

# --- simulated clusters (datasheet A100 profile; planned, not run) ------------------------
SWEEP=1,2,4,8,16,32,64,128,256,512,1024
autopar plan strategies/examples/resnet50.py --world-size 1024 --calibration "$A100" \
    --cluster strategies/clusters/a100-128x8.json -o "$PLANS/resnet50-w1024-a100" > /dev/null
AUTOPAR_CNN3D_SIZE=256 autopar plan strategies/examples/cnn3d_large.py --world-size 64 \
    --batch-size 8 --calibration "$A100" --cluster strategies/clusters/a100-128x8.json \
    -o "$PLANS/cnn3d-256-w64-a100" --sweep "$SWEEP" > /dev/null
AUTOPAR_MESH_SIZE=1024 autopar plan strategies/examples/meshtangle2d.py --world-size 16 \
    --batch-size 4 --memory-limit 1GiB --calibration "$A100" \
    --cluster strategies/clusters/a100-128x8.json -o "$PLANS/meshtangle2d-1024-w16-a100" \
    --sweep "$SWEEP" > /dev/null
if [ "$ONLY_PLANS" = 0 ]; then
  python scripts/runs_table.py reports > reports/runs_table.md.tmp && mv reports/runs_table.md.tmp reports/runs_table.md
fi
echo "regenerated: $(ls -d $PLANS/*/ | wc -l) plans; reports in reports/ (table: reports/runs_table.md)"
