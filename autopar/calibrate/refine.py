"""Learning from runs: correct the profile from measured step, phase and per-layer times.

A run of a plan measures its step time, its phases (forward, backward, waiting for the
gradient all-reduce, optimizer) and every layer's forward + backward (instrumented steps,
scaled to the median timed step). The plan predicted each of them from three kinds of terms:
``compute_l`` (kernels of layer l), ``comm_l`` (collectives the ranks wait on inside the step:
statistics, halos, the transitions into l) and the exposed gradient all-reduce ``X``. The
corrected model of one run is::

    step = sum_l ( f(l) * a_w * compute_l + c * comm_l ) + g * X + optimizer

with four kinds of factor, each fitted with medians (robust to the noisy steps of a shared
machine) and clipped to [0.25, 4]:

* ``drift``: per number of ranks w running on a node, a factor ``a_w`` on all compute: the ratio
  (measured - c * comm) / compute over the compute-dominated layers of the runs at w, weighted
  by compute (the machine runs w ranks slower or faster than its calibration said);
* ``exact``: per exact measurement (``plan.json`` lists per layer the ``exact_keys`` that
  priced it), f = median over the layers it priced of that ratio / a_w, so a plan that meets
  the same local shapes again is priced from what the runs measured;
* ``blocking``: ``c`` = median of (measured - f * compute) / comm over the layers whose
  prediction is mostly communication (``cost.primitives.correction("blocking_comm_scale")``);
* ``grad_sync``: ``g`` = median over runs of the measured all-reduce wait / predicted ``X``
  (``correction("grad_sync_scale")``).

Which factors to apply is decided by leave-one-run-out cross-validation: each subset of the
four kinds is fitted on all runs but one and predicts the step time of the one left out; the
subset with the lowest median error is applied, unless it beats the profile as calibrated by
less than 1 point and 10 % of its error (then nothing is: a smaller gain is the runs' noise). With fewer than three runs there is nothing to cross-validate against, and the
default set ``exact + blocking + grad_sync`` is applied and marked so. The measured profile is
left untouched: the refined copy is written beside it, its provenance naming the runs, the
factors, the cross-validation table and the subset chosen.
"""

from __future__ import annotations

import copy
import datetime as _dt
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from ..artifacts import RunResult, load_plan
from ..io import atomic_write_json
from ..profile.profile import load_profile

KINDS = ("exact", "drift", "blocking", "grad_sync")
DEFAULT_KINDS = ("exact", "blocking", "grad_sync")
CLIP = (0.25, 4.0)
#: factors are applied only if they cut the leave-one-run-out median error by at least this
#: much (absolute, and relative to the uncorrected error)
MIN_GAIN_ABS = 0.01
MIN_GAIN_REL = 0.1


@dataclass(frozen=True)
class LayerRow:
    compute_s: float
    comm_s: float
    keys: tuple[str, ...]
    measured_s: float
    world: int = 1


@dataclass(frozen=True)
class RunRows:
    """What one measured run tells about its plan's prediction."""

    label: str
    world: int
    layers: tuple[LayerRow, ...]
    exposed_s: float            # predicted exposed gradient all-reduce X
    grad_wait_s: float          # measured wait for it (scaled like the layers)
    optimizer_s: float          # predicted optimizer step
    step_measured_s: float
    step_predicted_s: float

    def predict_s(self, corr: "Corrections") -> float:
        t = sum(corr.compute_factor(l.keys, self.world) * l.compute_s + corr.blocking * l.comm_s
                for l in self.layers)
        return t + corr.grad_sync * self.exposed_s + self.optimizer_s


@dataclass(frozen=True)
class Corrections:
    """``exact``: per exact entry, its factor beyond the drift of the world that measured it;
    ``drift``: per number of ranks running on a node (str), the machine's factor."""

    exact: dict[str, float]
    drift: dict[str, float] = field(default_factory=dict)
    blocking: float = 1.0
    grad_sync: float = 1.0

    def drift_of(self, world: int) -> float:
        return float(self.drift.get(str(world), 1.0))

    def compute_factor(self, keys: Sequence[str], world: int = 1) -> float:
        fs = [self.exact[k] for k in keys if k in self.exact]
        return (float(np.median(fs)) if fs else 1.0) * self.drift_of(world)


