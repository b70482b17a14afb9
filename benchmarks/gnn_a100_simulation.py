"""The GNN paper's scaling figures beside autopar's predictions on the datasheet A100 profile.

Seed 1 (CCGrid 2022, abstract): an edge-conditioned GNN on PCQM4M, graphs padded to 51 nodes /
118 edges, mini-batch 2048: a 12x strong-scaling speedup on 16 GPUs and an 89.4x weak-scaling
speedup on 100 GPUs. Here the padded NNConv example (``strategies/examples/gnn_pcqm4m.py``,
LBANN's PCQM4M sizes) is planned by the ILP at each GPU count on
``calibration/datasheet-a100-cluster.json`` (8 A100 per node, vendor numbers, NOT measured)
and the predicted step times give the speedups:

* strong scaling: global batch 2048 on P = 1..16 GPUs, speedup = T(1) / T(P);
* weak scaling: a fixed batch per GPU on P = 1..100 GPUs, speedup = P T(1) / T(P) (graphs per
  second against one GPU). The abstract does not say the per-GPU batch of its weak-scaling
  runs: 2048 per GPU (ASSUMED, the paper's mini-batch) and 128 per GPU (2048 / 16) are shown.

Also the padding decision for the shipped synthetic PCQM4M-like size distribution at batch 2048
on 16 GPUs (``autopar.cost.padding``), random and grouped sampling.

A pure prediction (no process starts, deterministic). Writes ``reports/gnn/a100-seed-simulation.
{json,md,png}``.

    python benchmarks/gnn_a100_simulation.py            # about 40 s on 2 cores
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "reports" / "gnn"
MODEL = ROOT / "strategies" / "examples" / "gnn_pcqm4m.py"
PROFILE = ROOT / "calibration" / "datasheet-a100-cluster.json"
SIZES = ROOT / "strategies" / "graphs" / "pcqm4m_sizes.csv"

PAPER = {"strong": {"gpus": 16, "speedup": 12.0}, "weak": {"gpus": 100, "speedup": 89.4},
         "batch": 2048, "nodes": 51, "edges": 118,
         "source": "CCGrid 2022 (seed 1), abstract; sizes from LBANN's PCQM4M model"}
STRONG_GPUS = (1, 2, 4, 8, 16)
WEAK_GPUS = (1, 2, 4, 8, 16, 32, 64, 100)
WEAK_BATCH_PER_GPU = {"2048 per GPU (ASSUMED)": 2048, "128 per GPU (2048 / 16)": 128}
MEMORY_LIMIT_BYTES = 40e9          # A100 40 GB
#: padding cases: (sampling, training epochs the shapes serve; 100 epochs ASSUMED for a full run)
PADDING_CASES = (("random", 100), ("grouped", 1), ("grouped", 100))


def main() -> int:
    sys.path.insert(0, str(ROOT))
    os.environ["AUTOPAR_GNN_NODES"], os.environ["AUTOPAR_GNN_EDGES"] = str(PAPER["nodes"]), str(PAPER["edges"])
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.profile import load_profile
    from autopar.cost.graph_sizes import load_graph_sizes
    from autopar.planner import PaddingOptions, make_padded_plan, make_plan

    profile = load_profile(PROFILE, check_machine=False)
    t_start = time.perf_counter()

    def plan(world: int, batch: int) -> dict:
        res = make_plan(MODEL, PlanOptions(world_size=world, batch_size=batch, calibration=str(PROFILE),
                                           ranks_per_node=8, memory_limit_bytes=MEMORY_LIMIT_BYTES,
                                           write=False, placement="block"),
                        PlanHooks(profile=profile))
        p = res.plan
        rep = [d for d in p.layers if d.choice == "replicate"]
        return {"replicated_s": sum(d.fwd_s + d.bwd_s for d in rep),
                "replicated_layers": sorted({d.module or d.name for d in rep}),
                "gpus": world, "batch": batch, "step_time_s": p.predicted.step_time_s,
                "fwd_s": p.predicted.fwd_s, "bwd_s": p.predicted.bwd_s,
                "grad_sync_s": p.predicted.grad_sync_s, "exposed_comm_s": p.predicted.exposed_comm_s,
                "memory_per_rank_bytes": p.predicted.memory_per_rank_bytes,
                "decompositions": p.decompositions()}

    strong = [plan(w, PAPER["batch"]) for w in STRONG_GPUS]
    for r in strong:
        r["speedup"] = strong[0]["step_time_s"] / r["step_time_s"]
        r["efficiency"] = r["speedup"] / r["gpus"]
    weak = {}
    for name, b in WEAK_BATCH_PER_GPU.items():
        rows = [plan(w, b * w) for w in WEAK_GPUS]
        for r in rows:
            r["speedup"] = r["gpus"] * rows[0]["step_time_s"] / r["step_time_s"]
            r["efficiency"] = r["speedup"] / r["gpus"]
        weak[name] = rows

    padding = {}
    epoch_steps = -(-load_graph_sizes(SIZES).graphs // PAPER["batch"])
    for sampling, epochs in PADDING_CASES:
        _, d = make_padded_plan(MODEL, PlanOptions(world_size=16, batch_size=PAPER["batch"], calibration=str(PROFILE),
                                                   ranks_per_node=8, memory_limit_bytes=MEMORY_LIMIT_BYTES,
                                                   write=False, placement="block"),
                                PaddingOptions(str(SIZES), sampling=sampling, steps=epochs * epoch_steps),
                                PlanHooks(profile=profile))
        padding[f"{sampling}, {epochs} epoch{'s' if epochs > 1 else ''}"] = d.to_json()
    import torch  # noqa: F401  (the model file imports it anyway)
    from autopar.modelfile import load_model_file
    params = sum(q.numel() for q in load_model_file(MODEL).build_model().parameters())

    out = {"schema": "autopar.gnn-simulation/1", "paper": PAPER, "profile": str(PROFILE.relative_to(ROOT)),
           "model": str(MODEL.relative_to(ROOT)), "graph_sizes": str(SIZES.relative_to(ROOT)),
           "memory_limit_bytes": MEMORY_LIMIT_BYTES, "parameters": params, "strong": strong, "weak": weak, "padding": padding,
           "elapsed_s": round(time.perf_counter() - t_start, 1)}
    OUT.mkdir(parents=True, exist_ok=True)
    from autopar.io import atomic_write_text
    atomic_write_text(OUT / "a100-seed-simulation.json", json.dumps(out, indent=1, sort_keys=True) + "\n")
    md = markdown(out)
    atomic_write_text(OUT / "a100-seed-simulation.md", md)
    plot(out, OUT / "a100-seed-simulation.png")
    print(md)
    return 0


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def markdown(out) -> str:
    p = out["paper"]
    s16 = next(r for r in out["strong"] if r["gpus"] == p["strong"]["gpus"])
    L = ["# GNN (NNConv, PCQM4M sizes) on the datasheet A100 profile: the paper's scaling beside autopar's prediction",
         "", "A prediction (`python benchmarks/gnn_a100_simulation.py`), nothing measured: the padded example "
         f"`{out['model']}` ({p['nodes']} nodes, {p['edges']} edges per graph) planned by the ILP at each GPU count "
         f"on `{out['profile']}` (8 A100 40 GB per node; vendor numbers and hand-set efficiencies, not "
         f"measured), memory limit {out['memory_limit_bytes'] / 1e9:.0f} GB. Paper: {p['source']}.", "",
         "| configuration | paper | autopar predicts |", "|---|---|---|",
         f"| strong scaling, batch {p['batch']}, {p['strong']['gpus']} GPUs vs 1 | {p['strong']['speedup']}x | "
         f"{s16['speedup']:.1f}x |"]
    for name, rows in out["weak"].items():
        r = next(x for x in rows if x["gpus"] == p["weak"]["gpus"])
        L.append(f"| weak scaling, {name}, {p['weak']['gpus']} GPUs vs 1 | {p['weak']['speedup']}x | {r['speedup']:.1f}x |")
    L += ["", f"## Strong scaling (global batch {p['batch']})", "",
          "| GPUs | step ms | forward ms | backward ms | gradient sync ms | exposed comm ms | GiB per GPU | "
          "replicated layers ms | speedup | efficiency | plan |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["strong"]:
        L.append(f"| {r['gpus']} | {_ms(r['step_time_s'])} | {_ms(r['fwd_s'])} | {_ms(r['bwd_s'])} | "
                 f"{_ms(r['grad_sync_s'])} | {_ms(r['exposed_comm_s'])} | {r['memory_per_rank_bytes'] / 2**30:.2f} | "
                 f"{_ms(r['replicated_s'])} | "
                 f"{r['speedup']:.2f}x | {100 * r['efficiency']:.0f} % | {', '.join(r['decompositions'])} |")
    for name, rows in out["weak"].items():
        L += ["", f"## Weak scaling ({name})", "",
              "| GPUs | global batch | step ms | gradient sync ms | exposed comm ms | replicated layers ms | "
              "speedup | efficiency | plan |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            L.append(f"| {r['gpus']} | {r['batch']} | {_ms(r['step_time_s'])} | {_ms(r['grad_sync_s'])} | "
                     f"{_ms(r['exposed_comm_s'])} | {_ms(r['replicated_s'])} | {r['speedup']:.2f}x | {100 * r['efficiency']:.0f} % | "
                     f"{', '.join(r['decompositions'])} |")
    L += ["", f"## Padding at batch {p['batch']} on 16 GPUs (`{out['graph_sizes']}`, SYNTHETIC PCQM4M-like sizes)", "",
          "| sampling, steps the shapes serve | policy chosen | buckets (nodes/edges) | expected step ms | padded work | global max step ms | "
          "global max padded work |", "|---|---|---|---|---|---|---|"]
    for sampling, d in out["padding"].items():
        g = d["candidates"][0]
        shapes = " ".join("N%d/E%d" % (b["nodes"], b["edges"]) for b in d["buckets"])
        L.append(f"| {sampling} | {d['policy']} | {shapes} | "
                 f"{_ms(d['expected_step_time_s'])} | {100 * d['padded_work_fraction']:.1f} % | "
                 f"{_ms(g['expected_step_time_s'])} | {100 * g['padded_work_fraction']:.1f} % |")
    w_name, w_rows = next(iter(out["weak"].items()))
    w100 = w_rows[-1]
    rep16 = s16["replicated_s"] / s16["step_time_s"]
    rep100 = w100["replicated_s"] / w100["step_time_s"]
    reps = ", ".join(w100["replicated_layers"]) or "none"
    grp = [d for k, d in out["padding"].items() if k.startswith("grouped")]
    rnd = [d for k, d in out["padding"].items() if k.startswith("random")]
    L += ["", "## Where the prediction and the paper differ, and why", "",
          "* **What is compared.** The paper's speedups are measured end to end on its GPUs (data loading, "
          "framework overheads, its own kernels). autopar's are the cost model's step times on a datasheet "
          "profile: kernels priced by roofline with hand-set efficiencies, collectives by alpha-beta on NVLink / "
          "InfiniBand figures, nothing measured on an A100. Data ingestion is not modelled.",
          *_time_notes(out, s16, w100, w_name, rep16, rep100, reps),
          "* **Padding.** The paper pads every graph to the global maximum. With random mini-batches of "
          f"{p['batch']} graphs nearly every batch holds a graph of the top size class, so buckets cannot help and "
          f"the planner keeps {', '.join(d['policy'] for d in rnd)}. Batches formed within size buckets (grouped "
          f"sampling; it changes which graphs share a batch) run smaller shapes: the planner chooses "
          f"{' / '.join(d['policy'] + ' over ' + str(d['steps']) + ' steps' for d in grp)}, since each extra shape "
          "costs a plan, trace and warm-up once (2 s ASSUMED) and pays only over enough steps.",
          "* **The 2-D (graphs x edges) grid** (`edges(S, P)` with S > 1) and the filter split of the edge "
          "MLP are offered to the ILP with every other kind; the `plan` columns name what it chose.", ""]
    return "\n".join(L)


def _time_notes(out, s16, w100, w_name, rep16, rep100, reps) -> list[str]:
    """Where the predicted time goes, said from the figures (they differ with what the op
    registry can split at the commit that runs this)."""
    p = out["paper"]
    sync16 = s16["grad_sync_s"] / s16["step_time_s"]
    sync100 = w100["grad_sync_s"] / w100["step_time_s"]
    L = []
    if max(rep16, rep100) > 0.2:
        L.append(f"* **Replicated layers decide both figures.** The plan keeps some layers replicated ({reps}): "
                 "every GPU computes them on the whole global batch, so their time does not shrink with more GPUs "
                 f"(strong scaling) and grows with the global batch (weak scaling). They are {100 * rep16:.0f} % "
                 f"of the predicted step at {s16['gpus']} GPUs (strong) and {100 * rep100:.0f} % at {w100['gpus']} "
                 f"GPUs ({w_name}), against {100 * sync100:.1f} % for the gradient all-reduce of the model's "
                 f"{out['parameters'] / 1e6:.2f} M parameters. This is a limit of the op registry on the commit that "
                 "ran this study (an op it cannot split, e.g. `aten.pad` of the extra zero node or the `zeros` of "
                 "the scatter target, is replicated, and its neighbours follow to avoid a transition), not of the "
                 "method: the paper splits every graph-wise op over the graphs. Re-run this script once those ops "
                 "split by samples.")
    else:
        L.append(f"* **Where the time goes.** Every graph-wise layer is split over the graphs; the replicated "
                 f"layers left ({reps}) are {100 * rep16:.0f} % of the step at {s16['gpus']} GPUs and "
                 f"{100 * rep100:.0f} % at {w100['gpus']} GPUs ({w_name}).")
    t1 = out["strong"][0]["step_time_s"]
    ideal16 = t1 / s16["gpus"]
    comp16 = s16["fwd_s"] + s16["bwd_s"]
    L.append(f"* **Strong scaling.** Predicted {s16['speedup']:.1f}x at {s16['gpus']} GPUs against the paper's "
             f"{p['strong']['speedup']}x. Of the predicted {s16['step_time_s'] * 1e3:.2f} ms step, forward and "
             f"backward take {comp16 * 1e3:.2f} ms against {ideal16 * 1e3:.2f} ms for 1/{s16['gpus']} of one GPU's "
             f"step (each GPU's {p['batch'] // s16['gpus']} graphs still pay every layer's fixed launch time, "
             f"`kernel_launch_s` of the datasheet profile: ASSUMED); the gradient all-reduce of the "
             f"{out['parameters'] / 1e6:.2f} M parameters ({s16['grad_sync_s'] * 1e3:.2f} ms, across two nodes) "
             f"is mostly hidden under backward: {s16['exposed_comm_s'] * 1e3:.2f} ms of communication is exposed.")
    L.append(f"* **Weak scaling.** Predicted {w100['speedup']:.1f}x at {w100['gpus']} GPUs ({w_name}) against "
             f"{p['weak']['speedup']}x; the abstract does not give the per-GPU batch, hence two rows. With a fixed "
             f"batch per GPU the compute per GPU stays; at {w100['gpus']} GPUs ({-(-w100['gpus'] // 8)} nodes) the "
             f"step is {w100['step_time_s'] * 1e3:.2f} ms against {t1 * 1e3:.2f} ms on one GPU, with "
             f"{w100['exposed_comm_s'] * 1e3:.2f} ms of exposed communication and "
             f"{w100['replicated_s'] * 1e3:.2f} ms in replicated layers.")
    close = (abs(s16["speedup"] - p["strong"]["speedup"]) / p["strong"]["speedup"] < 0.05
             and abs(w100["speedup"] - p["weak"]["speedup"]) / p["weak"]["speedup"] < 0.05)
    if close:
        L.append("* **The agreement is not a validation.** Both figures land within 5 % of the paper's, but the "
                 "profile's efficiencies and latencies are set by hand from datasheets, the paper's runs include "
                 "data loading and framework overheads this model does not price, and its per-GPU batch for weak "
                 "scaling is assumed here: the match says the losses are of the right size, not that each is "
                 "priced right. Measuring on A100s (`autopar calibrate` on such a node) is what would test it.")
    return L


def plot(out, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    p = out["paper"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    g = [r["gpus"] for r in out["strong"]]
    axes[0].plot(g, [r["speedup"] for r in out["strong"]], marker="o", label=f"autopar, batch {p['batch']}")
    axes[0].plot(g, g, "k:", lw=0.8, label="linear")
    axes[0].plot([p["strong"]["gpus"]], [p["strong"]["speedup"]], "r*", ms=12, label=f"paper: {p['strong']['speedup']}x")
    axes[0].set_title("strong scaling", fontsize=9)
    for name, rows in out["weak"].items():
        axes[1].plot([r["gpus"] for r in rows], [r["speedup"] for r in rows], marker="o", label=f"autopar, {name}")
    gw = [r["gpus"] for r in next(iter(out["weak"].values()))]
    axes[1].plot(gw, gw, "k:", lw=0.8, label="linear")
    axes[1].plot([p["weak"]["gpus"]], [p["weak"]["speedup"]], "r*", ms=12, label=f"paper: {p['weak']['speedup']}x")
    axes[1].set_title("weak scaling (graphs per second vs 1 GPU)", fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("A100 GPUs (8 per node)")
        ax.set_ylabel("predicted speedup")
        ax.legend(fontsize=7)
    fig.suptitle("NNConv on PCQM4M sizes, datasheet A100 profile (prediction) vs the paper", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
