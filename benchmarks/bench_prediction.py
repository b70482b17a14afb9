"""Prediction benchmark: how well does the cost model predict measured step times, on models
whose shapes were measured into the profile, on models never measured, and on models never
seen while the cost model was made?

Three sets of plans, each at world 2 and 4 (gloo, CPU), measured with ``autopar execute``
(validation included):

* in-sample (``CANDIDATES``): the shipped examples' plans and forced alternatives; the
  profile holds their exact local shapes (as the shipped profile does);
* development (``DEV``; called "held-out" before): CNNs written for this benchmark
  (``benchmarks/models/dev_*.py``: a VGG-like stack with 5x5 convolutions, a bottleneck ResNet
  of odd widths, a 3-D CNN) whose shapes are never measured into the profile (on-demand
  measurement off): the generic kernel models price them; and the shipped Transformer and GNN
  examples (GPT, Hugging Face GPT-2, the padded PCQM4M GNN, the untouched PyG NNConv model),
  whose shapes the fresh profile never measured either: every GNN plan the shipped runs
  execute is among them, the memory-limited ones included. Their errors chose methods and
  constants of the cost model (the convolution fit, the kernel timing method, the pooling
  backward, ...), so they are NOT held out: they say how well the model fits what it was
  tuned on;
* held-out (``HELDOUT``, ``--set held-out``): models written fresh in
  ``benchmarks/models/heldout/`` and committed before any evaluation ran on them, never used to
  choose a method or a constant (their README). Run them once per cost-model change, after the
  change is committed, and keep the output as written. Target on CPU: median |error| <= 15 %.

By default both run on a FRESH quick profile made first (``calibrate --quick`` at world 4,
run as its command in a process of its own, as a user runs it: ``calibrate_cli``; timed:
target <= 60 s), to which the in-sample models' exact shapes are then added, as
``calibrate --model`` does. For each set it prints the median and maximum |prediction error|
and the Spearman rank correlation between predicted and measured step times within each
model's candidates (and over the whole set). Targets: held-out (and development) median
<= 15 %, in-sample <= 10 %, Spearman >= 0.8 within each model.

Every distinct plan is executed ``--rounds`` times (default 3), round by round with the order
rotated, and its measured step time is the median over the rounds (``run_all``): one execution
per plan, as before, measured the same plan 10-30 % apart within one run on this 2-core VM.
Candidates that plan to the same program (the ILP choosing pure data parallelism, say) are
executed once, share that measurement, and count once in the figures. A plan predicted so short
that ``--steps`` of it last under ``MIN_TIMED_S`` is timed over more steps (``steps_for``).

    python benchmarks/bench_prediction.py [--calibration PROFILE]
                                          [--set both|in-sample|dev|held-out|all]
                                          [--steps 8] [--rounds 3] [--full] [--refine] [--json OUT]
                                          [--models gnn_pcqm4m,pyg_nnconv]

A plan that runs the user's module natively (pure data parallelism, ``runtime.native``;
``cost.primitives.runtime_overhead_applies`` is False) is predicted with the natively measured
per-op overhead in place of the traced one (``native_aware_prediction_s``), which is how the
planner is to price it; the plans' own figures (every plan priced with the traced per-op
overhead) are summarised beside them, and each row keeps both.

``--calibration`` uses that profile for both sets instead of a fresh one; ``--refine`` also
re-plans the in-sample set with a profile refined from half of its runs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "strategies/examples"
MODELS = ROOT / "benchmarks/models"
MODEL_FILTER: set[str] = set()      # --models: only these model files (stems), both sets
#: --speed-history: plan at this machine's usual speed (``autopar.profile.history``), as runs
#: 36-46 did when it was autopar's default; off, the plans are priced as ``autopar plan`` prices
#: them by default (the profile as measured)
SPEED_HISTORY = {"on": False}

# (label, model file, world, batch, kinds or None for all, force {layer: kind} or None)
CANDIDATES = [
    ("resnet2d ILP", EX / "resnet2d.py", 2, 16, None, None),
    ("resnet2d ILP", EX / "resnet2d.py", 4, 16, None, None),
    ("resnet2d sample-only", EX / "resnet2d.py", 2, 16, ["sample"], None),
    ("resnet2d replicate-only", EX / "resnet2d.py", 2, 16, ["replicate"], None),
    ("resnet2d sample-only", EX / "resnet2d.py", 4, 16, ["sample"], None),
    ("resnet2d channel/filter+sample", EX / "resnet2d.py", 2, 16, ["sample", "channel", "filter"], None),
    ("resnet2d batch 32 sample-only", EX / "resnet2d.py", 2, 32, ["sample"], None),
    ("wide_resnet ILP", EX / "wide_resnet.py", 2, 8, None, None),
    ("wide_resnet sample-only", EX / "wide_resnet.py", 2, 8, ["sample"], None),
    ("cnn3d ILP", EX / "cnn3d_large.py", 2, 4, None, None),
    ("cnn3d ILP", EX / "cnn3d_large.py", 4, 4, None, None),
    ("cnn3d sample-only", EX / "cnn3d_large.py", 4, 4, ["sample"], None),
]

# the development set: never measured into the profile (priced by the generic kernel models),
# but looked at while the cost model was tuned
DEV = [
    (f"{name} {what}", MODELS / f"dev_{name}.py", world, batch, kinds, None)
    for name, batch in (("vgg", 16), ("bottleneck", 16), ("cnn3d", 4))
    for world in (2, 4)
    for what, kinds in (("ILP", None), ("sample-only", ["sample"]), ("replicate-only", ["replicate"]))
] + [
    # the Transformer and GNN decompositions on their shipped examples (never measured in)
    (f"{name} {what}", EX / f"{name}.py", world, batch, kinds, None)
    for name, batch in (("gpt", 8), ("gnn_pcqm4m", 8))
    for world in (2, 4)
    for what, kinds in (("ILP", None), ("sample-only", ["sample"]), ("replicate-only", ["replicate"]),
                        ("tensor/head", ["head", "sequence", "vocab", "filter", "row_parallel", "replicate"])
                        if name == "gpt" else ("edges/nodes", ["edges", "nodes", "replicate"]))
] + [("hf_gpt2 ILP", EX / "hf_gpt2.py", 2, 4, None, None)] + [
    # every GNN plan the shipped runs execute (scripts/regenerate.sh), the untouched PyG model's
    # included, and the memory-limited ones (issue 11); a 7th field: more plan options, and
    # "env" for the model file
    (f"pyg_nnconv {what}", EX / "pyg_nnconv.py", world, None, kinds, None)
    for world in (2, 4)
    for what, kinds in (("ILP", None), ("edges", ["edges", "nodes", "replicate"]))
] + [("gnn_pcqm4m ILP 3 MiB", EX / "gnn_pcqm4m.py", 4, 2, None, None, {"memory_limit_bytes": 3 << 20}),
     ("pyg_nnconv ILP 3 MiB", EX / "pyg_nnconv.py", 4, 2, None, None,
      {"memory_limit_bytes": 3 << 20, "env": {"AUTOPAR_GNN_GRAPHS": "2"}})]

# the held-out set: models no method or constant was chosen on (benchmarks/models/heldout/README.md)
HELDOUT = [
    (f"{name} {what}", MODELS / "heldout" / f"{name}.py", world, batch, kinds, None)
    for name, batch in (("dense_cnn", 12), ("vit", 8))
    for world in (2, 4)
    for what, kinds in (("ILP", None), ("sample-only", ["sample"]), ("replicate-only", ["replicate"]))
]

#: ``--set`` -> the sets run, in order ("both" is the default: in-sample and development)
SETS = {"both": ("in_sample", "dev"), "default": ("in_sample", "dev"), "in-sample": ("in_sample",),
        "dev": ("dev",), "held-out": ("held_out",), "all": ("in_sample", "dev", "held_out")}


def sets_for(name: str) -> tuple[str, ...]:
    """The sets ``--set name`` runs."""
    return SETS[name]


def code_revision() -> str:
    """The commit the benchmark runs (``+dirty`` when tracked files differ from it): a held-out
    figure belongs to one cost-model change, so its output says which."""
    import subprocess
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + ("+dirty" if dirty else "")


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr
    return float(spearmanr(a, b).statistic)


def _plan_key(plan_path, model, env: dict) -> tuple:
    """What makes two candidates the same program: model file, its environment, world, batch
    and every layer's decomposition (the generated code and its runtime follow from these)."""
    from autopar.artifacts import load_plan
    plan = load_plan(plan_path)
    return (str(model), tuple(sorted(env.items())), plan.world_size, plan.model.batch_size,
            tuple(l.choice for l in plan.layers), plan.runtime.expected if plan.runtime else None)


