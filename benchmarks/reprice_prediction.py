"""One measurement, two predictions: the runs a ``bench_prediction.py --keep DIR`` run kept,
predicted again by the per-op runtime overhead as it was priced before (one figure per op, the
chain of ReLUs' ``t0_s``, views free, native plans priced traced) and as it is now (per op
family, views at their dispatch, native plans with the natively measured table).

On a loaded machine the measured steps move with the load while the predictions do not, so
the medians of two bench runs made at different times compare the load as much as the model;
repricing the same runs isolates the model change.

    python benchmarks/reprice_prediction.py DIR [--out FILE] [--before per-op-overhead|conv-one-model|linear-straggler|relative-fit]

``--before conv-one-model``: "before" is the same profile with its convolution shape models
fitted as one model over both of torch's CPU convolution paths (``fit.fit_conv_shape`` with
``split_paths=False``, what ``conv_shape/1`` did) instead of the single per-op overhead; both
fitted on the profile's sweep rows only, as ``calibrate`` fits them.

``--before linear-straggler``: "before" is the same profile without its straggler sigma, so
the cost model multiplies all multi-rank compute by ``1 + kappa`` (what it did before the wait
was priced per segment, ``cost.primitives``), with the same measured kappa.

``--before relative-fit``: both profiles are fitted again from the kept profile's raw samples
(``calibrate.run.refit_profile``). "before": every model by the plain relative fit
(``fit.nnls_relative`` with no reweighting) and the convolution shape models on the sweep rows
alone, as the benchmark's quick profile was fitted before the in-sample shapes were added.
"now": the quasi-likelihood fit and the convolution shape models refitted with the profile's
exact shapes (``calibrate.run.refit_conv_shape_models``, what ``add_exact_shapes`` now does).
Also prints, per convolution phase, the held-out models' measured convolution time (their
exact shapes, measured here into a copy of the profile, never into the repriced ones) summed
against each profile's generic price of the same shapes.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _spearman(a, b) -> float:
    from scipy.stats import spearmanr
    return float(spearmanr(a, b).statistic)


def reprice(plan_path: Path, model, batch, kinds, profile_path: Path, native_aware: bool,
            extra: dict | None = None) -> float:
    """The step time ``profile_path`` predicts for the plan (every layer pinned to its choice,
    every candidate kept); with ``native_aware``, a plan that runs natively priced so
    (``bench_prediction.native_aware_prediction_s``)."""
    from autopar.artifacts import PlanHooks, PlanOptions, load_plan
    from autopar.modelfile import model_env
    from autopar.pipeline import make_plan
    from bench_prediction import native_aware_prediction_s
    plan = load_plan(plan_path)
    force = {l.layer: l.choice for l in plan.layers}
    extra = dict(extra or {})     # the candidate's extra plan options and model environment
    env = extra.pop("env", {})
    with model_env(env):
        r = make_plan(model, PlanOptions(world_size=plan.world_size, batch_size=batch, calibration=str(profile_path),
                                         kinds=kinds, max_candidates=10**6, write=True,
                                         out_dir=plan_path.parent.parent / (plan_path.parent.name + "-reprice-" + profile_path.stem),
                                         **extra),
                      PlanHooks(force=force))
    p = r.plan.predicted.step_time_s
    if native_aware:
        p_plan, native = native_aware_prediction_s(r.plan_path, str(profile_path))
        return p_plan if native else p
    return p


def conv_models_refitted(raw: dict, split_paths: bool) -> dict:
    """A copy of the profile JSON ``raw`` whose convolution shape models are fitted again from
    its sweep rows (not its exact shapes, as ``calibrate`` fits them), with or without torch's
    two CPU paths apart (``fit.fit_conv_shape``)."""
    from autopar.calibrate.fit import _flat_heldout, conv_shape_rows, fit_conv_shape
    from autopar.calibrate.profile import Profile
    out = copy.deepcopy(raw)
    sweep_only = copy.deepcopy(raw)
    sweep_only["exact"] = {}
    prof = Profile.from_json(sweep_only)
    for cls in ("conv_fwd", "conv_bwd_data", "conv_bwd_filter"):
        specs, times = conv_shape_rows(prof, cls)
        m = fit_conv_shape(specs, times, split_paths=split_paths)
        flat = _flat_heldout(specs, times)
        keep = m["heldout_median_rel_err"] is not None and flat is not None and m["heldout_median_rel_err"] < flat - 0.01
        out["kernels"][cls]["shape_model"] = m if keep else None
    return out


def measured_s(run_dir: Path) -> float | None:
    """A kept plan's measured step time: the median over its rounds (``round*/run.json``, as
    ``bench_prediction.run_all`` takes it), or its one ``run.json`` (older runs)."""
    runs = sorted(run_dir.glob("round*/run.json")) or ([run_dir / "run.json"] if (run_dir / "run.json").exists() else [])
    if not runs:
        return None
    return statistics.median(json.loads(r.read_text())["measured"]["step_time_s"] for r in runs)


def refitted(raw: dict, plain_relative: bool) -> dict:
    """A copy of the profile JSON ``raw`` with every model fitted again from its raw samples
    (module docstring, ``--before relative-fit``)."""
    from autopar.calibrate import fit
    from autopar.calibrate.profile import Profile
    from autopar.calibrate.run import refit_conv_shape_models, refit_profile
    prof = Profile.from_json(copy.deepcopy(raw))
    saved = fit.REWEIGHT_ITERATIONS
    try:
        if plain_relative:
            fit.REWEIGHT_ITERATIONS = 0
            exact, prof.exact = prof.exact, {}
            refit_profile(prof)         # conv shape models on the sweep rows alone
            prof.exact = exact
        else:
            refit_profile(prof)
            refit_conv_shape_models(prof)
    finally:
        fit.REWEIGHT_ITERATIONS = saved
    return prof.to_json()


def conv_sums(held_out_exact: dict, profiles: dict) -> list[str]:
    """Per convolution phase: the measured time of the held-out models' convolution shapes,
    summed, over each profile's generic price of them."""
    from autopar.calibrate.fit import conv_spec_from_key
    from autopar.calibrate.kernels import conv_features, normalize_spec
    from autopar.calibrate.profile import Profile
    profs = {name: Profile.from_json(copy.deepcopy(raw)) for name, raw in profiles.items()}
    out = []
    for cls, phase in (("conv_fwd", "fwd"), ("conv_bwd_data", "bwd_data"), ("conv_bwd_filter", "bwd_filter")):
        parts = []
        for name, prof in profs.items():
            meas = priced = 0.0
            n = 0
            for key, e in held_out_exact.items():
                spec = conv_spec_from_key(key)
                if not spec or not (e or {}).get(phase):
                    continue
                s = normalize_spec(spec)
                fl, by = conv_features(s["x"], s["w"], s["stride"], s["padding"], s["dilation"], s["groups"])
                meas += e[phase]
                priced += prof.kernel_time_s(cls, fl, by, spec=spec)
                n += 1
            parts.append(f"{name} {meas / priced:.2f}x" if priced else f"{name} -")
        out.append(f"  {cls}: the held-out CNNs' {n} convolution shapes measured / priced generically: " + ", ".join(parts))
    return out


