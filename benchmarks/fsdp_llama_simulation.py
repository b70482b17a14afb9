"""Sharded data parallelism on datasheet profiles (issue 40's must-show): a Llama-3-8B-shaped model
(``benchmarks/models/llama8b.py``: hidden 4096, 32 layers, GQA 32/8, SwiGLU 14336, vocabulary
128256, sequence 8192, bfloat16) planned by ``make_plan`` at 8 to 512 GPUs (8 per node), local
batch 1 sequence per GPU, AdamW (2 state copies), per-layer kinds sample/replicate plus the
plan-level ``sharded`` strategy, under a memory limit of 80 GiB per GPU (``MEMORY_LIMIT_BYTES``:
the A100 80 GB's 81,920 MiB; for H100 the same 80 GiB, the SXM part the H100 profile models,
not the 96 GB parts of torchtitan's H100 runs: a stricter limit than theirs), so that the chosen
plan fits the GPU and takes activation checkpointing (AC) on the blocks that need it
(``decomp.fsdp``, "Activation checkpointing"); its predicted throughput and MFU beside published
torchtitan figures. A pure prediction: no process starts.

Profiles (both derived, neither measured):
* A100: ``calibration/datasheet-a100-cluster.json`` with matmul and attention at the bf16
  tensor-core peak 312 TFLOP/s x 0.8 (an ASSUMED what-if, as ``stages_a100_simulation.py``
  makes: the shipped profile prices FP32 matmuls, PyTorch's default);
* H100: the same cluster file with ASSUMED H100 SXM figures: bf16 989 TFLOP/s x 0.8, HBM
  3.35 TB/s (memory-bound kernels scaled by 1.555 / 3.35), NVLink 4 900 GB/s (intra-node
  collective beta x 600 / 900), 400 Gb/s per GPU between nodes (inter-node beta x 0.5).

MFU = tokens/s per GPU x (6 N + 12 L h s) / peak, N the parameters without the embedding table
(torchtitan's count), peak 312 (A100) or 989 (H100) TFLOP/s bf16.

Published (pytorch/torchtitan, read from its git history with ``fetch``; HEAD b5bcd76c):
* Llama 3 8B, FSDP2, 64 A100 80 GB, local batch 1, selective op activation checkpointing:
  2,973 tokens/s per GPU, 58.2 % MFU (selective layer AC: 2,904, 56.8 %): docs/performance.md
  "Llama 3 performance numbers" as of commit 4d88a8a4 (2024-12-03); the table was replaced by
  the H100 results in d4c86e37 (2025-01-30) and is no longer in the repository's HEAD;
* Llama 3.1 8B, FSDP, H100 (96 GB HBM2e, 2.4 TB/s, 500 W power limit, 400 Gb/s per GPU between
  hosts), local batch 2, selective AC, no torch.compile, no Float8: 5,762 tokens/s per GPU on 8
  GPUs (Table 1), 5,605 on 128 GPUs (Table 3); "33% to 39% MFU" for 1D 8B on 8 or 128 H100
  without Float8: benchmarks/llama3_h100_202412_torchtitan.md (docs/performance.md until
  820504e2, 2025-06-13). Those H100s are not the SXM parts the H100 profile here assumes (3.35
  TB/s, 700 W): the published figures are on slower memory and a lower power limit.
Tensor parallelism + sharding (the sharded strategy's 2-D candidate) is not in these plans: the
Hugging Face Llama traces its attention as many layers (no 4-projection attention layer to pin
``head``) and its SwiGLU MLP multiplies two column-split values, which no decomposition here keeps
feature-split, so ``planner.strategies.sharded.tensor_layout`` finds no layer DTensor's styles run
(the candidate would be refused saying so) and the tensor kinds are left out to keep the solve small
at 512 ranks. Every row is therefore 1-D sharding (FSDP2 / ZeRO-1 over the native plan).
Where the configurations differ: autopar prices full AC per transformer block (the whole block's
forward run again in backward, on the blocks the limit needs), torchtitan's runs used selective
AC (op-level: only some ops' outputs recomputed, so less recompute and more memory than full AC
on the same block); the MFU here counts model FLOPs (6 N + 12 L h s per token), not the
recompute, as torchtitan's does. No torch.compile, no mixed-precision master weights (bf16 state,
so less optimizer memory than fp32 masters would take), local batch 1 on H100 where torchtitan's
Table 1 used 2, and the limit is 80 GiB of the planner's counted bytes (parameters, gradients,
optimizer state, saved activations, gathered units), not the allocator's peak with its caching
and fragmentation.

Every row plans in seconds on this 2-core machine (``plan_s`` in the JSON). The traced Llama reads
its rotary tables in every block; eliminated in execution order they stayed pending through the
whole model and each block's table spanned them (7^9 entries at 64 ranks: 72 s a plan at 64, more
than 7 minutes at 128); ``solve.elimination.elimination_order`` takes such graphs in the greedy
min-size order instead, the same optimum from tables of a few dozen entries.

    python benchmarks/fsdp_llama_simulation.py --gpus A100   # then --gpus H100 (one process each)
Writes ``reports/fsdp/llama8b-simulation.{json,md}``.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "reports" / "fsdp"
MODEL = ROOT / "benchmarks" / "models" / "llama8b.py"
PROFILE = ROOT / "calibration" / "datasheet-a100-cluster.json"
WORLDS = (8, 16, 32, 64, 128, 256, 512)
MEMORY_LIMIT_BYTES = 80 * 2**30
SEQ, LAYERS, HIDDEN, VOCAB = 8192, 32, 4096, 128256
PEAK = {"A100": 312e12, "H100": 989e12}
EFF = 0.8
PUBLISHED = [
    {"gpu": "A100", "world": 64, "tokens_per_s_per_gpu": 2973, "mfu": 0.582,
     "config": "Llama 3 8B, FSDP2, A100 80 GB, local batch 1, selective op AC",
     "source": "pytorch/torchtitan docs/performance.md at 4d88a8a4 (2024-12-03), 'Llama 3 performance numbers'"},
    {"gpu": "H100", "world": 8, "tokens_per_s_per_gpu": 5762, "mfu": None,
     "config": "Llama 3.1 8B, FSDP, H100 96 GB HBM2e at 500 W, local batch 2, selective AC (MFU 33-39 % stated for 8 or 128 GPUs)",
     "source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1"},
    {"gpu": "H100", "world": 128, "tokens_per_s_per_gpu": 5605, "mfu": None,
     "config": "Llama 3.1 8B, FSDP, H100 96 GB HBM2e at 500 W, local batch 2, selective AC",
     "source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 3"},
]


def h100(prof):
    p = copy.deepcopy(prof)
    for k in ("matmul", "attention"):
        p.kernels[k] = dict(p.kernels[k], s_per_flop=1.0 / (PEAK["H100"] * EFF), flops_per_s=PEAK["H100"] * EFF,
                            source="ASSUMED: H100 SXM bf16 989 TFLOP/s x 0.8 (benchmarks/fsdp_llama_simulation.py)")
    for k, v in p.kernels.items():
        if k not in ("matmul", "attention") and "s_per_byte" in v:
            p.kernels[k] = dict(v, s_per_byte=v["s_per_byte"] * 1.555 / 3.35)
    for kind, levels in p.collectives.items():
        for level, table in levels.items():
            f = 600 / 900 if level == "intra" else 0.5
            for size, c in table.items():
                table[size] = dict(c, beta_s_per_byte=c["beta_s_per_byte"] * f)
    return p


def a100(prof):
    p = copy.deepcopy(prof)
    for k in ("matmul", "attention"):
        p.kernels[k] = dict(p.kernels[k], s_per_flop=1.0 / (PEAK["A100"] * EFF), flops_per_s=PEAK["A100"] * EFF,
                            source="ASSUMED what-if: A100 bf16 312 TFLOP/s x 0.8 (benchmarks/fsdp_llama_simulation.py)")
    return p


def flops_per_token() -> float:
    # per layer: q and o (h x h each), k and v (h x h/4 each: 8 of 32 heads), SwiGLU (3 x h x 14336), 2 norms
    per_layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * (HIDDEN // 4) + 3 * HIDDEN * 14336 + 2 * HIDDEN
    n_total = 2 * VOCAB * HIDDEN + LAYERS * per_layer + HIDDEN       # embedding, head, final norm
    n = n_total - VOCAB * HIDDEN            # torchtitan leaves the embedding table out
    return 6 * n + 12 * LAYERS * HIDDEN * SEQ


def main(argv=None) -> int:
    import argparse
    import json

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.io import atomic_write_json, atomic_write_text
    from autopar.planner import make_plan
    from autopar.profile import load_profile
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", nargs="+", default=["A100", "H100"])
    ap.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    a = ap.parse_args(argv)
    base = load_profile(PROFILE, check_machine=False)
    profiles = {"A100": a100(base), "H100": h100(base)}
    fpt = flops_per_token()
    # rows of earlier runs under the same limit are kept, read again before each write (one process
    # per GPU keeps the planner's caches small, and the two may run at once); rows planned without
    # the memory limit are dropped
    old = OUT / "llama8b-simulation.json"

    def kept():
        rows = json.loads(old.read_text())["rows"] if old.is_file() else []
        return [r for r in rows if r.get("memory_limit_gib") == MEMORY_LIMIT_BYTES / 2**30]
    for gpu in a.gpus:
        prof = profiles[gpu]
        for w in a.worlds:
            t0 = time.perf_counter()
            r = make_plan(MODEL, PlanOptions(world_size=w, batch_size=w, calibration=str(PROFILE),
                                             ranks_per_node=8, nodes=max(1, w // 8), placement="block",
                                             kinds=("sample", "replicate", "sharded"), optimizer_state_per_param=2.0,
                                             memory_limit_bytes=MEMORY_LIMIT_BYTES, write=False),
                          PlanHooks(profile=prof))
            plan = r.plan
            step = plan.predicted.step_time_s
            tps = w * SEQ / step / w
            chosen = next(s for s in plan.strategies if s.chosen)
            sh = dict(plan.runtime.extra).get("sharded") if plan.runtime is not None else None
            levels = {}
            if sh:
                for d in [sh["root"]] + list(sh["units"].values()):
                    key = "dp" if d is None else f"ZeRO-{d['level']}"
                    levels[key] = levels.get(key, 0) + 1
                    if d is not None and d.get("ac"):
                        levels["AC"] = levels.get("AC", 0) + 1
            row = {"gpu": gpu, "world": w, "step_s": step, "tokens_per_s_per_gpu": tps,
                   "mfu": tps * fpt / PEAK[gpu], "memory_gib": plan.predicted.memory_per_rank_bytes / 2**30,
                   "memory_limit_gib": MEMORY_LIMIT_BYTES / 2**30,
                   "chosen": chosen.label, "units": levels, "plan_s": time.perf_counter() - t0,
                   "alternatives": [(s.strategy, s.label, s.step_time_s, s.memory_per_rank_bytes, s.illegal)
                                    for s in plan.strategies]}
            print(gpu, w, f"{tps:.0f} tok/s/GPU", f"MFU {row['mfu'] * 100:.1f} %",
                  f"{row['memory_gib']:.1f} GiB", chosen.label, flush=True)
            rows = [r for r in kept() if (r["gpu"], r["world"]) != (gpu, w)] + [row]
            rows.sort(key=lambda r: (r["gpu"], r["world"]))
            _write(rows, fpt, atomic_write_json, atomic_write_text)
    print(f"written {OUT / 'llama8b-simulation.md'}")
    return 0


def _write(rows, fpt, atomic_write_json, atomic_write_text) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    res = {"created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": str(MODEL.relative_to(ROOT)),
           "profile": str(PROFILE.relative_to(ROOT)), "flops_per_token": fpt, "rows": rows, "published": PUBLISHED,
           "assumptions": __doc__}
    atomic_write_json(OUT / "llama8b-simulation.json", res)
    lines = ["# Llama-3-8B-shaped model on datasheet profiles: sharded data parallelism (issue 40)", "",
             f"Made {res['created']} by `benchmarks/fsdp_llama_simulation.py` (a prediction; nothing measured). "
             "Profiles, assumptions and the differences from the published runs: the script's docstring.", "",
             f"| GPU | GPUs | chosen plan | units (AC: checkpointed) | step s | tokens/s/GPU | MFU | "
             f"memory GiB/GPU (limit {MEMORY_LIMIT_BYTES / 2**30:.0f}) | planned in s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gpu']} | {r['world']} | {r['chosen']} | {r['units']} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s_per_gpu']:.0f} | {r['mfu'] * 100:.1f} % | {r['memory_gib']:.1f} | {r['plan_s']:.1f} |")
    lines += ["", "Published (torchtitan):", ""]
    for p in PUBLISHED:
        ours = next((r for r in rows if r["gpu"] == p["gpu"] and r["world"] == p["world"]), None)
        if ours is None:
            continue
        mfu = f", {p['mfu'] * 100:.1f} % MFU" if p["mfu"] else ""
        lines.append(f"- {p['config']}, {p['world']} GPUs: {p['tokens_per_s_per_gpu']} tokens/s per GPU{mfu} "
                     f"({p['source']}); autopar predicts {ours['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, "
                     f"{ours['mfu'] * 100:.1f} % MFU ({ours['tokens_per_s_per_gpu'] / p['tokens_per_s_per_gpu']:.2f}x)")
    atomic_write_text(OUT / "llama8b-simulation.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