def run_rows(run: RunResult, plan) -> RunRows:
    """The rows of one run (``autopar.artifacts.RunResult``) against its typed plan
    (``autopar.artifacts.Plan``)."""
    trans_into: dict[int, float] = {}
    for t in plan.transitions:
        trans_into[t.dst] = trans_into.get(t.dst, 0.0) + t.fwd_s + t.bwd_s
    by_layer = {lay.layer: lay for lay in plan.layers}
    # per-layer and phase times come from instrumented steps (timestamps, hooks), which run
    # slower than the timed steps: scale them to the median timed step
    ph = dict(run.measured.phases or {})
    instrumented = sum(ph.values()) if ph else 0.0
    step = float(run.measured.step_time_s)
    norm = step / instrumented if instrumented > 0 else 1.0
    world = plan.world_size
    on_node = min(world, int(plan.mesh.ranks_per_node or world))
    layers = []
    for m in run.measured.per_layer:
        lay = by_layer[m.layer]
        p = lay.predicted
        layers.append(LayerRow(compute_s=p.compute_s, comm_s=p.comm_s + trans_into.get(m.layer, 0.0),
                               keys=tuple(lay.exact_keys), measured_s=float(m.measured_s) * norm, world=on_node))
    pred = plan.predicted
    return RunRows(label=run.plan, world=on_node, layers=tuple(layers),
                   exposed_s=float(pred.exposed_comm_s),
                   grad_wait_s=float(ph.get("grad_sync_wait_s", 0.0)) * norm,
                   optimizer_s=float(pred.optimizer_s),
                   step_measured_s=step, step_predicted_s=float(pred.step_time_s))


def _clip(x: float) -> float:
    return float(np.clip(x, *CLIP))


def fit(runs: Sequence[RunRows], kinds: Iterable[str] = DEFAULT_KINDS) -> Corrections:
    """Fit the factors of ``kinds`` (the others stay 1) on ``runs`` (see module docstring).
    Layers under 1 % of their run's predicted step are ignored (timer noise)."""
    kinds = set(kinds)
    rows = []
    for r in runs:
        total = sum(l.compute_s + l.comm_s for l in r.layers) or 1.0
        rows += [l for l in r.layers if l.compute_s + l.comm_s >= 0.01 * total and l.measured_s > 0]
    corr = Corrections(exact={})
    for _ in range(4):   # alternate: compute factors given c, then c given the compute factors
        def ratio(l):
            return (l.measured_s - corr.blocking * l.comm_s) / l.compute_s if l.compute_s > 0 else 0.0
        drift: dict[str, float] = {}
        if "drift" in kinds:
            # per world, over the compute-dominated layers, weighted by compute (small layers
            # carry most of the timer noise, communication-bound ones its waiting)
            by_w: dict[str, list[float]] = {}
            for l in rows:
                if l.compute_s > 0 and l.comm_s < 0.2 * (l.compute_s + l.comm_s) and ratio(l) > 0:
                    acc = by_w.setdefault(str(l.world), [0.0, 0.0])
                    acc[0] += ratio(l) * l.compute_s
                    acc[1] += l.compute_s
            drift = {w: _clip(n / d) for w, (n, d) in by_w.items() if d > 0}
        ratios: dict[str, list[float]] = {}
        for l in rows:
            r = ratio(l)
            if r > 0:
                for k in l.keys:
                    ratios.setdefault(k, []).append(r / drift.get(str(l.world), 1.0))
        exact = {k: _clip(np.median(v)) for k, v in ratios.items()} if "exact" in kinds else {}
        corr = Corrections(exact=exact, drift=drift, blocking=corr.blocking)
        if "blocking" in kinds:
            cr = [(l.measured_s - corr.compute_factor(l.keys, l.world) * l.compute_s) / l.comm_s
                  for l in rows if l.comm_s > 0.5 * (l.compute_s + l.comm_s)]
            corr = Corrections(exact=exact, drift=drift, blocking=_clip(np.median(cr)) if cr else 1.0)
    g = 1.0
    if "grad_sync" in kinds:
        gr = [r.grad_wait_s / r.exposed_s for r in runs if r.exposed_s > 0.02 * r.step_predicted_s]
        g = _clip(np.median(gr)) if gr else 1.0
    return Corrections(exact=corr.exact, drift=corr.drift, blocking=corr.blocking, grad_sync=g)