def held_out_conv_shapes(d: Path, prof_path: Path) -> dict:
    """The held-out CNNs' exact convolution shapes at the benchmark's worlds and batches, measured
    into a copy of the profile (kept in ``d`` as ``held-out-shapes.json``; measured once)."""
    import shutil
    from autopar.calibrate.profile import load_profile
    from autopar.calibrate.run import add_exact_shapes
    from autopar.cost.exact import exact_specs_for_model
    from bench_prediction import HELDOUT
    target = d / "held-out-shapes.json"
    if not target.exists():
        tmp = d / "held-out-shapes.tmp.json"
        shutil.copyfile(prof_path, tmp)
        seen, prof = set(), load_profile(tmp)
        for row in HELDOUT:
            _, model, world, batch = row[:4]
            if "heldout_" not in str(model) or (model, world, batch) in seen:
                continue
            seen.add((model, world, batch))
            specs = exact_specs_for_model(model, world, batch, profile=prof)
            add_exact_shapes(tmp, [s for s in specs if s["op"] == "conv"], progress=lambda s: None)
        tmp.replace(target)
    base = set(json.loads(prof_path.read_text())["exact"])
    return {k: v for k, v in json.loads(target.read_text())["exact"].items() if k not in base}


def main(argv=None) -> int:
    from autopar.io import atomic_write_text
    from bench_prediction import CANDIDATES, HELDOUT
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", help="the --keep folder of a bench_prediction.py run (its fresh-quick.json included)")
    ap.add_argument("--out", help="write the table and medians here too")
    ap.add_argument("--before", choices=["per-op-overhead", "conv-one-model", "linear-straggler", "relative-fit"],
                    default="per-op-overhead",
                    help="what the 'before' prediction undoes (module docstring)")
    args = ap.parse_args(argv)
    d = Path(args.dir)
    prof_new = d / "fresh-quick.json"
    raw = json.loads(prof_new.read_text())
    # "before" options that fit both profiles again: (refit, its flag before / now, file names)
    refits = {"conv-one-model": (lambda r, flag: conv_models_refitted(r, split_paths=not flag),
                                 "conv-two-paths", "conv-one-model"),
              "relative-fit": (lambda r, flag: refitted(r, plain_relative=flag), "quasi-fit", "relative-fit")}
    if args.before in refits:
        refit, new_name, old_name = refits[args.before]
        old, raw = refit(raw, True), refit(raw, False)
        prof_new = d / f"fresh-quick-{new_name}.json"
        atomic_write_text(prof_new, json.dumps(raw))
        prof_old = d / f"fresh-quick-{old_name}.json"
    elif args.before == "linear-straggler":
        old = copy.deepcopy(raw)
        old["samples"].pop("straggler_sigma", None)
        prof_old = d / "fresh-quick-linear-straggler.json"
    else:
        old = copy.deepcopy(raw)
        for key in ("by_family", "native_by_family"):
            old["kernels"].get("runtime_op", {}).pop(key, None)
        prof_old = d / "fresh-quick-single-overhead.json"
    atomic_write_text(prof_old, json.dumps(old))
    lines, rows = [], []
    if args.before == "relative-fit":
        lines += conv_sums(held_out_conv_shapes(d, d / "fresh-quick.json"), {"before": old, "now": raw})
        print("\n".join(lines), flush=True)
    for tag, cands, title in (("a", CANDIDATES, "in-sample"), ("h", HELDOUT, "held-out")):
        for i, row in enumerate(cands):
            label, model, world, batch, kinds = row[:5]
            extra = dict(row[6]) if len(row) > 6 else {}
            plan, m = d / f"{tag}-plan{i}" / "plan.json", measured_s(d / f"{tag}-run{i}")
            if not plan.exists() or m is None:
                continue      # not kept, or the same program as an earlier candidate (measured once)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                p_old = reprice(plan, model, batch, kinds, prof_old, native_aware=args.before != "per-op-overhead",
                                extra=extra)
                p_new = reprice(plan, model, batch, kinds, prof_new, native_aware=True, extra=extra)
            rows.append({"set": title, "model": Path(model).stem, "label": label, "world": world,
                         "measured_s": m, "before_s": p_old, "now_s": p_new})
            lines.append(f"  {title:<9} {label:<32} world {world}: measured {m * 1e3:8.2f} ms  before {p_old * 1e3:8.2f} ms "
                         f"({100 * (p_old - m) / m:+6.1f}%)  now {p_new * 1e3:8.2f} ms ({100 * (p_new - m) / m:+6.1f}%)")
            print(lines[-1], flush=True)
    for title in ("in-sample", "held-out"):
        rs = [r for r in rows if r["set"] == title]
        if not rs:
            continue
        for key in ("before_s", "now_s"):
            err = statistics.median(abs(r[key] - r["measured_s"]) / r["measured_s"] for r in rs)
            per = {}
            for mdl in sorted({r["model"] for r in rs}):
                mr = [r for r in rs if r["model"] == mdl]
                if len(mr) > 2:
                    per[mdl] = round(_spearman([r[key] for r in mr], [r["measured_s"] for r in mr]), 3)
            what = {"per-op-overhead": "per-op overhead", "conv-one-model": "convolution model",
                    "linear-straggler": "straggler wait", "relative-fit": "fits"}[args.before]
            lines.append(f"{title} ({len(rs)} runs), {what} {'as before' if key == 'before_s' else 'now'}: "
                         f"median |error| {100 * err:.1f} %, Spearman within models {per}")
            print(lines[-1])
    if args.out:
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
        atomic_write_text(Path(args.out).with_suffix(".json"), json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
