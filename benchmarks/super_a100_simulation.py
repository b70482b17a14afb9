"""SUPER on the datasheet A100 profile: sub-graph (branch) + data parallelism against data-only
and tensor-only parallelism for one parallel-block GPT, 8 to 1024 GPUs (strong scaling), and the
interleaved placement against the branch-contiguous one.

A pure prediction (no process starts, deterministic): every figure is autopar's predicted step
time for a plan made on ``calibration/datasheet-a100-cluster.json`` (8 GPUs per node, datasheet
NVLink / InfiniBand links and A100 kernel rates), not a measurement. Model:
``strategies/examples/parallel_gpt.py`` with the sizes in ``MODEL`` (parallel attention + MLP
blocks; each block one planning unit with two branches), global batch ``BATCH`` fixed at every
world size. Series (``PlanOptions.kinds``):

* branch+data: ``branch`` (Branch: attention and MLP on disjoint groups) and ``head_groups``
  (HeadGroups: heads, and in the all-sub-graph variant the MLP, in G groups) for the blocks,
  with sample parallelism elsewhere,
  placement searched (block = SUPER's interleaved placement for branch units, see
  ``autopar.decomp.rankmap``);
* data-only:   ``sample`` (and ``replicate``) on every layer;
* tensor-only: ``filter`` / ``row_parallel`` (and ``replicate``) on every layer, no sample split,
  priced WITHOUT the memory limit (under 80 GB no such plan fits: every rank holds the whole
  batch's activations),
  planned without units (``AUTOPAR_PGPT_UNITS=0``: filter / row_parallel split single linear
  layers; attention itself is replicated until head parallelism is merged);
* placements:  branch+data with every block pinned to ``branch`` (Branch(D, 2, R), forced),
  planned under block (interleaved: the i-th rank of each branch on one node) and under local
  stride 2R (branch-contiguous: each branch's data-parallel ranks share nodes).

Writes ``reports/super/super-a100-simulation.json``, ``super-a100-strong-scaling.png`` and
``README.md``.

    python benchmarks/super_a100_simulation.py              # plans 40 times, a few minutes
    python benchmarks/super_a100_simulation.py --rewrite    # the markdown and plot from the JSON
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "reports" / "super"

MODEL = {"AUTOPAR_PGPT_LAYERS": "24", "AUTOPAR_PGPT_EMBED": "2048", "AUTOPAR_PGPT_HEADS": "16",
         "AUTOPAR_PGPT_SEQ": "1024", "AUTOPAR_PGPT_VOCAB": "32768"}
BATCH = 256
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
RANKS_PER_NODE = 8
MEMORY_LIMIT_BYTES = 80e9        # A100 80 GB
SERIES = {
    "branch+data": ("branch", "head_groups", "sample", "replicate"),
    "data-only": ("sample", "replicate"),
    "tensor-only (memory ignored)": ("filter", "row_parallel", "replicate"),
}


def _plan(make_plan, PlanOptions, PlanHooks, prof, world, kinds, placement="search", force=None,
          units=True, memory_limit=MEMORY_LIMIT_BYTES):
    from autopar.errors import AutoparError
    t0 = time.perf_counter()
    os.environ["AUTOPAR_PGPT_UNITS"] = "1" if units else "0"
    try:
        r = make_plan(ROOT / "strategies/examples/parallel_gpt.py",
                      PlanOptions(world_size=world, batch_size=BATCH, ranks_per_node=RANKS_PER_NODE,
                                  memory_limit_bytes=memory_limit, kinds=kinds, write=False,
                                  placement=placement),
                      PlanHooks(profile=prof, force=force))
    except AutoparError as e:
        return {"world": world, "error": str(e).splitlines()[0][:300]}
    kinds_used: dict[str, int] = {}
    for d in r.plan.layers:
        s = str(d.decomposition())
        kinds_used[s] = kinds_used.get(s, 0) + 1
    step = float(r.solution.objective_s)
    return {"world": world, "step_time_s": step, "placement": str(r.table.ctx.placement),
            "decompositions": kinds_used, "plan_s": round(time.perf_counter() - t0, 2)}


def _unit_layers() -> list[int]:
    """Indices of the parallel blocks (planning units) in the planned graph."""
    from autopar.modelfile import load_model_file
    from autopar.trace.cache import trace_cached
    from autopar.trace.units import merge_units
    os.environ["AUTOPAR_PGPT_UNITS"] = "1"
    mf = load_model_file(ROOT / "strategies/examples/parallel_gpt.py")
    g, _ = trace_cached(mf, BATCH)
    g = merge_units(g, mf.planning_units())
    return [lay.index for lay in g.layers if lay.module.startswith("blocks.")]


def main() -> int:
    os.environ.update(MODEL)
    sys.path.insert(0, str(ROOT))
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.profile import load_profile
    from autopar.planner import make_plan

    if "--rewrite" in sys.argv:         # the report again from the JSON, without planning
        data = json.loads((OUT / "super-a100-simulation.json").read_text())
        write(data["series"], sorted({r["world"] for rs in data["series"].values() for r in rs}))
        return 0
    prof = load_profile(ROOT / "calibration" / "datasheet-a100-cluster.json")
    worlds = tuple(int(w) for w in os.environ.get("SUPER_WORLDS", ",".join(map(str, WORLDS))).split(","))
    rows: dict[str, list] = {k: [] for k in SERIES}
    rows["branch(D,2,R) forced, interleaved (block)"] = []
    rows["branch(D,2,R) forced, branch-contiguous (stride 2R)"] = []
    units = _unit_layers()
    for w in worlds:
        for name, kinds in SERIES.items():
            tensor = name.startswith("tensor-only")
            rows[name].append(_plan(make_plan, PlanOptions, PlanHooks, prof, w, kinds, units=not tensor,
                                    memory_limit=None if tensor else MEMORY_LIMIT_BYTES))
            print(name, rows[name][-1], flush=True)
        if w > RANKS_PER_NODE:
            from autopar.decomp.branch import data_degree
            d, r = data_degree(w, 2, BATCH)     # the forced Branch(d, 2, r) of every block
            for name, pl in (("branch(D,2,R) forced, interleaved (block)", "block"),
                             ("branch(D,2,R) forced, branch-contiguous (stride 2R)", 2 * r)):
                rows[name].append(_plan(make_plan, PlanOptions, PlanHooks, prof, w,
                                        SERIES["branch+data"], placement=pl,
                                        force={li: "branch" for li in units}))
                print(name, rows[name][-1], flush=True)
    write(rows, worlds)
    return 0


def notes(rows, worlds) -> list[str]:
    """Observations computed from the rows (no figure typed by hand)."""
    def t(name, w):
        r = next((x for x in rows[name] if x["world"] == w), None)
        return r.get("step_time_s") if r else None
    out = []
    for w in worlds:
        a, b = t("branch+data", w), t("data-only", w)
        if a and b and a < b * 0.995:
            why = (f"the batch of {BATCH} gives data parallelism at most {BATCH} ranks, the others "
                   f"only replicate" if w > BATCH else "as much compute per rank, but each rank holds and "
                   "all-reduces the gradients of 1/G of the blocks' weights")
            chosen = next(x for x in rows["branch+data"] if x["world"] == w)["decompositions"]
            blocks = ", ".join(f"{k} x{n}" for k, n in chosen.items() if k.startswith(("branch", "head")))
            out.append(f"- {w} GPUs: sub-graph + data parallelism predicted {b / a:.2f}x faster than "
                       f"data-only ({blocks}; {why}).")
        elif a and b:
            out.append(f"- {w} GPUs: the planner keeps data parallelism (sub-graph parallelism "
                       f"predicted no faster).")
        elif not a and not b:
            out.append(f"- {w} GPUs: no plan fits {MEMORY_LIMIT_BYTES / 1e9:.0f} GB (the blocks' "
                       f"activations at this batch; see the errors below).")
    inter, contig = "branch(D,2,R) forced, interleaved (block)", "branch(D,2,R) forced, branch-contiguous (stride 2R)"
    gains = [(w, t(contig, w) / t(inter, w)) for w in worlds if t(inter, w) and t(contig, w)]
    if gains:
        out.append(f"- Interleaved against branch-contiguous placement (every block forced to "
                   f"Branch(D, 2, R)): the branch-contiguous placement is predicted "
                   f"{min(g for _, g in gains):.3f}x to {max(g for _, g in gains):.3f}x the "
                   f"interleaved step time; the interleaved keeps the joins' all-reduce on NVLink.")
    out.append("- tensor-only is priced without the memory limit: `filter` / `row_parallel` split "
               "single linear layers, while attention, norms and residuals stay replicated with the "
               "whole batch on every rank (head parallelism for sequential GPTs is another "
               "decomposition, not in this series).")
    return out


def write(rows, worlds) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"what": "predicted step times (autopar cost model on the datasheet A100 profile), "
                    "not measurements", "model": "strategies/examples/parallel_gpt.py", "sizes": MODEL,
            "global_batch": BATCH, "ranks_per_node": RANKS_PER_NODE,
            "memory_limit_bytes": MEMORY_LIMIT_BYTES, "profile": "calibration/datasheet-a100-cluster.json"}
    tmp = OUT / "super-a100-simulation.json.tmp"
    tmp.write_text(json.dumps({"meta": meta, "series": rows}, indent=1))
    tmp.replace(OUT / "super-a100-simulation.json")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rs in rows.items():
        pts = [(r["world"], r["step_time_s"]) for r in rs if r.get("step_time_s")]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name, linestyle="--" if "(" in name else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs (8 per node)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"parallel-block GPT, batch {BATCH}: predicted strong scaling (A100 datasheet)",
                 fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(OUT / "super-a100-strong-scaling.png.tmp.png", dpi=120)
    (OUT / "super-a100-strong-scaling.png.tmp.png").replace(OUT / "super-a100-strong-scaling.png")

    lines = ["# SUPER sub-graph + data parallelism on the A100 datasheet profile (predictions)", "",
             "Written by `benchmarks/super_a100_simulation.py`; the data is in "
             "`super-a100-simulation.json`. **Every figure is a prediction** of autopar's cost model on "
             "`calibration/datasheet-a100-cluster.json` (datasheet links and kernel rates, 8 GPUs per "
             "node), not a measured run.", "",
             f"Model: parallel-block GPT (`strategies/examples/parallel_gpt.py`), sizes {MODEL}; global "
             f"batch {BATCH} at every world size (strong scaling); memory limit "
             f"{MEMORY_LIMIT_BYTES / 1e9:.0f} GB per GPU.", "",
             "![strong scaling](super-a100-strong-scaling.png)", "",
             "| GPUs | " + " | ".join(rows) + " |", "|---:|" + "---:|" * len(rows)]
    for w in worlds:
        cells = []
        for name, rs in rows.items():
            r = next((x for x in rs if x["world"] == w), None)
            if r is None:
                cells.append("-")
            elif r.get("step_time_s") is None:
                cells.append("infeasible" if "error" in r else "-")
            else:
                cells.append(f"{r['step_time_s'] * 1e3:.1f} ms")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += ["", "## Reading it", ""] + notes(rows, worlds)
    lines += ["", "Decompositions chosen (layer count per choice) and placement:", ""]
    for name, rs in rows.items():
        for r in rs:
            lines.append(f"- {name}, {r['world']} GPUs: " + (
                f"placement {r['placement']}, {r['decompositions']}" if "error" not in r else f"error: {r['error']}"))
    (OUT / "README.md.tmp").write_text("\n".join(lines) + "\n")
    (OUT / "README.md.tmp").replace(OUT / "README.md")


if __name__ == "__main__":
    raise SystemExit(main())
