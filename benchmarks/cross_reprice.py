"""Which moves the prediction benchmark's error more: the fresh profile, or when the steps were
measured? Several ``bench_prediction.py --keep DIR`` runs, each with its own fresh quick profile
and its own measured steps, crossed: every run's kept plans priced by every run's profile.

A row of the matrix is one set of measured steps priced by each profile (the diagonal is what
each benchmark run printed); a column, one profile against each set of measurements. On a
machine whose speed moves for minutes at a time, the measurements' level moves the error in
every column alike, which no profile made at another moment can know; the spread along a row
is what a different profile would have changed.

    python benchmarks/cross_reprice.py DIR [DIR ...] [--out FILE] [--kernel-from CLASS=PROFILE ...]
                                      [--time-shared-slowdown CORES] [--insitu-from W=PROFILE ...]
                                      [--profiles-of DIR ...] [--collective-stat mean] [--insitu-stat median|mean]

``--profiles-of DIR ...`` prices every run's steps with those runs' profiles only (the
columns), e.g. the runs whose fresh profile the current calibration code made.

``--collective-stat mean`` is a what-if: every crossed profile's collective models (intra-node,
each kind and group size) fitted again from the sweep rows' MEAN time instead of the median
(``calibrate.collectives.combine_ranks`` keeps both: on oversubscribed cores a collective either
runs at once or waits a time slice, and a step that meets several pays the mean).

``--insitu-stat {median,mean}`` reads every crossed profile's in-step costs (straggler kappa
and sigma, in-situ latencies of every kind) again from its stored probe rounds
(``samples["insitu_raw"]``, ``calibrate.insitu.estimate_in_situ``) by that statistic: the mean
counts the stalls a minority of rounds meet, the median does not (the one calibration stored
is ``samples["insitu_stat"]``; absent, the median). Profiles made before the rounds were
stored cannot take part (named error).

``--time-shared-slowdown CORES`` restates every crossed profile's compute slowdown beyond
CORES ranks as time sharing of the cores (``calibrate.run.time_shared_slowdown``, what a
calibration stores since), in the same temporary copies.

``--insitu-from 2=P`` is a what-if: every crossed profile's in-step costs with 2 ranks running
(straggler kappa and sigma, the in-situ latency of each blocking kind and group size, the share
of a gradient all-reduce that compute does not hide: ``calibrate.insitu``) are replaced by
profile P's, in the same temporary copies.

``--kernel-from elementwise=P`` is a what-if: every crossed profile's fitted model of that kernel
class (and its sweep rows) is replaced by profile P's before pricing, in temporary copies; the
runs' folders are not touched.

Nothing is executed: the measurements are the kept runs' (``reprice_prediction.measured_s``),
the predictions each profile's price of the kept plan (``reprice_prediction.reprice``, native
plans as the planner prices them). Only the runs' own fresh profiles are crossed: a profile
that measured the held-out models' shapes would not price them as never measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reprice_prediction import measured_s, reprice  # noqa: E402


def kept_plans(d: Path) -> list[dict]:
    """The distinct plans one kept run executed: set, candidate row, plan path, measured s."""
    from bench_prediction import CANDIDATES, HELDOUT
    out = []
    for tag, cands, title in (("a", CANDIDATES, "in-sample"), ("h", HELDOUT, "held-out")):
        for i, row in enumerate(cands):
            plan, m = d / f"{tag}-plan{i}" / "plan.json", measured_s(d / f"{tag}-run{i}")
            if plan.exists() and m is not None:
                out.append({"set": title, "row": row, "plan": plan, "measured_s": m})
    return out


def errors(plans: list[dict], profile: Path) -> dict[str, list[float]]:
    """Signed relative errors (predicted - measured) / measured of every plan, by set, and the
    same by set and world size (``"in-sample w2"``, ...)."""
    out: dict[str, list[float]] = {"in-sample": [], "held-out": []}
    for k in plans:
        label, model, world, batch, kinds = k["row"][:5]
        extra = dict(k["row"][6]) if len(k["row"]) > 6 else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = reprice(k["plan"], model, batch, kinds, profile, native_aware=True, extra=extra)
        e = (p - k["measured_s"]) / k["measured_s"]
        out[k["set"]].append(e)
        out.setdefault(f"{k['set']} w{world}", []).append(e)
    return out


def by_world_lines(cells: dict[str, dict], names: list[str], pnames: list[str] | None = None) -> list[str]:
    """Per set and world size, over every plan of every pairing: the median signed and
    absolute error, and the range of the per-profile signed medians (how far one profile's
    reading moves that world's plans). ``names``: the sets of measured steps, ``pnames`` the
    profiles (default the same runs')."""
    pnames = names if pnames is None else pnames
    out = []
    keys = sorted({k for c in cells.values() for k in c if " w" in k})
    for key in keys:
        every = [e for c in cells.values() for e in c.get(key, [])]
        per_profile = [statistics.median(e for m in names for e in cells[f"{m}|{p}"].get(key, []))
                       for p in pnames]
        out.append(f"{key}: {len(every)} plan-pairings, median signed error {100 * statistics.median(every):+.1f} %, "
                   f"median |error| {100 * statistics.median(abs(e) for e in every):.1f} %; per profile, the median "
                   f"signed error ranges {100 * min(per_profile):+.0f} .. {100 * max(per_profile):+.0f} %")
    return out


def load_swaps(specs: list[str]) -> list[tuple[str, dict]]:
    """``CLASS=PROFILE`` arguments as (class, the other profile's data), each file read once."""
    out = []
    for spec in specs:
        op, _, src = spec.partition("=")
        if not op or not src:
            raise SystemExit(f"--kernel-from takes CLASS=PROFILE, got {spec!r} "
                             "(e.g. elementwise=calibration/cpu-2core-gloo.json)")
        q = json.loads(Path(src).read_text())
        if op not in q.get("kernels", {}):
            raise SystemExit(f"{src} has no kernel model {op!r}")
        out.append((op, q))
    return out


#: the in-step samples of one number of ranks running (``calibrate.insitu``), keyed by world
INSITU_BY_WORLD = ("straggler_kappa", "straggler_sigma", "comm_interference", "insitu_latency_by_world_s")


def load_insitu_swaps(specs: list[str]) -> list[tuple[str, dict]]:
    """``W=PROFILE`` arguments as (world, the other profile's samples), each file read once."""
    out = []
    for spec in specs:
        w, _, src = spec.partition("=")
        if not w.isdigit() or not src:
            raise SystemExit(f"--insitu-from takes W=PROFILE, got {spec!r} (e.g. 2=calibration/cpu-2core-gloo.json)")
        q = json.loads(Path(src).read_text()).get("samples") or {}
        if w not in (q.get("straggler_sigma") or {}) or w not in (q.get("insitu_latency_by_world_s") or {}):
            raise SystemExit(f"{src} measured no in-step costs with {w} ranks running")
        out.append((w, q))
    return out


def swap_insitu(samples: dict, w: str, q: dict) -> None:
    """``samples``' in-step costs of ``w`` ranks running replaced by ``q``'s (in place)."""
    for key in INSITU_BY_WORLD:
        if w in (q.get(key) or {}):
            samples.setdefault(key, {})[w] = q[key][w]
    for kind, table in (q.get("insitu_latency_by_kind_s") or {}).items():
        if w in table:
            samples.setdefault("insitu_latency_by_kind_s", {}).setdefault(kind, {})[w] = table[w]
    diagonal = (q.get("insitu_latency_by_world_s") or {}).get(w, {}).get(w)
    if diagonal is not None:
        samples.setdefault("insitu_latency_s", {})[w] = diagonal


def refit_collectives(p: dict, stat: str) -> None:
    """The profile data ``p``'s collective models fitted again from its sweep rows' ``stat``
    time (``"mean_s"`` or ``"median_s"``) as calibration fits them
    (``calibrate.run.fit_collective_models``), in place."""
    from autopar.calibrate.run import fit_collective_models
    p.setdefault("collectives", {}).update(
        fit_collective_models(((p.get("samples") or {}).get("collectives") or {}), stat))


def reestimate_insitu(p: dict, stat: str, where: str = "the profile") -> None:
    """The profile data ``p``'s in-step costs of every world its stored probe rounds hold, read
    again with ``stat`` (``calibrate.insitu.estimate_in_situ``), in place: each world's figures
    laid out by the calibration's own writers (``apply_straggler``, ``apply_insitu``,
    ``apply_insitu_by_kind``) and put in world by world (``swap_insitu``)."""
    from types import SimpleNamespace

    from autopar.calibrate.insitu import apply_insitu, apply_insitu_by_kind, apply_straggler, estimate_in_situ
    samples = p.setdefault("samples", {})
    raw = samples.get("insitu_raw")
    if not raw:
        raise SystemExit(f"{where} has no stored in-situ probe rounds (samples.insitu_raw): it was "
                         "calibrated before they were kept; leave it out of --insitu-stat")
    for w, rounds in raw.items():
        st, lat, by_kind = estimate_in_situ(rounds, int(w), stat)
        q = SimpleNamespace(samples={})
        apply_straggler(q, {w: st})
        apply_insitu(q, {w: lat})
        apply_insitu_by_kind(q, {kind: {w: table} for kind, table in by_kind.items()})
        swap_insitu(samples, w, q.samples)
    samples["insitu_stat"] = stat


def restated_profile(profile: Path, swaps: list[tuple[str, dict]], out: Path,
                     time_shared_cores: int | None = None,
                     insitu: list[tuple[str, dict]] = (), collective_stat: str | None = None,
                     insitu_stat: str | None = None) -> Path:
    """``profile``, or (with ``swaps``, from ``load_swaps``) a copy at ``out`` whose model and
    sweep rows of each swapped kernel class come from the other profile; with
    ``time_shared_cores``, its compute slowdown restated as time sharing of that many cores
    (``calibrate.run.time_shared_slowdown``) from its measured readings; with ``insitu`` (from
    ``load_insitu_swaps``), its in-step costs of those worlds from the other profiles; with
    ``collective_stat`` ("mean_s"), its collective models fitted from that statistic; with
    ``insitu_stat`` ("median" or "mean"), its in-step costs read from its probe rounds with it."""
    if not swaps and time_shared_cores is None and not insitu and not collective_stat and not insitu_stat:
        return profile
    p = json.loads(profile.read_text())
    if insitu_stat:
        reestimate_insitu(p, insitu_stat, str(profile))
    if collective_stat:
        refit_collectives(p, collective_stat)
    for w, q in insitu:
        swap_insitu(p.setdefault("samples", {}), w, q)
    if time_shared_cores is not None:
        from autopar.calibrate.run import time_shared_slowdown
        measured = (p.get("samples") or {}).get("compute_slowdown_measured") or p["compute_slowdown"]
        p["compute_slowdown"] = time_shared_slowdown(measured, time_shared_cores)
    for op, q in swaps:
        p["kernels"][op] = q["kernels"][op]
        rows = ((q.get("samples") or {}).get("kernels") or {}).get(op)
        kept = p.setdefault("samples", {}).setdefault("kernels", {})
        if rows is None:
            kept.pop(op, None)         # no sweep rows there: none of the old ones either
        else:
            kept[op] = rows
    out.write_text(json.dumps(p))
    return out


def main(argv=None) -> int:
    from autopar.io import atomic_write_text
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", help="--keep folders of bench_prediction.py runs (fresh-quick.json in each)")
    ap.add_argument("--out", help="write the matrices here too (and the figures as .json beside it)")
    ap.add_argument("--profiles-of", nargs="+", metavar="DIR",
                    help="price with these runs' profiles only (the columns; default: every run's): e.g. only "
                         "the runs whose profile the current code made")
    ap.add_argument("--kernel-from", action="append", default=[], metavar="CLASS=PROFILE",
                    help="what-if: price with this kernel class's model taken from PROFILE in every profile")
    ap.add_argument("--time-shared-slowdown", type=int, metavar="CORES",
                    help="what-if: every profile's compute slowdown beyond CORES ranks restated as time sharing "
                         "(calibrate.run.time_shared_slowdown), as a calibration now stores it")
    ap.add_argument("--insitu-from", action="append", default=[], metavar="W=PROFILE",
                    help="what-if: every profile's in-step costs with W ranks running (straggler, in-situ "
                         "latencies, comm interference) taken from PROFILE")
    ap.add_argument("--collective-stat", choices=["mean"],
                    help="what-if: every profile's collective models fitted from the sweep rows' mean time")
    ap.add_argument("--insitu-stat", choices=["median", "mean"],
                    help="every profile's in-step costs read from its stored probe rounds by this statistic")
    args = ap.parse_args(argv)
    dirs = [Path(d) for d in args.dirs]
    names = [d.name for d in dirs]
    pdirs = [Path(d) for d in args.profiles_of] if args.profiles_of else dirs
    pnames = [d.name for d in pdirs]
    if len(set(pnames)) != len(pnames) or len(set(names)) != len(names):
        raise SystemExit("run folders must have distinct names (they label the rows and columns)")
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    swaps = load_swaps(args.kernel_from)
    insitu = load_insitu_swaps(args.insitu_from)
    for spec in args.insitu_from:
        w, _, src = spec.partition("=")
        say(f"what-if: every profile's in-step costs with {w} ranks running (straggler, in-situ latencies, "
            f"comm interference) taken from {src}")
    for spec in args.kernel_from:
        op, _, src = spec.partition("=")
        say(f"what-if: every profile's {op} kernel model (and its sweep rows) taken from {src}")
    if args.insitu_stat:
        say(f"every profile's in-step costs (straggler, in-situ latencies) read from its stored probe "
            f"rounds by their {args.insitu_stat}")
    if args.collective_stat:
        say("what-if: every profile's collective models fitted from the sweep rows' mean time, not the median")
    if args.time_shared_slowdown is not None:
        say(f"what-if: every profile's compute slowdown beyond {args.time_shared_slowdown} ranks restated as "
            "time sharing of the cores (calibrate.run.time_shared_slowdown)")
    cells: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="autopar-cross-") as tmp:
        profiles = [restated_profile(q / "fresh-quick.json", swaps, Path(tmp) / f"{i}.json",
                                     args.time_shared_slowdown, insitu,
                                     f"{args.collective_stat}_s" if args.collective_stat else None,
                                     args.insitu_stat)
                    for i, q in enumerate(pdirs)]
        for d, name in zip(dirs, names):
            plans = kept_plans(d)
            for prof, pname in zip(profiles, pnames):
                cells[f"{name}|{pname}"] = errors(plans, prof)
    width = max(len(n) for n in names + pnames) + 2
    for title in ("in-sample", "held-out"):
        # rows: sets of measured steps; columns: profiles
        rows = [[statistics.median(abs(x) for x in cells[f"{m}|{p}"][title]) for p in pnames] for m in names]
        signed = [[statistics.median(cells[f"{m}|{p}"][title]) for p in pnames] for m in names]
        for what, table in (("median |error|", rows),
                            ("median signed error (< 0: measured slower than predicted)", signed)):
            say(f"{title}, {what}: a row per set of measured steps, a column per profile")
            say(" " * width + "".join(f"{p:>{width}}" for p in pnames))
            for name, row in zip(names, table):
                say(f"{name:<{width}}" + "".join(f"{100 * x:>{width - 1}.1f}%" for x in row))
        along_rows = statistics.median(max(r) - min(r) for r in rows)
        along_cols = statistics.median(max(c) - min(c) for c in zip(*rows))
        say(f"{title}: median |error| ranges {100 * along_rows:.1f} points across profiles for the same "
            f"measurements, {100 * along_cols:.1f} points across measurements for the same profile "
            f"(medians over the rows / columns); diagonal (each run as the benchmark printed it): "
            + (", ".join(f"{100 * rows[names.index(p)][j]:.1f} %" for j, p in enumerate(pnames) if p in names)
               or "none (no run priced by its own profile)"))
        cells_all = sorted(x for r in rows for x in r)
        say(f"{title}: over all {len(cells_all)} pairings of measured steps and profile, the median |error| "
            f"ranges {100 * cells_all[0]:.1f}-{100 * cells_all[-1]:.1f} %, median {100 * statistics.median(cells_all):.1f} %; "
            f"per profile (median over the sets of measured steps): "
            + ", ".join(f"{p} {100 * statistics.median(c):.1f} %" for p, c in zip(pnames, zip(*rows))))
    for line in by_world_lines(cells, names, pnames):
        say(line)
    if args.out:
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
        atomic_write_text(Path(args.out).with_suffix(".json"), json.dumps(cells, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
