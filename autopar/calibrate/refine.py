"""Learning from runs: refit the profile from measured per-layer times.

A run measures each layer (forward + backward of an instrumented step) at its world size;
the plan predicted it. The model, fitted with medians (robust to the noisy layers of a shared
machine, see ``fit_corrections``)::

    measured_l = s_w * compute_l + c * comm_l   (+ b * ops_l, b = 0 in this fit)

``compute_l`` is the layer's predicted compute (kernels, with the profile's slowdown for w
ranks on a node already applied), ``comm_l`` its predicted communication (halo, statistics,
transitions into it), ``ops_l`` its number of ops; ``s_w`` is one factor per world size w
(how much more the ranks slow each other down than the kernel-mix calibration saw: shared
cores, gloo's communication threads), ``c`` scales communication (waiting for the slowest rank
at every synchronisation), ``b`` is per-op work no benchmark sees.

The refined profile applies per-layer corrections: every exact measurement that priced a
measured layer (plan.json lists them per layer, ``exact_keys``) is scaled by that layer's ratio
(measured - c * comm) / predicted compute (median over the layers sharing it), so any plan that
meets the same local shapes again is priced from what the runs measured; and every
collective's alpha and beta are scaled by ``c``. The per-world factors ``s_w`` are reported but
applied to ``compute_slowdown`` only on request (``apply_world_scale``): on the 2-core machine
they did not transfer between models (ResNet at 4 ranks ran faster than its kernels predict,
the 3-D CNN slower), and held-out predictions got worse with them. The measured profile is left untouched: the refined copy is
written beside it, its provenance naming the runs and the fitted factors.
"""

from __future__ import annotations

import copy
import datetime as _dt
from pathlib import Path
from typing import Any, Iterable

import numpy as np

def _layer_rows(run: dict[str, Any], plan: dict[str, Any]):
    trans_into: dict[int, float] = {}
    for t in plan.get("transitions", []):
        trans_into[t["dst"]] = trans_into.get(t["dst"], 0.0) + t["fwd_s"] + t["bwd_s"]
    by_layer = {l["layer"]: l for l in plan["layers"]}
    # per-layer times come from one instrumented step (timestamps, hooks), which runs slower
    # than the timed steps: scale them to the median timed step
    ph = run["measured"].get("phases") or {}
    instrumented = sum(ph.values()) if ph else 0.0
    norm = run["measured"]["step_time_s"] / instrumented if instrumented > 0 else 1.0
    for m in run["measured"]["per_layer"]:
        lay = by_layer[m["layer"]]
        p = lay["predicted"]
        compute = p["fwd_compute_s"] + p["bwd_compute_s"]
        comm = p["fwd_comm_s"] + p["bwd_comm_s"] + trans_into.get(m["layer"], 0.0)
        yield compute, comm, float(len(lay["kinds"])), m["measured_s"] * norm