#: timed steps of a short plan: at least this many seconds of them per execution (a GPT step
#: of 3-4 ms timed 8 times read 46-66 % apart between rounds), at most ``MAX_STEPS`` steps
MIN_TIMED_S = 0.3
MAX_STEPS = 64


def steps_for(steps: int, predicted_step_s: float) -> int:
    """Timed steps of one execution: ``steps``, or more for a plan predicted so short that
    ``steps`` of them last under ``MIN_TIMED_S`` (at most ``MAX_STEPS``)."""
    if predicted_step_s <= 0:
        return steps
    return max(steps, min(MAX_STEPS, math.ceil(MIN_TIMED_S / predicted_step_s)))


def run_all(calibration: str, steps: int, tmp: Path, tag: str, only: set[int] | None = None,
            candidates: list | None = None, rounds: int = 1) -> list[dict]:
    """Plan every candidate, then execute them ``rounds`` times, round by round (every plan
    once a round, the order rotated each round so that machine drift, which moves this 2-core
    VM by tens of percent within minutes, falls on all plans alike); the measured step time of
    a plan is the median over its rounds of each run's median step. Candidates that plan to the
    same program (``_plan_key``) are executed once and share the measurement (``same_as``)."""
    from autopar.decomp import REGISTRY
    from autopar.errors import AutoparError
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.modelfile import model_env
    from autopar.planner import make_plan
    # one discarded run first: the first processes after a pause (or after calibration) run slow
    _, model0, world0, batch0, _, _ = CANDIDATES[0]
    r0 = make_plan(model0, PlanOptions(world_size=world0, batch_size=batch0, calibration=calibration,
                                       out_dir=tmp / f"{tag}-warm", speed_history=SPEED_HISTORY["on"]))
    execute(r0.plan_path, ExecuteOptions(steps=2, warmup=1, ddp=False), out_dir=tmp / f"{tag}-warm-run",
            progress=lambda s: None)
    planned, first_of = [], {}
    for i, row in enumerate(candidates or CANDIDATES):
        label, model, world, batch, kinds, force = row[:6]
        extra = dict(row[6]) if len(row) > 6 else {}
        env = extra.pop("env", {})
        if only is not None and i not in only:
            continue
        if MODEL_FILTER and Path(model).stem not in MODEL_FILTER:
            continue
        if kinds and any(k not in REGISTRY for k in kinds):
            print(f"  skip {label}: kinds {kinds} not all registered")
            continue
        try:
            with model_env(env):        # the model file reads it; the ranks inherit it
                r = make_plan(model, PlanOptions(world_size=world, batch_size=batch, calibration=calibration,
                                                 out_dir=tmp / f"{tag}-plan{i}", kinds=kinds,
                                                 speed_history=SPEED_HISTORY["on"], **extra),
                              PlanHooks(force=force))
        except AutoparError as e:
            print(f"  {label} @{world}: {e.__class__.__name__}: {e}")
            continue
        key = _plan_key(r.plan_path, model, env)
        planned.append({"i": i, "label": label, "model": model, "world": world, "env": env, "plan_path": r.plan_path,
                        "speed_factor": r.plan.calibration.speed_factor,
                        "same_as": first_of.get(key), "runs": [],
                        "steps": steps_for(steps, r.plan.predicted.step_time_s)})
        first_of.setdefault(key, len(planned) - 1)
    distinct = [c for c in planned if c["same_as"] is None]
    refs: list[float] = []      # the machine reference step before each round
    for k in range(rounds):
        refs.append(machine_reference_ms(20))
        shift = (k * len(distinct)) // max(1, rounds)
        for c in distinct[shift:] + distinct[:shift]:
            if c.get("failed"):
                continue
            try:
                with model_env(c["env"]):
                    run, _ = execute(c["plan_path"], ExecuteOptions(steps=c["steps"], warmup=2, ddp=False),
                                     out_dir=tmp / f"{tag}-run{c['i']}" / f"round{k}", progress=lambda s: None)
            except AutoparError as e:
                print(f"  {c['label']} @{c['world']}: {e.__class__.__name__}: {e}")
                c["failed"] = True
                continue
            c["runs"].append(run)
    rows = []
    for c in planned:
        src = planned[c["same_as"]] if c["same_as"] is not None else c
        if not src["runs"]:
            continue
        run = src["runs"][0]
        per_round = [x.measured.step_time_s for x in src["runs"]]
        p_plan, m = run.predicted.step_time_s, statistics.median(per_round)
        p, native = native_aware_prediction_s(c["plan_path"], calibration)
        ran_native = bool((run.extra or {}).get("native_runtime", False))
        valid = all(x.validation.passed for x in src["runs"])
        note = ""
        if native or ran_native:
            note = (f"  native (plan said {p_plan * 1e3:.2f} ms)" if native else "  ") + \
                   ("" if native == ran_native else f" [ran {'natively' if ran_native else 'traced'}]")
        if c["same_as"] is not None:
            note += f"  = {src['label']} @{src['world']} (the same plan, measured once)"
        spread = max(per_round) / min(per_round) - 1.0
        rows.append({"index": c["i"], "label": c["label"], "model": Path(c["model"]).stem, "world": c["world"],
                     "predicted_s": p, "plan_predicted_s": p_plan, "priced_native": native,
                     "ran_native": ran_native, "measured_s": m, "measured_rounds_s": per_round,
                     "round_spread": spread, "same_as": src["i"] if c["same_as"] is not None else None,
                     "machine_reference_ms_rounds": [round(x, 3) for x in refs],
                     "speed_probe_vs_profile_rounds": [
                         ((x.extra or {}).get("speed_probe") or {}).get("slowdown_vs_calibration")
                         for x in src["runs"]],
                     "error": (p - m) / m, "valid": valid, "speed_factor": c["speed_factor"],
                     "plan": str(c["plan_path"]), "run": run.to_json()})
        print(f"  {c['label']:<32} world {c['world']}: predicted {p * 1e3:8.2f} ms  measured {m * 1e3:8.2f} ms  "
              f"error {100 * (p - m) / m:+6.1f}%  rounds {len(per_round)} spread {100 * spread:4.1f}%  "
              f"validation {'passed' if valid else 'FAILED'}{note}")
    return rows