def cross_validate(runs: Sequence[RunRows]) -> dict[str, Any]:
    """Leave-one-run-out median |error| of the step time for every subset of ``KINDS``; the
    subset with the lowest error wins (ties: fewer kinds), the empty subset (the profile as
    calibrated) included."""
    table = []
    for n in range(len(KINDS) + 1):
        for sub in itertools.combinations(KINDS, n):
            errs = []
            for i, held in enumerate(runs):
                rest = [r for j, r in enumerate(runs) if j != i]
                corr = fit(rest, sub)
                errs.append(abs(held.predict_s(corr) - held.step_measured_s) / held.step_measured_s)
            table.append({"kinds": list(sub), "loo_median_abs_error": float(np.median(errs)),
                          "loo_max_abs_error": float(max(errs))})
    best = min(table, key=lambda row: (round(row["loo_median_abs_error"], 4), len(row["kinds"])))
    base = table[0]["loo_median_abs_error"]
    if best["loo_median_abs_error"] > base - max(MIN_GAIN_ABS, MIN_GAIN_REL * base):
        best = table[0]   # a gain this small is the runs' noise, not a fault of the profile
    return {"table": table, "chosen": best["kinds"], "chosen_loo_median_abs_error": best["loo_median_abs_error"],
            "uncorrected_loo_median_abs_error": base,
            "min_gain": {"absolute": MIN_GAIN_ABS, "relative": MIN_GAIN_REL}}


def apply_corrections(profile, corr: Corrections):
    """A copy of ``profile`` with ``corr`` applied: exact entries scaled by their own factor;
    ``blocking``, ``grad_sync`` and the drift per number of ranks on a node (``compute_drift``)
    stored as ``samples["corrections"]`` for ``cost.primitives``."""
    new = copy.deepcopy(profile)
    for key, entry in new.exact.items():
        f = corr.exact.get(key)
        if f is None:
            continue
        for phase in list(entry):
            if isinstance(entry[phase], (int, float)):
                entry[phase] = float(entry[phase]) * f
    c = dict(new.samples.get("corrections") or {})
    c["blocking_comm_scale"] = float(c.get("blocking_comm_scale", 1.0)) * corr.blocking
    c["grad_sync_scale"] = float(c.get("grad_sync_scale", 1.0)) * corr.grad_sync
    drift = dict(c.get("compute_drift") or {})
    for w, a in corr.drift.items():
        drift[w] = float(drift.get(w, 1.0)) * a
    if drift:
        c["compute_drift"] = drift
    new.samples["corrections"] = c
    return new


def refine_profile(runs: RunResult | Sequence[RunResult], profile_path: str | Path,
                   out: str | Path | None = None, plans: list | None = None) -> Path:
    """Refine ``profile_path`` from one or several runs (``RunResult``, as ``load_run`` reads
    run.json); write the copy to ``out`` (default ``<profile>-refined.json``) and return its path."""

    runs = [runs] if isinstance(runs, RunResult) else list(runs)
    plan_objs = [load_plan(p) for p in (plans or [r.plan for r in runs])]
    rows = [run_rows(r, p) for r, p in zip(runs, plan_objs)]
    if sum(len(r.layers) for r in rows) < 4:
        raise ValueError("too few measured layers to refine from (need at least 4)")
    if len(rows) >= 3:
        cv = cross_validate(rows)
        kinds = cv["chosen"]
    else:
        cv = {"note": f"{len(rows)} run(s): nothing to cross-validate against; default kinds applied"}
        kinds = list(DEFAULT_KINDS)
    corr = fit(rows, kinds)
    profile = load_profile(profile_path, check_machine=False)
    new = apply_corrections(profile, corr)
    in_sample = [abs(r.predict_s(corr) - r.step_measured_s) / r.step_measured_s for r in rows]
    before = [abs(r.step_predicted_s - r.step_measured_s) / r.step_measured_s for r in rows]
    new.provenance = dict(new.provenance)
    new.provenance["refined"] = {
        "from_profile": str(profile_path),
        "runs": [r.plan for r in runs],
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "kinds": list(kinds),
        "corrections": {"drift_by_world": corr.drift, "blocking_comm_scale": corr.blocking,
                        "grad_sync_scale": corr.grad_sync, "exact_entries": len(corr.exact),
                        "exact_scale": corr.exact},
        "cross_validation": cv,
        "training_median_abs_error": {"before": float(np.median(before)), "after": float(np.median(in_sample))},
        "note": "factors learned from measured runs (autopar.calibrate.refine); the measured "
                "entries they scale are otherwise unchanged",
    }
    p = Path(profile_path)
    out = Path(out) if out else p.with_name(p.stem + "-refined.json")
    atomic_write_json(out, new.to_json())
    return out
