"""Tournament training measured on this machine: T = 1, 2, 4 trainers at world 4, side by side
in one run, samples per second of the whole job and the tournament's overhead (exchange +
evaluation) against the cost model's prediction.

Each configuration is planned on the calibrated CPU profile (``calibration/cpu-2core-gloo.json``)
and run ``--repeats`` times, interleaved (T=1, 2, 4, T=1, 2, 4, ...), in float32 with no
validation; medians are reported. On a 2-core machine world 4 oversubscribes the cores: the
figures measure the scheduler as much as the model (see ``reports/README.md``).

    python benchmarks/bench_ltfb.py [--repeats 3] [--rounds 4] [--interval 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256, help="surrogate width (AUTOPAR_SURROGATE_HIDDEN)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default=None, help="folder for the runs and bench.json (default: a temp dir)")
    args = ap.parse_args(argv)
    os.environ["AUTOPAR_SURROGATE_HIDDEN"] = str(args.hidden)
    sys.path.insert(0, str(ROOT))
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.tournament.pricing import TournamentOptions, make_tournament_plan
    from autopar.tournament.run import execute_tournament
    from autopar.tournament.runtime import TournamentRunOptions

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-ltfb-"))
    prof = str(ROOT / "calibration" / "cpu-2core-gloo.json")
    plans = {}
    for T in (1, 2, 4):
        r = make_tournament_plan(ROOT / "strategies/examples/ltfb_surrogate.py",
                                 PlanOptions(world_size=4, batch_size=args.batch, calibration=prof,
                                             out_dir=str(out / f"plan-t{T}"), placement="block"),
                                 TournamentOptions(trainers=T, interval_steps=args.interval,
                                                   train_samples_per_trainer=8 * args.batch,
                                                   tournament_samples=2 * args.batch), PlanHooks())
        plans[T] = r.plan_path
    runs = {T: [] for T in plans}
    for rep in range(args.repeats):
        for T, path in plans.items():
            run, _ = execute_tournament(path, TournamentRunOptions(rounds=args.rounds, dtype="float32", timeout_s=300),
                                        out_dir=out / f"run-t{T}-{rep}", progress=lambda s: None, validate=False)
            runs[T].append(run)
    med = lambda xs: statistics.median([x for x in xs if x is not None]) if any(x is not None for x in xs) else None  # noqa: E731
    rows = []
    for T, rs in runs.items():
        p = rs[0]["predicted"]
        m = {k: med([r["measured"][k] for r in rs]) for k in ("step_s", "exchange_s", "eval_s", "samples_per_s")}
        rows.append({"trainers": T, "ranks_per_trainer": 4 // T, "measured": m,
                     "predicted": {k: p.get(k) for k in ("step_s", "exchange_s", "eval_s", "samples_per_s")},
                     "decompositions": json.loads((plans[T]).read_text())["layers"][0]["choice"]})
    base = rows[0]["measured"]["samples_per_s"]
    f = lambda x, s=1e3: "n/a" if x is None else f"{x * s:.2f}"  # noqa: E731
    print(f"world 4, surrogate hidden {args.hidden}, batch {args.batch} per trainer, {args.rounds} rounds x "
          f"{args.interval} steps, {args.repeats} interleaved repeats (medians)")
    print(f"{'T':>2} {'ranks/T':>7} | {'step ms':>15} | {'exchange ms':>15} | {'eval ms':>15} | "
          f"{'samples/s':>17} | vs T=1")
    print(f"{'':>2} {'':>7} | {'meas':>7} {'pred':>7} | {'meas':>7} {'pred':>7} | {'meas':>7} {'pred':>7} | "
          f"{'meas':>8} {'pred':>8} |")
    for r in rows:
        m, p = r["measured"], r["predicted"]
        print(f"{r['trainers']:>2} {r['ranks_per_trainer']:>7} | {f(m['step_s']):>7} {f(p['step_s']):>7} | "
              f"{f(m['exchange_s']):>7} {f(p['exchange_s']):>7} | {f(m['eval_s']):>7} {f(p['eval_s']):>7} | "
              f"{f(m['samples_per_s'], 1):>8} {f(p['samples_per_s'], 1):>8} | "
              f"{m['samples_per_s'] / base:.2f}x")
    (out / "bench.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"runs and bench.json in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