def native_aware_prediction_s(plan_path, calibration: str) -> tuple[float, bool]:
    """(predicted step time, priced natively): the plan's prediction, or, for a plan that runs
    the user's module natively (``cost.primitives.runtime_overhead_applies`` is False), the
    same with the natively measured per-op overhead in place of the traced one
    (``plan_runtime_overhead_s``): what the planner predicts once it prices native plans so."""
    from autopar.artifacts import load_plan
    from autopar.profile import load_profile
    from autopar.cost.primitives import plan_runtime_overhead_s, runtime_overhead_applies
    from autopar.decomp.base import CostContext
    plan = load_plan(plan_path)
    p = plan.predicted.step_time_s
    if plan.runtime is not None and plan.runtime.expected == "native":
        return p, True          # the planner priced it natively already (``cost.native``)
    graph = plan.graph()
    decisions = {d.layer: d.decomposition() for d in plan.layers}
    if runtime_overhead_applies(graph, decisions, plan.world_size, plan.bn_stats(), plan.model.batch_size):
        return p, False
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = load_profile(calibration, check_machine=False)
    ctx = CostContext(profile=prof, world=plan.world_size, ranks_per_node=plan.mesh.ranks_per_node,
                      speed_factor=plan.calibration.speed_factor)
    return p - plan_runtime_overhead_s(graph, ctx) + plan_runtime_overhead_s(graph, ctx, native=True), True


