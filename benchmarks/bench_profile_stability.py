"""How much do the predictions of the same plans move from one fresh quick profile to the next?

A prediction can only be as repeatable as the profile it is priced with. This makes K quick
profiles of this machine back to back (``bench_prediction.fresh_profile``: ``calibrate --quick``
at world 4, then the in-sample models' exact shapes), plans a fixed set of candidates once
(with the first profile), and prices every plan again with each profile, every layer pinned
to its planned choice (``reprice_prediction.reprice``). Nothing is executed: the spread is the
calibration's alone, not the measured steps'.

Each profile is priced twice: as calibrated (kernel times stated at the calibration's nominal
machine speed, ``calibrate.speed``) and as measured (the same profile with its raw kernel times,
``speed.as_measured``, every model fitted again), so the probe's effect is read on the same
measurements.

Printed: per plan, the K predictions and their coefficient of variation (standard deviation
/ mean) both ways; the median over plans, in-sample and held-out; and the spread of each
in-step quantity the profiles measured (straggler, in-situ latency, compute slowdown).

    python benchmarks/bench_profile_stability.py [--profiles 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the candidates priced (indices into bench_prediction's lists): every in-sample one, and the
#: held-out ILP plans at both world sizes
IN_SAMPLE = range(12)


def _held_out_rows():
    from bench_prediction import HELDOUT
    return [i for i, r in enumerate(HELDOUT) if r[0].endswith(" ILP")]


def as_measured_copy(path: Path) -> Path:
    """The profile at ``path`` with its raw kernel times, every model fitted again."""
    from autopar.calibrate.profile import load_profile, save_profile
    from autopar.calibrate.run import refit_conv_shape_models, refit_profile
    from autopar.calibrate.speed import as_measured
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = load_profile(path, check_machine=False)
    as_measured(prof)
    refit_profile(prof)
    refit_conv_shape_models(prof)
    out = path.with_name(path.stem + "-as-measured.json")
    save_profile(prof, out)
    return out


def quantities(path: Path) -> dict[str, float]:
    """The in-step quantities of a profile, by name."""
    p = json.loads(path.read_text())
    s = p["samples"]
    q = {}
    for w in ("2", "4"):
        q[f"straggler sigma({w})"] = s["straggler_sigma"][w]
        q[f"straggler kappa({w})"] = s["straggler_kappa"][w]
        q[f"in-situ latency({w} of {w}) ms"] = 1e3 * s["insitu_latency_by_world_s"][w][w]
        q[f"compute slowdown({w})"] = p["compute_slowdown"][w]
        q[f"comm interference({w})"] = s["comm_interference"][w]
    q["speed probe nominal ms"] = 1e3 * (s.get("speed_probe") or {}).get("nominal_s", float("nan"))
    return q


def cv(xs) -> float:
    return statistics.pstdev(xs) / statistics.fmean(xs) if len(xs) > 1 else float("nan")


def main(argv=None) -> int:
    from autopar.artifacts import PlanOptions
    from autopar.errors import AutoparError
    from autopar.io import atomic_write_text
    from autopar.modelfile import model_env
    from autopar.pipeline import make_plan
    from bench_prediction import CANDIDATES, HELDOUT, fresh_profile
    from reprice_prediction import reprice
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", type=int, default=4)
    ap.add_argument("--out", help="write the printed lines here too (and the figures as .json)")
    args = ap.parse_args(argv)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    tmp = Path(tempfile.mkdtemp(prefix="autopar-stability-"))
    profiles: list[tuple[Path, Path]] = []
    for k in range(args.profiles):
        d = tmp / f"p{k}"
        d.mkdir()
        path, quick_s = fresh_profile(d)
        profiles.append((Path(path), as_measured_copy(Path(path))))
        say(f"profile {k}: quick calibration {quick_s:.1f} s, " + ", ".join(
            f"{n} {v:.4g}" for n, v in quantities(Path(path)).items()))
    rows = []
    sets = [("in-sample", CANDIDATES, list(IN_SAMPLE)), ("held-out", HELDOUT, _held_out_rows())]
    for title, cands, idx in sets:
        for i in idx:
            label, model, world, batch, kinds = cands[i][:5]
            extra = dict(cands[i][6]) if len(cands[i]) > 6 else {}
            env = extra.pop("env", {})
            try:
                with model_env(env), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    r = make_plan(model, PlanOptions(world_size=world, batch_size=batch,
                                                     calibration=str(profiles[0][0]), kinds=kinds,
                                                     out_dir=tmp / f"{title}-plan{i}", **extra))
                    both = {how: [reprice(r.plan_path, model, batch, kinds, p[j], native_aware=True,
                                          extra=dict(cands[i][6]) if len(cands[i]) > 6 else {})
                                  for p in profiles]
                            for j, how in enumerate(("calibrated", "as measured"))}
            except AutoparError as e:
                say(f"  {label} @{world}: {e.__class__.__name__}: {e}")
                continue
            rows.append({"set": title, "label": label, "world": world, **both})
            say(f"  {title:<9} {label:<32} world {world}: calibrated "
                + " ".join(f"{1e3 * x:7.2f}" for x in both["calibrated"]) + f" ms (CV {100 * cv(both['calibrated']):4.1f} %)"
                + "  as measured " + " ".join(f"{1e3 * x:7.2f}" for x in both["as measured"])
                + f" ms (CV {100 * cv(both['as measured']):4.1f} %)")
    for title, _, _ in sets:
        rs = [r for r in rows if r["set"] == title]
        if rs:
            say(f"{title} ({len(rs)} plans, {args.profiles} profiles): median coefficient of variation of a "
                f"plan's prediction across profiles: calibrated (speed probe) "
                f"{100 * statistics.median(cv(r['calibrated']) for r in rs):.1f} %, as measured "
                f"{100 * statistics.median(cv(r['as measured']) for r in rs):.1f} %")
    qs = [quantities(p) for p, _ in profiles]
    say("in-step quantities across the profiles (min - max, coefficient of variation):")
    for name in qs[0]:
        vals = [q[name] for q in qs]
        say(f"  {name:<28} {min(vals):.4g} - {max(vals):.4g}  CV {100 * cv(vals):.0f} %")
    if args.out:
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
        atomic_write_text(Path(args.out).with_suffix(".json"),
                          json.dumps({"rows": rows, "quantities": qs, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