def fit_corrections(runs: Iterable[dict[str, Any]], plans: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Robust (median) factors, alternating: per world size w, ``s_w`` = median of
    (measured - c * comm) / compute over the compute-dominated layers (communication under 20 %
    of the prediction; layers under 1 % of the step ignored); ``c`` = median of (measured - s_w *
    compute) / comm over the communication-dominated layers (over half), clipped to [0.25, 4]."""
    by_world: dict[int, list] = {}
    for run, plan in zip(runs, plans):
        w = int(plan["world_size"])
        step = sum(r[0] + r[1] for r in _layer_rows(run, plan)) or 1.0
        for compute, comm, ops, measured in _layer_rows(run, plan):
            if compute + comm >= 0.01 * step and measured > 0:
                by_world.setdefault(w, []).append((compute, comm, measured))
    if sum(len(v) for v in by_world.values()) < 4:
        raise ValueError("too few measured layers to refine from (need at least 4)")
    scales = {str(w): 1.0 for w in by_world}
    comm = 1.0
    for _ in range(4):   # alternate: compute factors given c, then c given the compute factors
        for w, rows in by_world.items():
            r = [(m - comm * k) / c for c, k, m in rows if k < 0.2 * (c + k) and c > 0]
            scales[str(w)] = float(np.median(r)) if r else 1.0
        ratios = [(m - scales[str(w)] * c) / k for w, rows in by_world.items()
                  for c, k, m in rows if k > 0.5 * (c + k)]
        comm = float(np.clip(np.median(ratios), 0.25, 4.0)) if ratios else 1.0
    resid = [abs(scales[str(w)] * c + comm * k - m) / m for w, rows in by_world.items() for c, k, m in rows]
    return {"compute_scale_by_world": scales, "comm_scale": comm, "per_op_overhead_s": 0.0,
            "layers": sum(len(v) for v in by_world.values()),
            "median_rel_residual": float(np.median(resid))}


def exact_corrections(runs, plans, corr: dict[str, Any]) -> dict[str, float]:
    """Per exact entry: the median over the layers it priced of
    (measured - c * comm) / predicted compute, so that re-pricing those layers reproduces what
    was measured. Entries are shared by layers of the same local shape, in any plan."""
    ratios: dict[str, list[float]] = {}
    for run, plan in zip(runs, plans):
        by_layer = {l["layer"]: l for l in plan["layers"]}
        rows = list(_layer_rows(run, plan))
        for m, (compute, comm, ops, measured) in zip(run["measured"]["per_layer"], rows):
            keys = by_layer[m["layer"]].get("exact_keys") or []
            if not keys or compute <= 0 or measured <= 0:
                continue
            r = (measured - corr["comm_scale"] * comm) / compute
            if r > 0:
                for k in keys:
                    ratios.setdefault(k, []).append(r)
    return {k: float(np.clip(np.median(v), 0.25, 4.0)) for k, v in ratios.items()}


def apply_corrections(profile, corr: dict[str, Any]):
    """A copy of ``profile`` with the fitted factors applied (see module docstring): exact
    entries that priced measured layers are scaled by their own ratio (``exact_scale``); the
    slowdown of a world size by its compute factor for everything else."""
    new = copy.deepcopy(profile)
    for key, f in corr.get("exact_scale", {}).items():
        entry = new.exact.get(key)
        if entry is None:
            continue
        for phase in list(entry):
            if isinstance(entry[phase], (int, float)):
                entry[phase] = float(entry[phase]) * f
    if corr.get("apply_world_scale", False):
        for w, s in corr["compute_scale_by_world"].items():
            new.compute_slowdown[str(w)] = profile.slowdown(int(w)) * float(s)
    c = corr["comm_scale"]
    for kind in new.collectives.values():
        for level in kind.values():
            for entry in level.values():
                entry["alpha_s"] = float(entry["alpha_s"]) * c
                entry["beta_s_per_byte"] = float(entry["beta_s_per_byte"]) * c
                entry["refined"] = True
    k = new.kernels.setdefault("runtime_op", {"t0_s": 0.0, "s_per_flop": 0.0, "s_per_byte": 0.0})
    k["t0_s"] = float(k["t0_s"]) + corr["per_op_overhead_s"]
    k["refined"] = True
    return new


def refine_profile(runs: dict[str, Any] | list[dict[str, Any]], profile_path: str | Path,
                   out: str | Path | None = None, plans: list | None = None) -> Path:
    """Refine ``profile_path`` from one or several runs (run.json dicts); write the copy to
    ``out`` (default ``<profile>-refined.json``) and return its path."""
    from ..codegen.plan import load_plan
    from ..io import atomic_write_json
    from .profile import load_profile

    runs = [runs] if isinstance(runs, dict) else list(runs)
    plan_objs = [load_plan(p) for p in (plans or [r["plan"] for r in runs])]
    profile = load_profile(profile_path, check_machine=False)
    corr = fit_corrections(runs, plan_objs)
    corr["exact_scale"] = exact_corrections(runs, plan_objs, corr)
    new = apply_corrections(profile, corr)
    new.provenance = dict(new.provenance)
    new.provenance["refined"] = {
        "from_profile": str(profile_path),
        "runs": [r.get("plan", "") for r in runs],
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "corrections": corr,
        "note": "kernel coefficients refitted from measured per-layer times (autopar.calibrate.refine)",
    }
    p = Path(profile_path)
    out = Path(out) if out else p.with_name(p.stem + "-refined.json")
    atomic_write_json(out, new.to_json())
    return out