def _as_planned(rows: list[dict]) -> list[dict]:
    """The rows with the plans' own predictions (``plan_predicted_s``)."""
    return [{**r, "predicted_s": r["plan_predicted_s"],
             "error": (r["plan_predicted_s"] - r["measured_s"]) / r["measured_s"]} for r in rows]


def at_profile_speed(row: dict) -> float | None:
    """A plan's measured step time stated at the machine speed its profile was measured at:
    the median over its rounds of each round's time divided by that round's speed-probe ratio
    (``speed_probe_vs_profile_rounds``: the calibration's probe read after the round's timing,
    against the profile's nominal reading). None unless every round has its reading.

    A diagnostic, not the prediction's figure: the prediction cannot know the machine's speed
    during a later run; this separates what the cost model misses from the machine's drift
    between calibration and run. A plan priced at
    the machine's usual speed (``speed_factor``, ``profile.history``) is compared at that
    speed: each round's ratio is taken to the reading its compute was priced at."""
    times, probes = row.get("measured_rounds_s") or (), row.get("speed_probe_vs_profile_rounds") or ()
    if not times or len(probes) != len(times) or not all(probes):
        return None
    f = float(row.get("speed_factor") or 1.0)
    return statistics.median(t * f / p for t, p in zip(times, probes))


#: the per-plan fields kept in ``--json`` (``plans_in_sample`` / ``plans_dev`` / ``plans_held_out``), enough to
#: recompute every figure of a run later without the ``--keep`` folder
PLAN_FIELDS = ("label", "model", "world", "predicted_s", "plan_predicted_s", "priced_native", "ran_native",
               "measured_s", "measured_rounds_s", "speed_probe_vs_profile_rounds",
               "machine_reference_ms_rounds", "same_as", "index", "valid", "speed_factor")


def plan_rows(rows: list[dict]) -> list[dict]:
    return [{k: r.get(k) for k in PLAN_FIELDS} for r in rows]


