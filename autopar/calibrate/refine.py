"""Learning from runs: refit the profile's kernel coefficients from measured per-layer times.

What a run measures per layer (forward + backward of the instrumented step) is compared with
what the plan predicted. The model fitted, over every layer of every run given, with
non-negative least squares::

    measured_l - comm_l = a_conv * conv_l + a_matmul * matmul_l + a_other * other_l + b * ops_l

where ``conv_l`` / ``matmul_l`` / ``other_l`` is the layer's predicted compute time when its
anchor op is a convolution / a linear layer / anything else (0 otherwise), ``comm_l`` its
predicted communication (halo, statistics, transitions into it), ``ops_l`` its number of ops,
and ``b`` the per-op overhead (Python dispatch of the runtime, hooks) that kernel benchmarks do
not see. The refined profile scales the coefficients of the matching op classes by ``a`` (and
the exact-shape entries of convolutions and matmuls likewise) and adds ``b / 3`` to every class's
``t0_s`` (an op costs three kernel-model calls: forward and two backward). The measured profile
is left untouched: the refined copy is written beside it, its provenance naming the runs.
"""

from __future__ import annotations

import copy
import datetime as _dt
from pathlib import Path
from typing import Any, Iterable

import numpy as np

CONV_CLASSES = ("conv_fwd", "conv_bwd_data", "conv_bwd_filter")


def _layer_rows(run: dict[str, Any], plan: dict[str, Any]):
    trans_into: dict[int, float] = {}
    for t in plan.get("transitions", []):
        trans_into[t["dst"]] = trans_into.get(t["dst"], 0.0) + t["fwd_s"] + t["bwd_s"]
    by_layer = {l["layer"]: l for l in plan["layers"]}
    for m in run["measured"]["per_layer"]:
        lay = by_layer[m["layer"]]
        p = lay["predicted"]
        compute = p["fwd_compute_s"] + p["bwd_compute_s"]
        comm = p["fwd_comm_s"] + p["bwd_comm_s"] + trans_into.get(m["layer"], 0.0)
        anchor = lay["kinds"][0]
        x = [compute if anchor == "conv" else 0.0, compute if anchor == "linear" else 0.0,
             compute if anchor not in ("conv", "linear") else 0.0, float(len(lay["kinds"]))]
        yield x, m["measured_s"] - comm


def fit_corrections(runs: Iterable[dict[str, Any]], plans: Iterable[dict[str, Any]]) -> dict[str, float]:
    """(a_conv, a_matmul, a_other, per-op overhead b) by non-negative least squares."""
    from scipy.optimize import nnls
    xs, ys = [], []
    for run, plan in zip(runs, plans):
        for x, y in _layer_rows(run, plan):
            xs.append(x)
            ys.append(y)
    if len(xs) < 4:
        raise ValueError("too few measured layers to refine from (need at least 4)")
    a = np.asarray(xs)
    y = np.asarray(ys)
    # weight rows by 1/measured so that small layers count (relative error)
    w = 1.0 / np.maximum(np.abs(y), 1e-6)
    used = a.any(axis=0)
    coef = np.zeros(a.shape[1])
    sol, _ = nnls(a[:, used] * w[:, None], y * w)
    coef[used] = sol
    # classes absent from the runs keep their calibrated coefficients
    for i in range(3):
        if not used[i]:
            coef[i] = 1.0
    resid = (a @ coef - y)
    return {"a_conv": float(coef[0]), "a_matmul": float(coef[1]), "a_other": float(coef[2]),
            "per_op_overhead_s": float(coef[3]), "layers": len(ys),
            "median_rel_residual": float(np.median(np.abs(resid) / np.maximum(np.abs(y), 1e-9)))}


def apply_corrections(profile, corr: dict[str, float]):
    """A copy of ``profile`` with refitted kernel coefficients (see module docstring)."""
    new = copy.deepcopy(profile)
    for cls, k in new.kernels.items():
        a = corr["a_conv"] if cls in CONV_CLASSES else corr["a_matmul"] if cls == "matmul" else corr["a_other"]
        for key in ("t0_s", "s_per_flop", "s_per_byte"):
            k[key] = float(k[key]) * a
        k["t0_s"] += corr["per_op_overhead_s"] / 3.0
        k["refined"] = True
    for key, entry in new.exact.items():
        a = corr["a_matmul"] if str(key).startswith("linear") else corr["a_conv"]
        for phase in list(entry):
            if isinstance(entry[phase], (int, float)):
                entry[phase] = float(entry[phase]) * a + corr["per_op_overhead_s"] / 3.0
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
