"""The strong-scaling picture (``autopar plan --sweep``): predicted step time against ranks
for single-method plans and the ILP's hybrid plans of one model at a fixed batch (Dryden et al.
2019). A planning product: it re-plans, so it sits beside ``planner``, not in ``report``.

Every point is a plan (no processes): ``make_plan`` with the decomposition kinds restricted.
A single-method series exists for every decomposition class that names one
(``Decomposition.scaling_series``, e.g. "sample-only"): that class's kind plus the
``always_kept`` ones (replicate), its candidates filtered by ``in_scaling_series``. A point
that cannot be planned (no legal decomposition, or out of memory) is left out and listed with
its reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .io import atomic_write_json
from .artifacts import PlanHooks, PlanOptions
from .decomp import REGISTRY
from .errors import AutoparError
from .modelfile import load_model_file
from .planner import load_calibration, make_plan, parse_bytes
from .trace.tracer import trace_model


def series() -> dict[str, tuple[list[str] | None, Any]]:
    """name -> (decomposition kinds, candidate filter): one series per class that names one,
    then the ILP's hybrid over every kind."""
    kept = [k for k, cls in REGISTRY.items() if cls.always_kept]
    out: dict[str, tuple[list[str] | None, Any]] = {}
    for kind, cls in REGISTRY.items():
        if cls.scaling_series:
            out[cls.scaling_series] = ([kind] + [k for k in kept if k != kind],
                                       lambda dec, cls=cls: not isinstance(dec, cls) or dec.in_scaling_series())
    out["hybrid (ILP, all kinds)"] = (None, None)
    return out


def sweep(model: str | Path, worlds: list[int], batch_size: int | None, calibration: str | None,
          memory_limit_bytes: float | None = None, ranks_per_node: int | None = None,
          families: dict | None = None, placement: str | int = "search", pins: tuple = ()) -> dict[str, Any]:
    _, profile = load_calibration(calibration)
    mf = load_model_file(model)
    batch = batch_size or mf.default_batch_size() or 8
    graph = trace_model(mf, batch)   # traced once, planned many times
    out: dict[str, Any] = {"model": str(model), "batch_size": batch, "worlds": worlds, "series": {}, "skipped": []}
    if pins:
        out["pins"] = [str(p) for p in PlanOptions(world_size=1, pins=pins).pins]
    for name, (kinds, keep) in (families or series()).items():
        pts = []
        for w in worlds:
            try:
                r = make_plan(model, PlanOptions(world_size=w, batch_size=batch, calibration=calibration,
                                                 kinds=kinds, memory_limit_bytes=memory_limit_bytes,
                                                 write=False, ranks_per_node=ranks_per_node,
                                                 placement=placement, pins=pins),
                              PlanHooks(profile=profile, graph=graph, choice_filter=keep))
                pts.append({"world": w, "step_time_s": r.plan.predicted.step_time_s,
                            "memory_per_rank_bytes": r.plan.predicted.memory_per_rank_bytes,
                            "decompositions": r.plan.decompositions()})
            except AutoparError as e:
                out["skipped"].append({"series": name, "world": w, "reason": str(e)})
        kind = kinds[0] if kinds else None
        if kind is not None and pts and not any(c.split("(")[0] == kind for p in pts for c in p["decompositions"]):
            # the class applies to no layer of this model (e.g. head parallelism in a CNN)
            out["skipped"].append({"series": name, "world": None,
                                   "reason": f"no layer of the model can take {kind}"})
            continue
        out["series"][name] = pts
    return out


def plot(result: dict[str, Any], png: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, pts in result["series"].items():
        if pts:
            ax.plot([p["world"] for p in pts], [p["step_time_s"] * 1e3 for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"strong scaling, {Path(result['model']).stem}, batch {result['batch_size']} (predicted)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def scaling_sweep(args, worlds: list[int], out_dir: Path, pins: tuple = ()) -> tuple[Path, list[str]]:
    """CLI helper for ``autopar plan --sweep``: write scaling.json and scaling.png to out_dir;
    ``pins`` (``autopar.pins``) hold in every point (a point where one cannot is left out)."""
    res = sweep(args.model, worlds, args.batch_size, args.calibration,
                parse_bytes(args.memory_limit), args.ranks_per_node,
                placement=getattr(args, "placement", "search"), pins=pins)
    atomic_write_json(Path(out_dir) / "scaling.json", res)
    png = plot(res, Path(out_dir) / "scaling.png")
    rows = []
    for name, pts in res["series"].items():
        rows.append(f"{name:<26} " + "  ".join(f"{p['world']}:{p['step_time_s'] * 1e3:.3g}ms" for p in pts))
    for s in res["skipped"][:8]:
        rows.append(f"  (not planned: {s['series']} at {s['world']}: {s['reason'][:100]})")
    return png, rows