def summary(rows: list[dict], title: str, target: float = 0.10) -> dict:
    """Median and max |error| and Spearman over the DISTINCT plans (a candidate that planned to
    the same program as an earlier one shares its measurement and is counted once)."""
    n_candidates = len(rows)
    rows = [r for r in rows if r.get("same_as") is None]
    errs = [abs(r["error"]) for r in rows]
    if not errs:
        print(f"{title}: no plan ran")
        return {"candidates": 0}
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]) if len(rows) > 2 else float("nan")
    per_model = {}
    for m in sorted({r.get("model", "?") for r in rows}):
        mr = [r for r in rows if r.get("model", "?") == m]
        if len(mr) > 2:
            per_model[m] = spearman([r["predicted_s"] for r in mr], [r["measured_s"] for r in mr])
    spreads = [r["round_spread"] for r in rows if len(r.get("measured_rounds_s", ())) > 1]
    s = {"candidates": n_candidates, "distinct_plans": len(rows), "median_abs_error": statistics.median(errs),
         "max_abs_error": max(errs), "spearman": rho, "spearman_per_model": per_model,
         "median_round_spread": statistics.median(spreads) if spreads else None}
    by_world = {}
    for w in sorted({r["world"] for r in rows if "world" in r}):
        e = [r["error"] for r in rows if r.get("world") == w]
        by_world[str(w)] = {"plans": len(e), "median_signed_error": statistics.median(e),
                            "median_abs_error": statistics.median(abs(x) for x in e)}
    if by_world:
        s["by_world"] = by_world
    speed = [(r, at_profile_speed(r)) for r in rows]
    speed = [(r, m) for r, m in speed if m]
    if len(speed) == len(rows):
        e = [(r["predicted_s"] - m) / m for r, m in speed]
        s["at_profile_speed"] = {"median_abs_error": statistics.median(abs(x) for x in e),
                                 "median_signed_error": statistics.median(e)}
    probe = [x for r in rows for x in r.get("speed_probe_vs_profile_rounds") or () if x]
    if probe:
        s["speed_probe_vs_profile"] = statistics.median(probe)
    refs = next((r["machine_reference_ms_rounds"] for r in rows if r.get("machine_reference_ms_rounds")), None)
    if refs:
        s["machine_reference_ms_rounds"] = refs
        s["machine_reference_ms"] = statistics.median(refs)
    print(f"{title}: {n_candidates} candidates, {len(rows)} distinct plans"
          + (f" (median spread of a plan's rounds, max/min - 1: {100 * s['median_round_spread']:.1f}%)"
             if spreads else "")
          + f"; median |error| {100 * s['median_abs_error']:.1f}% "
          f"(target <= {100 * target:.0f}%), max |error| {100 * s['max_abs_error']:.1f}%, Spearman rank "
          f"correlation {rho:.3f} over all; within each model's candidates (target >= 0.8): "
          + ", ".join(f"{m} {v:.3f}" for m, v in per_model.items()))
    if "at_profile_speed" in s:
        a = s["at_profile_speed"]
        print(f"  diagnostic, not the target: with each round's time stated at the profile's machine speed "
              f"(divided by that round's speed-probe ratio), median |error| {100 * a['median_abs_error']:.1f}%, "
              f"median signed {100 * a['median_signed_error']:+.1f}%")
    if by_world:
        print(f"  {title.split(' (')[0]} by world size: " + "; ".join(
            f"world {w}: {v['plans']} plans, median signed error {100 * v['median_signed_error']:+.1f}%, "
            f"median |error| {100 * v['median_abs_error']:.1f}%" for w, v in by_world.items()))
    return s


def _drift(out: dict, key: str) -> None:
    """The machine's speed while ``key``'s set ran against when its profile was measured:
    the median reference step before its rounds / the one right after the calibration (> 1:
    slower than the profile's machine, and every prediction reads low by about that)."""
    cal = (out.get("machine_reference_ms") or {}).get("after calibration")
    ran = (out.get(key) or {}).get("machine_reference_ms")
    if ran:
        print(f"  machine reference step before each round: "
              f"{', '.join(f'{x:.2f}' for x in out[key]['machine_reference_ms_rounds'])} ms (median {ran:.2f} ms)")
    if cal and ran:
        out[key]["machine_vs_profile"] = round(ran / cal, 3)
        print(f"  {key}: the machine reference step ran {ran / cal:.2f}x its time after the calibration")
    probe = (out.get(key) or {}).get("speed_probe_vs_profile")
    if probe:
        print(f"  {key}: the calibration's speed probe, read after each run's timing, took {probe:.2f}x the "
              "profile's nominal reading (median over runs; > 1: slower than the kernels were measured)")


def profile_figures(path: str) -> dict:
    """The profile's figures that move every prediction, kept in ``--json`` so that runs can be
    compared later without their profiles: the nominal speed-probe reading its kernel times are
    stated at, and the 2- and 4-rank in-step costs and compute slowdowns."""
    try:
        s = json.loads(Path(path).read_text()).get("samples") or {}
    except (OSError, ValueError):
        return {}
    lat = s.get("insitu_latency_by_world_s") or {}
    return {"speed_probe_nominal_s": (s.get("speed_probe") or {}).get("nominal_s"),
            "straggler_sigma": s.get("straggler_sigma"), "straggler_kappa": s.get("straggler_kappa"),
            "insitu_latency_2_s": (lat.get("2") or {}).get("2"), "insitu_latency_4_s": (lat.get("4") or {}).get("4"),
            "compute_slowdown_measured": s.get("compute_slowdown_measured")}


