"""The LTFB paper's configuration on the datasheet A100 profile: trainers of 16 GPUs, 1 to 64 of
them, autopar's predicted speedup over one trainer beside the paper's 70.2x (109 %).

A pure prediction (no process starts, deterministic): plan one trainer of the surrogate
(``strategies/examples/ltfb_surrogate.py`` scaled up: 64x64 image, hidden 4096) at world 16 on
``calibration/datasheet-a100-cluster.json`` (8 GPUs per node), then price T trainers with
``autopar.tournament.pricing.price_trainers`` for two data sets. Writes
``reports/ltfb/a100-seed-simulation.{json,md,png}``.

Every number not from the profile or the plan is an ASSUMPTION, listed in ASSUMPTIONS and in
the report: the paper's abstract gives the scale of the data ("tens of millions of
simulations", "hundreds of millions of images"), not its bytes, its batch, its tournament
interval or its storage rates.

    python benchmarks/ltfb_a100_simulation.py            # about 10 s
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "reports" / "ltfb"

PAPER = {"trainers": 64, "gpus_per_trainer": 16, "speedup": 70.2, "efficiency": 1.09,
         "source": "Jacobs et al., CLUSTER 2019, abstract"}

ASSUMPTIONS = {
    "model": "ltfb_surrogate.py with AUTOPAR_SURROGATE_IMAGE=64, AUTOPAR_SURROGATE_HIDDEN=4096 "
             "(5 parameters -> 15 scalars + a 64x64 image); not the paper's network",
    "batch_per_trainer": 128,
    "interval_steps": 100,
    "tournament_samples": 512,
    "sample_bytes": 4 * (5 + 15 + 12 * 64 * 64),   # 12 images of 64x64 + 20 scalars, float32
    "datasets": {"paper-like (10M samples, 1.97 TB)": 10_000_000,
                 "4x larger (40M samples, 7.9 TB)": 40_000_000},
    "data_store_bytes_per_rank": 100e9,   # of a DGX A100's 1 TB host memory / 8 GPUs
    "node_read_bytes_per_s": 2e9,         # a parallel-file-system client per node
    "aggregate_bytes_per_s": 400e9,       # the file system as a whole
    "per_sample_latency_s": 2e-4,         # opening/reading one sample's record
    "memory_limit_bytes": 40e9,           # A100 40 GB
}

TRAINERS = (1, 2, 4, 8, 16, 32, 64)


def main() -> int:
    os.environ["AUTOPAR_SURROGATE_IMAGE"] = "64"
    os.environ["AUTOPAR_SURROGATE_HIDDEN"] = "4096"
    sys.path.insert(0, str(ROOT))
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.profile import load_profile
    from autopar.planner import make_plan
    from autopar.tournament.pricing import IngestionModel, TournamentOptions, price_trainers

    a = ASSUMPTIONS
    prof_path = ROOT / "calibration" / "datasheet-a100-cluster.json"
    profile = load_profile(prof_path, check_machine=False)
    res = make_plan(ROOT / "strategies/examples/ltfb_surrogate.py",
                    PlanOptions(world_size=16, batch_size=a["batch_per_trainer"], calibration=str(prof_path),
                                ranks_per_node=8, memory_limit_bytes=a["memory_limit_bytes"], write=False,
                                placement="block", trace_cache=False),
                    PlanHooks(profile=profile))
    plan = res.plan
    ing = IngestionModel(a["node_read_bytes_per_s"], a["aggregate_bytes_per_s"], a["per_sample_latency_s"],
                         "ASSUMED (benchmarks/ltfb_a100_simulation.py)")
    scenarios = {}
    for name, samples in a["datasets"].items():
        topts = TournamentOptions(trainers=1, interval_steps=a["interval_steps"],
                                  tournament_samples=a["tournament_samples"], dataset_samples=samples,
                                  data_store_bytes_per_rank=a["data_store_bytes_per_rank"], ingestion=ing)
        rows = [price_trainers(plan, T, profile, topts, 8, a["memory_limit_bytes"], a["sample_bytes"])
                for T in TRAINERS]
        base = rows[0]["samples_per_s"]
        for r in rows:
            r["speedup"] = r["samples_per_s"] / base
            r["efficiency"] = r["speedup"] / r["trainers"]
        scenarios[name] = rows
    # the same without any data-ingestion cost: what the tournament alone costs
    topts = TournamentOptions(trainers=1, interval_steps=a["interval_steps"], tournament_samples=a["tournament_samples"],
                              dataset_samples=1, ingestion=ing)
    rows = [price_trainers(plan, T, profile, topts, 8, a["memory_limit_bytes"], a["sample_bytes"]) for T in TRAINERS]
    for r in rows:
        r["speedup"] = r["samples_per_s"] / rows[0]["samples_per_s"]
        r["efficiency"] = r["speedup"] / r["trainers"]
    scenarios["data always in memory (ingestion free)"] = rows

    # the one unknown that decides super-linearity: how storage-bound one trainer is. The storage
    # speed-up f (read rates x f, per-sample latency / f) at which the model predicts the paper's
    # 109 % at 64 trainers (bisection, log scale)
    name0 = next(iter(a["datasets"]))

    def ingestion(f: float, source: str) -> IngestionModel:
        return IngestionModel(a["node_read_bytes_per_s"] * f, a["aggregate_bytes_per_s"] * f,
                              a["per_sample_latency_s"] / f, source)

    def eff64(f: float) -> float:
        ing_r = ingestion(f, "bisection")
        t = TournamentOptions(trainers=1, interval_steps=a["interval_steps"], tournament_samples=a["tournament_samples"],
                              dataset_samples=a["datasets"][name0],
                              data_store_bytes_per_rank=a["data_store_bytes_per_rank"], ingestion=ing_r)
        r1 = price_trainers(plan, 1, profile, t, 8, a["memory_limit_bytes"], a["sample_bytes"])
        r64 = price_trainers(plan, 64, profile, t, 8, a["memory_limit_bytes"], a["sample_bytes"])
        return r64["samples_per_s"] / r1["samples_per_s"] / 64

    lo, hi = 1e-3, 1e6
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if eff64(mid) > PAPER["efficiency"] else (lo, mid)
    match = {"dataset": name0, "storage_speedup": hi, "node_read_bytes_per_s": a["node_read_bytes_per_s"] * hi,
             "per_sample_latency_s": a["per_sample_latency_s"] / hi, "efficiency_at_64": eff64(hi),
             "ingest_ms_per_step_one_trainer": None}
    t1 = TournamentOptions(trainers=1, interval_steps=a["interval_steps"], tournament_samples=a["tournament_samples"],
                           dataset_samples=a["datasets"][name0], data_store_bytes_per_rank=a["data_store_bytes_per_rank"],
                           ingestion=ingestion(hi, "match"))
    match["ingest_ms_per_step_one_trainer"] = 1e3 * price_trainers(plan, 1, profile, t1, 8, a["memory_limit_bytes"],
                                                                   a["sample_bytes"])["ingest_s"]

    rows = [price_trainers(plan, T, profile, t1, 8, a["memory_limit_bytes"], a["sample_bytes"]) for T in TRAINERS]
    for r in rows:
        r["speedup"] = r["samples_per_s"] / rows[0]["samples_per_s"]
        r["efficiency"] = r["speedup"] / r["trainers"]
    scenarios[f"paper-like, storage {hi:.3g}x faster (matches 109 %)"] = rows

    out = {"schema": "autopar.ltfb-simulation/1", "paper_match": match, "profile": str(prof_path.relative_to(ROOT)),
           "paper": PAPER, "assumptions": a,
           "trainer_plan": {"world_size": plan.world_size, "batch_size": plan.model.batch_size,
                            "decompositions": plan.decompositions(), "step_time_s": plan.predicted.step_time_s,
                            "fwd_s": plan.predicted.fwd_s,
                            "memory_per_rank_bytes": plan.predicted.memory_per_rank_bytes},
           "scenarios": scenarios}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "a100-seed-simulation.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    (OUT / "a100-seed-simulation.md").write_text(markdown(out))
    plot(out, OUT / "a100-seed-simulation.png")
    print(markdown(out))
    return 0


def markdown(out) -> str:
    a, p, tp = out["assumptions"], out["paper"], out["trainer_plan"]
    L = ["# LTFB on the datasheet A100 profile: trainers of 16 GPUs, 1 to 64 trainers", "",
         "A prediction (`python benchmarks/ltfb_a100_simulation.py`), nothing measured. Paper: "
         f"{p['trainers']} trainers x {p['gpus_per_trainer']} GPUs = {p['speedup']}x one trainer, "
         f"{100 * p['efficiency']:.0f} % efficiency ({p['source']}).", "",
         f"One trainer: {tp['world_size']} ranks, batch {tp['batch_size']}, plan {', '.join(tp['decompositions'])}, "
         f"predicted step {tp['step_time_s'] * 1e3:.2f} ms (forward {tp['fwd_s'] * 1e3:.2f} ms), "
         f"{tp['memory_per_rank_bytes'] / 2**30:.2f} GiB per GPU.", ""]
    m = out["paper_match"]
    L += [f"**Matching the paper.** The model predicts the paper's {100 * p['efficiency']:.0f} % at 64 trainers "
          f"when one trainer reads the {m['dataset']} data set {m['storage_speedup']:.3g}x faster than assumed "
          f"({m['node_read_bytes_per_s'] / 1e9:.3g} GB/s per node, {m['per_sample_latency_s'] * 1e6:.3g} us per sample; "
          f"its ingestion then takes {m['ingest_ms_per_step_one_trainer']:.2f} ms a step against a "
          f"{tp['step_time_s'] * 1e3:.2f} ms compute step): the super-linear part is exactly how much one trainer "
          f"waits on storage, which the abstract does not give. At the assumed "
          f"{a['node_read_bytes_per_s'] / 1e9:g} GB/s the surrogate (a small network on large samples) is far more "
          f"storage-bound than that, hence the large figures in the first two tables.", ""]
    for name, rows in out["scenarios"].items():
        L += [f"## {name}", "", "| T | GPUs | data | ingest ms/step | step ms | exchange ms | eval ms | "
              "overhead | samples/s | speedup | efficiency |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            L.append(f"| {r['trainers']} | {r['world_size']} | {'memory' if r['data_in_memory'] else 'storage'} | "
                     f"{r['ingest_s'] * 1e3:.2f} | {r['step_s'] * 1e3:.2f} | {r['exchange_s'] * 1e3:.2f} | "
                     f"{r['eval_s'] * 1e3:.2f} | {100 * r['tournament_overhead']:.2f} % | {r['samples_per_s']:.0f} | "
                     f"{r['speedup']:.1f}x | {100 * r['efficiency']:.0f} % |")
        L.append("")
    L += ["## What the model captures and what it does not", "",
          "* Captured: the per-trainer step of the ILP's plan; the exchange (each GPU's shard of the "
          "model, point to point to the partner's corresponding GPU, inter-node); the evaluation of two "
          "models on the tournament set; data ingestion: a trainer's shard held in memory when it fits "
          "(then free), else read from storage at the node and aggregate rates with a per-sample "
          "latency, prefetched under the step (a step takes max(compute, read)).",
          "* Super-linear efficiency comes only from ingestion: one trainer holds the whole data set and "
          "(when it does not fit its GPUs' share of host memory) is bound by storage, while T trainers each "
          "hold 1/T of it in memory. With the data in memory throughout, efficiency stays below 100 % "
          "(the tournament's exchange and evaluation): the last table.",
          "* Not captured: the one-off filling of the data store; the paper's actual network, batch, "
          "interval and storage rates (all assumed here, see below); contention of storage beyond one "
          "aggregate rate; random partners sharing a node (priced inter-node); statistical efficiency "
          "(how many samples a population needs for a given quality: the speedup here is throughput).",
          "* So the paper's 70.2x / 109 % is matched only in kind: how far above 100 % the efficiency goes "
          "depends on how storage-bound one trainer is, which the abstract does not give.", "",
          "## Assumptions", "", "```json", json.dumps(a, indent=1), "```", ""]
    return "\n".join(L)


def plot(out, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in out["scenarios"].items():
        T = [r["trainers"] for r in rows]
        axes[0].plot(T, [r["speedup"] for r in rows], marker="o", label=name)
        axes[1].plot(T, [100 * r["efficiency"] for r in rows], marker="o", label=name)
        for r in rows:   # mark where the shards start to fit
            if r["data_in_memory"] and r["trainers"] > 1 and not rows[rows.index(r) - 1]["data_in_memory"]:
                axes[0].annotate("shards fit in memory", (r["trainers"], r["speedup"]), fontsize=7)
    p = out["paper"]
    axes[0].plot([1, 64], [1, 64], "k:", lw=0.8, label="linear")
    axes[0].plot([p["trainers"]], [p["speedup"]], "r*", ms=12, label=f"paper: {p['speedup']}x")
    axes[1].plot([p["trainers"]], [100 * p["efficiency"]], "r*", ms=12, label="paper: 109 %")
    axes[1].axhline(100, color="k", ls=":", lw=0.8)
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("trainers (16 A100 each)")
    axes[0].set_yscale("log", base=2)
    axes[0].set_ylabel("predicted speedup over one trainer")
    axes[1].set_ylabel("predicted efficiency (%)")
    axes[0].legend(fontsize=7)
    fig.suptitle("LTFB on the datasheet A100 profile (prediction; assumptions in the .md)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