def machine_speed(path: str) -> dict:
    """Whether the plans about to be made price the profile's kernels at this machine's usual
    speed (``autopar.profile.history``: the speed-probe readings of earlier calibrations and
    runs here, ``AUTOPAR_SPEED_HISTORY``), and at which: printed, and kept in ``--json``."""
    import warnings

    from autopar.profile.history import usual_speed
    from autopar.profile import load_profile
    if not SPEED_HISTORY["on"]:
        print("machine speed history: not applied (autopar plan's default; --speed-history opts in); "
              "kernels priced at the profile's own speed")
        return {"not_applied": "off (the default; --speed-history opts in)"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ms, why = usual_speed(load_profile(path, check_machine=False))
    if ms is None:
        print(f"machine speed history: not applied ({why}); kernels priced at the profile's own speed")
        return {"not_applied": why}
    print(f"machine speed history: the probe usually reads {ms.usual_probe_s * 1e3:.2f} ms here ({ms.events} "
          f"readings), the profile's kernels were measured at {ms.profile_nominal_s * 1e3:.2f} ms: local compute "
          f"priced at {ms.priced_at_s * 1e3:.2f} ms between them, x{ms.factor:.3f} (the later sets' plans, planned after "
          "the in-sample runs, see theirs too)")
    return ms.to_json()


def calibrate_cli(quick: bool, out: Path) -> tuple[float, float]:
    """A calibration at world 4 made as a user makes it, ``python -m autopar.calibrate.run`` in a
    process of its own: (the command's own timing, the wall time from starting it, interpreter and
    imports included). Not ``calibrate()`` in this process: called after this process had run a
    training step (``machine_reference_ms``), the forked ranks of the in-situ measurements read
    the 2-rank straggler sigma at about half its value from a fresh process and the latency
    lower, and the benchmark's world-2 plans were predicted low."""
    import subprocess
    cmd = [sys.executable, "-m", "autopar.calibrate.run", "--world-size", "4", "--out", str(out)] + \
        (["--quick"] if quick else [])
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"calibration failed ({' '.join(cmd)}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    own = json.loads(out.read_text())["provenance"].get("elapsed_s", wall)
    return float(own), wall


def fresh_profile(tmp: Path) -> tuple[str, float]:
    """A quick profile of this machine at world 4 (timed, ``calibrate_cli``), plus the in-sample
    models' exact shapes (what ``calibrate --model`` and ``plan --exact`` measure)."""
    from autopar.calibrate.exact_ops import add_op_shapes
    from autopar.calibrate.run import add_exact_shapes
    from autopar.cost.exact import exact_specs_for_model
    from autopar.profile import load_profile
    out = tmp / "fresh-quick.json"
    quick_s, wall_s = calibrate_cli(True, out)
    print(f"calibration --quick at world 4: {quick_s:.1f} s (target 60 s; the command's own timing, "
          f"{wall_s:.1f} s from starting it, interpreter and imports included)")
    prof = load_profile(out)
    for k in ("conv_fwd", "conv_bwd_data", "conv_bwd_filter"):
        sm = prof.kernels[k].get("shape_model") or {}
        nat = sm.get("native") or {}
        print(f"  {k}: held-out median error flat {100 * prof.kernels[k]['heldout_median_rel_err']:.0f} %, "
              f"shape-aware {100 * (sm.get('heldout_median_rel_err') or float('nan')):.0f} %"
              + (f" (torch's native CPU path fitted apart: {100 * (nat.get('heldout_median_rel_err') or float('nan')):.0f} % "
                 f"on its {nat.get('n_samples')} rows)" if nat else ""))
    red = prof.samples.get("grad_reducer")
    if red:
        print(f"  the gradient reducer (torch DDP's, charged to every plan that syncs gradients): {red['fixed_s'] * 1e6:.0f} us a step + "
              f"{red['per_tensor_s'] * 1e6:.2f} us per parameter tensor + {red['per_byte_s'] * 1e12:.0f} us per MB")
    t = time.perf_counter()
    seen = set()
    for _, model, world, batch, kinds, _ in CANDIDATES:
        if (model, world, batch) in seen:
            continue
        seen.add((model, world, batch))
        specs = exact_specs_for_model(model, world, batch, profile=prof)
        add_exact_shapes(out, [s for s in specs if s["op"] in ("conv", "linear")], progress=lambda s: None)
        add_op_shapes(out, [s for s in specs if s["op"] == "generic"], progress=lambda s: None)
    print(f"in-sample exact shapes added in {time.perf_counter() - t:.1f} s")
    return str(out), quick_s


def time_calibration(full: bool, tmp: Path) -> None:
    for quick in ([True, False] if full else [True]):
        own, wall = calibrate_cli(quick, tmp / f"cal-{quick}.json")
        print(f"calibration {'--quick' if quick else 'full'} at world 4: {own:.1f} s "
              f"(target {'60 s' if quick else '300 s'}; {wall:.1f} s from starting the command)")


def reprice(row: dict, calibration: str, tmp: Path, tag: str) -> float:
    """The step time ``calibration`` predicts for the very plan a row measured (every layer
    pinned to its decomposition, every candidate kept so that none is pruned away)."""
    from autopar.artifacts import PlanHooks, PlanOptions, load_plan
    from autopar.planner import make_plan
    plan = load_plan(row["plan"])
    _, model, world, batch, kinds, _ = CANDIDATES[row["index"]]
    force = {l.layer: l.choice for l in plan.layers}
    r = make_plan(model, PlanOptions(world_size=world, batch_size=batch, calibration=calibration, kinds=kinds,
                                     max_candidates=10**6, out_dir=tmp / f"{tag}-reprice{row['index']}", write=False),
                  PlanHooks(force=force))
    return r.plan.predicted.step_time_s


def judge_refinement(rows: list[dict], args, tmp: Path) -> dict:
    """Learn from half the plans, judge on the other half (never on what it learned from).

    Two judgements, both against measurements the refinement never saw:
    1. the same held-out runs, predicted by the profile as calibrated and by the refined one
       (one measurement, two predictions: the fairest comparison on a noisy machine);
    2. re-planning with the refined profile: where the planner now picks another plan, that
       plan is measured too (else the run of step 1 stands for it).
    """
    from autopar.calibrate.refine import refine_profile
    train = [r for r in rows if r["index"] % 2 == 0]
    held = [r for r in rows if r["index"] % 2 == 1]
    refined = tmp / "refined.json"
    from autopar.artifacts import RunResult
    refine_profile([RunResult.from_json(r["run"]) for r in train], args.calibration, out=refined,
                   plans=[r["plan"] for r in train])
    info = json.loads(refined.read_text())["provenance"]["refined"]
    c = info["corrections"]
    cv = info.get("cross_validation", {})
    print(f"refined from {len(train)} runs: kinds chosen by leave-one-run-out cross-validation "
          f"{info['kinds'] or 'none'} (LOO median error {100 * cv.get('uncorrected_loo_median_abs_error', float('nan')):.1f}% "
          f"uncorrected -> {100 * cv.get('chosen_loo_median_abs_error', float('nan')):.1f}%); "
          f"drift {c['drift_by_world'] or 'none'}, blocking comm x{c['blocking_comm_scale']:.2f}, gradient all-reduce "
          f"x{c['grad_sync_scale']:.2f}, {c['exact_entries']} exact entries")
    out: dict = {"refinement": {k: info[k] for k in ("kinds", "corrections", "cross_validation",
                                                       "training_median_abs_error")}}
    same = []
    for r in held:
        p_after = reprice(r, str(refined), tmp, "c")
        same.append({**r, "predicted_after_s": p_after, "error_after": (p_after - r["measured_s"]) / r["measured_s"]})
        print(f"  {r['label']:<32} world {r['world']}: measured {r['measured_s'] * 1e3:8.2f} ms  predicted "
              f"{r['predicted_s'] * 1e3:8.2f} ms ({100 * r['error']:+6.1f}%) as calibrated, "
              f"{p_after * 1e3:8.2f} ms ({100 * (p_after - r['measured_s']) / r['measured_s']:+6.1f}%) refined")
    out["heldout_same_runs_before"] = summary(held, "held-out runs, profile as calibrated")
    out["heldout_same_runs_after"] = summary([{**r, "predicted_s": r["predicted_after_s"], "error": r["error_after"]}
                                              for r in same], "held-out runs, refined profile")
    # 2. re-plan with the refined profile; measure only plans that changed
    from autopar.artifacts import PlanHooks, PlanOptions, load_plan
    from autopar.planner import make_plan
    replanned, changed = [], []
    for r in held:
        _, model, world, batch, kinds, force = CANDIDATES[r["index"]]
        p2 = make_plan(model, PlanOptions(world_size=world, batch_size=batch, calibration=str(refined), kinds=kinds,
                                          out_dir=tmp / f"d-plan{r['index']}", write=False), PlanHooks(force=force))
        old = [l.choice for l in load_plan(r["plan"]).layers]
        new = [l.choice for l in p2.plan.layers]
        if old != new:
            changed.append(r["index"])
    if changed:
        print(f"re-planning with the refined profile changed {len(changed)} held-out plan(s); measuring them")
        rows2 = {x["index"]: x for x in run_all(str(refined), args.steps, tmp, "b", only=set(changed),
                                                 rounds=args.rounds)}
    else:
        rows2 = {}
        print("re-planning with the refined profile chose the same plans")
    for s_ in same:
        replanned.append(rows2.get(s_["index"]) or {**s_, "predicted_s": s_["predicted_after_s"], "error": s_["error_after"]})
    out["heldout_replanned_after"] = summary(replanned, "held-out, re-planned with the refined profile")
    return out


def machine_reference_ms(steps: int = 40) -> float:
    """Median milliseconds of one fixed single-process training step (two 3x3 convolutions
    with batch norm and ReLU on [8, 16, 32, 32], SGD; one thread), timed in this process: the
    machine's speed at that moment, printed at the start, after the calibration, between the
    sets and at the end. The 256^3 matmul probe missed a phase of this VM (2026-12-01 from about
    15:55 UTC) in which single-process CNN steps ran ~20 % slower than when the quick profile was
    measured minutes before, and every prediction read 15-45 % low; this reads such a drift."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 16, 32, 32, generator=g)
        net = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32),
                                  torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 3, padding=1),
                                  torch.nn.BatchNorm2d(32), torch.nn.ReLU())
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        ts = []
        for i in range(steps + 5):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            net(x).square().mean().backward()
            opt.step()
            if i >= 5:
                ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts)
    finally:
        torch.set_num_threads(threads)


def _reference(out: dict, when: str) -> None:
    ms = machine_reference_ms()
    out.setdefault("machine_reference_ms", {})[when] = round(ms, 3)
    print(f"machine reference step ({when}): {ms:.2f} ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calibration", help="use this profile for both sets (default: a fresh quick one)")
    ap.add_argument("--set", choices=sorted(SETS), default="both",
                    help="both (default): in-sample and development; held-out: only the held-out models "
                         "(benchmarks/models/heldout/, run once per cost-model change); all: the three")
    ap.add_argument("--limit", type=int, help="only the first N plans of each set (a smoke test)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3,
                    help="execute every distinct plan this many times, round by round (median over rounds)")
    ap.add_argument("--full", action="store_true", help="also time a full calibration")
    ap.add_argument("--no-calibration-timing", action="store_true")
    ap.add_argument("--refine", action="store_true", help="refine the profile from the runs and re-predict")
    ap.add_argument("--json", help="write the figures to this JSON file")
    ap.add_argument("--keep", help="keep every plan and run under this folder (for analysis)")
    ap.add_argument("--models", help="comma-separated model file stems (e.g. gnn_pcqm4m,pyg_nnconv): only "
                                     "their plans, in every set run")
    ap.add_argument("--speed-history", action="store_true",
                    help="plan at this machine's usual speed (autopar plan --speed-history), as runs 36-46 did")
    args = ap.parse_args(argv)
    SPEED_HISTORY["on"] = bool(args.speed_history)
    if args.rounds < 1 or args.steps < 1:
        ap.error(f"--rounds {args.rounds} / --steps {args.steps}: each plan needs at least one round of at "
                 "least one step; use --rounds 1 for one execution per plan")
    if args.models:
        MODEL_FILTER.update(args.models.split(","))
    import os
    out: dict = {"loadavg_start": [round(x, 2) for x in os.getloadavg()], "sets": list(sets_for(args.set)),
                 "code": code_revision()}
    print(f"sets: {', '.join(out['sets'])}; code: {out['code']}")
    print(f"load average at the start (1 / 5 / 15 min): {' / '.join(map(str, out['loadavg_start']))}"
          " (other work on this machine slows the measured steps, not the predictions)")
    _reference(out, "start")
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(args.keep) if args.keep else Path(t)
        tmp.mkdir(parents=True, exist_ok=True)
        if args.calibration is None:
            args.calibration, out["quick_calibration_s"] = fresh_profile(tmp)
            if args.full:
                time_calibration(True, tmp)
        elif not args.no_calibration_timing:
            time_calibration(args.full, tmp)
        print(f"profile: {args.calibration}")
        out["profile"] = profile_figures(args.calibration)
        out["machine_speed"] = machine_speed(args.calibration)
        _reference(out, "after calibration")
        sets = sets_for(args.set)
        if "in_sample" in sets:
            rows = run_all(args.calibration, args.steps, tmp, "a",
                           only=set(range(args.limit)) if args.limit else None, rounds=args.rounds)
            out["before"] = out["in_sample"] = summary(rows, "in-sample (shapes in the profile)")
            out["plans_in_sample"] = plan_rows(rows)
            _drift(out, "in_sample")
            out["in_sample_plan_figure"] = summary(_as_planned(rows), "in-sample, the plans' own figures "
                                                   "(native plans priced with the traced per-op overhead)")
            if args.refine:
                out.update(judge_refinement(rows, args, tmp))
        for key, tag, cands, title in (
                ("dev", "d", DEV, "development (models never measured, looked at while tuning)"),
                ("held_out", "h", HELDOUT, "held-out (models never seen while the cost model was made)")):
            if key not in sets:
                continue
            if len(sets) > 1:
                _reference(out, f"before the {key} set")
            hrows = run_all(args.calibration, args.steps, tmp, tag, candidates=cands,
                            only=set(range(args.limit)) if args.limit else None, rounds=args.rounds)
            out[key] = summary(hrows, title, target=0.15)
            out[f"plans_{key}"] = plan_rows(hrows)
            _drift(out, key)
            out[f"{key}_plan_figure"] = summary(_as_planned(hrows), f"{title.split(' (')[0]}, the plans' own figures "
                                                "(native plans priced with the traced per-op overhead)", target=0.15)
        for k in ("in_sample", "dev", "held_out"):
            if k in out and out[k].get("candidates"):
                print(f"{k}: median |error| {100 * out[k]['median_abs_error']:.1f} %, Spearman within "
                      f"models {out[k]['spearman_per_model']}")
    _reference(out, "end")
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average at the end: {' / '.join(map(str, out['loadavg_end']))}")
    if args.json:
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.json), json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
