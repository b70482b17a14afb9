"""Tournament training (LTFB): the trainer level in plan.json, its pricing and choice of T,
and runs of T trainers on sub-meshes: equal to the single-process simulation (float64, every
trainer's final parameters and every round's winner), a killed trainer leaving the others to
finish with a named report (and validated against a simulation of the survivors), a non-finite
metric reported, never fatal. Batch norm, the reference's own rules and the exchange's bytes:
``test_tournament_bn.py``, ``test_tournament_tables.py``."""

from __future__ import annotations

import json
import math
import tempfile
import time

import pytest

from autopar.artifacts import PlanHooks, PlanOptions, TrainerLevel, load_plan
from autopar.errors import PlanFileError
from autopar.planner import make_tournament_plan
from autopar.tournament.pricing import TournamentOptions, TrainersError
from autopar.tournament.runtime import decide, pairing


# ---- pure logic -------------------------------------------------------------------------------

def test_pairing_is_seeded_identical_and_an_odd_trainer_plays_itself():
    for alive in ([0, 1, 2, 3], [0, 2, 3], [5], [1, 4, 6, 7, 9]):
        p = pairing(alive, seed=3, round_=2)
        assert p == pairing(list(reversed(alive)), seed=3, round_=2)      # order-free, no communication
        assert sorted(p) == sorted(alive) and all(p[p[t]] == t for t in alive)
        assert sum(p[t] == t for t in alive) == len(alive) % 2
    rounds = {tuple(sorted(pairing(range(8), 0, k).items())) for k in range(10)}
    assert len(rounds) > 1                                               # rounds differ


def test_decide_lower_wins_and_a_non_finite_metric_loses():
    assert decide(1.0, 0.5) == (True, "")
    assert decide(0.5, 1.0)[0] is False and decide(1.0, 1.0)[0] is False   # ties keep the own model
    assert decide(math.nan, 0.5)[0] is True and "non-finite" in decide(math.nan, 0.5)[1]
    assert decide(0.5, math.inf)[0] is False and "non-finite" in decide(0.5, math.inf)[1]
    assert decide(math.nan, math.nan)[0] is False
    assert decide(1.0, None) == (False, "no partner")


def _plan(root, tmp_path, profile, model="ltfb_surrogate", world=4, trainers=2, **kw):
    hooks = PlanHooks(profile=profile, force=kw.pop("force", None))
    return make_tournament_plan(root / f"strategies/examples/{model}.py",
                                PlanOptions(world_size=world, out_dir=str(tmp_path / f"plan-{model}-{trainers}"),
                                            memory_limit_bytes=kw.pop("memory_limit_bytes", None)),
                                TournamentOptions(trainers=trainers, interval_steps=2, **kw), hooks)


def test_trainer_level_round_trips_and_is_checked_on_load(root, tmp_path, profile):
    res = _plan(root, tmp_path, profile)
    plan = load_plan(res.plan_path)
    tl = plan.trainers
    assert isinstance(tl, TrainerLevel) and (tl.trainers, tl.ranks_per_trainer, tl.interval_steps) == (2, 2, 2)
    assert tl.exchange == "weights" and tl.metric == "loss" and tl.trainer_ranks(1) == (2, 3)
    for key in ("step_s", "exchange_s", "eval_s", "ingest_s", "samples_per_s"):
        assert getattr(tl.predicted, key) is not None
    obj = json.loads(res.plan_path.read_text())
    for field, bad in (("ranks_per_trainer", 4), ("exchange", "gradients"), ("interval_steps", 0),
                       ("tournament_samples", 3)):
        o = json.loads(json.dumps(obj))
        o["trainers"][field] = bad
        p = tmp_path / f"bad-{field}.json"
        p.write_text(json.dumps(o))
        with pytest.raises(PlanFileError, match=f"trainers.{field}"):
            load_plan(p)


def test_trainers_that_do_not_divide_the_world_is_a_named_error(root, tmp_path, profile):
    with pytest.raises(TrainersError, match="does not divide the world size 4") as e:
        _plan(root, tmp_path, profile, trainers=3)
    assert "[1, 2, 4]" in e.value.hint


def test_trainers_too_small_for_memory_name_the_feasible_counts(root, tmp_path, profile):
    rows = _plan(root, tmp_path, profile, trainers="auto").rows
    mem = {r["trainers"]: r["memory_per_rank_bytes"] for r in rows}
    assert mem[4] > mem[2]        # one rank per trainer holds the whole model and the partner's
    limit = (mem[2] + mem[4]) / 2
    with pytest.raises(TrainersError, match="too small") as e:
        _plan(root, tmp_path, profile, trainers=4, memory_limit_bytes=limit)
    assert "smallest feasible T: 1" in e.value.hint and "--trainers 2" in e.value.hint


def test_auto_prices_every_divisor_and_keeps_the_fastest(root, tmp_path, profile):
    res = _plan(root, tmp_path, profile, trainers="auto")
    assert [r["trainers"] for r in res.rows] == [1, 2, 4]
    best = max(res.rows, key=lambda r: r["samples_per_s"])
    assert res.chosen == best["trainers"] == res.plan.trainers.trainers
    assert len(res.plan.trainers.candidates) == 3


def test_ingestion_switches_to_storage_when_the_shard_does_not_fit(root, tmp_path, profile):
    """The seed's configuration: trainers of a fixed size n, T of them sharing one data set.
    A trainer's shard is dataset / T, held over its n ranks: one trainer cannot hold it and
    reads from storage at the read rate; with enough trainers each shard fits in memory, so
    samples per second grow faster than T (the paper's super-linear efficiency)."""
    from autopar.tournament.pricing import IngestionModel, price_trainers
    res = _plan(root, tmp_path, profile, trainers=1)
    topts = TournamentOptions(trainers=1, interval_steps=10, dataset_samples=10_000_000,
                              data_store_bytes_per_rank=0.5e9,
                              ingestion=IngestionModel(node_read_bytes_per_s=1e6, aggregate_bytes_per_s=1e9))
    rows = {T: price_trainers(res.plan, T, profile, topts, 4, None, 336.0) for T in (1, 2, 4)}
    assert not rows[1]["data_in_memory"] and rows[1]["ingest_s"] > rows[1]["step_s"]
    assert rows[4]["data_in_memory"] and rows[4]["ingest_s"] == 0
    assert rows[4]["samples_per_s"] > 4 * rows[1]["samples_per_s"]


# ---- runs (gloo, real processes) ----------------------------------------------------------------

pytestmark_dist = pytest.mark.dist


def _run(plan_path, tmp_path, name, **kw):
    from autopar.tournament.run import execute_tournament
    from autopar.tournament.runtime import TournamentRunOptions
    opts = TournamentRunOptions(rounds=kw.pop("rounds", 3), timeout_s=kw.pop("timeout_s", 120), **kw)
    # the trainers' board lives in a temporary directory: removed after the run, killed trainers
    # and time-outs included
    tmp = tmp_path / f"{name}-tmp"
    tmp.mkdir()
    before, tempfile.tempdir = tempfile.tempdir, str(tmp)
    try:
        result = execute_tournament(plan_path, opts, out_dir=tmp_path / name, progress=lambda s: None)
    finally:
        tempfile.tempdir = before
    assert list(tmp.iterdir()) == [], f"left behind: {list(tmp.iterdir())}"
    return result


@pytest.mark.dist
def test_two_trainers_of_two_ranks_equal_the_single_process_simulation(root, tmp_path, profile):
    """T = 2 at world 4, two ranks per trainer, filter / channel / filter parallel layers: after K = 3
    rounds every trainer's parameters equal the simulation's (float64) and so does every winner."""
    res = _plan(root, tmp_path, profile, force={0: "filter", 1: "channel", 2: "filter"})
    kinds = {c.split("(")[0] for c in res.plan.decompositions()}
    assert {"filter", "channel"} <= kinds, kinds
    run, out = _run(res.plan_path, tmp_path, "t2")
    v = run["validation"]
    assert v["passed"] and v["winners_equal"] and v["checked"] == 2 * 6, v
    assert v["max_rel_diff"] <= 1e-9
    assert len(run["rounds_log"]) == 3 and all(lg["pairs"] == [[0, 1]] for lg in run["rounds_log"])
    assert run["stopped"] == [] and (out / "report.md").is_file() and (out / "metric.png").is_file()
    m = run["measured"]
    assert m["exchange_s"] > 0 and m["eval_s"] > 0 and m["samples_per_s"] > 0


@pytest.mark.dist
def test_four_trainers_of_one_rank_gan_equal_the_simulation(root, tmp_path, profile):
    """T = 4 at world 4 on the GAN (generator and discriminator exchanged together, the model
    file's metric), exchanging the optimizer state too."""
    res = _plan(root, tmp_path, profile, model="ltfb_gan", trainers=4, exchange="weights+optimizer")
    assert res.plan.trainers.metric == "model_file"
    run, _ = _run(res.plan_path, tmp_path, "t4")
    assert run["validation"]["passed"], run["validation"]
    assert run["validation"]["checked"] == 4 * 8


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_a_killed_trainer_leaves_the_others_finishing_with_a_named_report(root, tmp_path, profile, mode):
    res = _plan(root, tmp_path, profile, trainers=4)
    t0 = time.monotonic()
    run, out = _run(res.plan_path, tmp_path, f"kill-{mode}", kill=(1, 1), kill_mode=mode, timeout_s=60)
    assert time.monotonic() - t0 < 60
    assert run["stopped"] == [1]
    tr = {d["trainer"]: d for d in run["trainers_detail"]}
    assert [tr[t]["status"] for t in (0, 2, 3)] == ["finished"] * 3
    s = tr[1]["stopped"]
    assert s["round"] == 1 and s["step"] == 2
    assert ("fault injected" in s["reason"]) if mode == "raise" else ("exit code 9" in s["reason"])
    later = [lg for lg in run["rounds_log"] if lg["round"] >= 1]
    assert later and all(1 not in lg["alive"] and len(lg["results"]) == 3 for lg in later)
    v = run["validation"]       # the survivors against a simulation of the surviving set
    assert v["passed"] and v["survivors"] == [0, 2, 3] and v["alive_equal"] and v["checked"] == 3 * 6, v
    assert "trainer 1 (ranks [1]): stopped at round 1" in (out / "report.md").read_text()


@pytest.mark.dist
def test_a_trainer_of_two_ranks_losing_one_stops_whole_and_the_other_finishes(root, tmp_path, profile):
    """T = 2 x 2 ranks: trainer 1's mesh rank 0 dies; its rank 1 (waiting on it) is stopped by
    the launcher, and trainer 0 plays itself from then on."""
    res = _plan(root, tmp_path, profile, force={2: "filter"})
    run, _ = _run(res.plan_path, tmp_path, "kill2", kill=(1, 1), timeout_s=60)
    assert run["stopped"] == [1]
    assert all(lg["pairs"] == [[0, 0]] for lg in run["rounds_log"] if lg["round"] >= 1)
    assert run["trainers_detail"][0]["status"] == "finished"


@pytest.mark.dist
def test_a_non_finite_metric_is_reported_and_never_fatal(root, tmp_path, profile):
    from autopar.artifacts import PlanOptions
    res = make_tournament_plan(root / "tests/toys/ltfb_nan_metric.py",
                               PlanOptions(world_size=2, out_dir=str(tmp_path / "nanplan")),
                               TournamentOptions(trainers=2, interval_steps=1), PlanHooks(profile=profile))
    run, _ = _run(res.plan_path, tmp_path, "nan", rounds=2)
    assert run["validation"]["passed"]
    for lg in run["rounds_log"]:
        for x in lg["results"]:
            assert x["kept"] == "own" and any("nan" in n for n in x["notes"])


def test_cli_names_a_bad_trainer_count(root, tmp_path, capsys):
    from autopar.cli import main
    rc = main(["plan", str(root / "strategies/examples/ltfb_surrogate.py"), "--world-size", "4",
               "--trainers", "3", "-o", str(tmp_path / "x")])
    assert rc == 2 and "TrainersError" in capsys.readouterr().err


def test_tournament_halves_keep_the_data_flow_imports(root, tmp_path, profile):
    """Planning a tournament loads no runtime module; the run-time half loads no solver,
    tracer, cost model, calibration or planner."""
    import json as _json
    import os
    import subprocess
    import sys
    code_plan = (
        "import json, sys\n"
        "sys.path.insert(0, 'tests')\n"
        "from fakes import synthetic_profile\n"
        "from autopar.artifacts import PlanHooks, PlanOptions\n"
        "from autopar.planner import make_tournament_plan\n"
        "from autopar.tournament.pricing import TournamentOptions\n"
        "make_tournament_plan('strategies/examples/ltfb_surrogate.py', PlanOptions(world_size=4, write=False), "
        "TournamentOptions(trainers='auto'), PlanHooks(profile=synthetic_profile()))\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('autopar.runtime'))))\n")
    code_run = (
        "import json, sys\n"
        "import autopar.tournament.runtime, autopar.tournament.launch, autopar.runtime.model\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('autopar.cost', 'autopar.solve', "
        "'autopar.trace', 'autopar.calibrate', 'autopar.planner', 'autopar.codegen', 'autopar.tournament.pricing', "
        "'pulp', 'highspy')))))\n")
    for code in (code_plan, code_run):
        out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(root), "PYTHONWARNINGS": "ignore"})
        assert out.returncode == 0, out.stderr[-2000:]
        assert _json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.dist
def test_cli_execute_runs_a_tournament_plan_and_reports_a_killed_trainer(root, tmp_path, profile):
    """``autopar execute PLAN`` of a plan with a trainer level dispatches to the tournament
    runner (a subprocess, as a user runs it); ``--kill-trainer`` drills a fault."""
    import os
    import subprocess
    import sys
    res = _plan(root, tmp_path, profile, trainers=4)
    out = tmp_path / "cli-run"
    p = subprocess.run([sys.executable, "-m", "autopar.cli", "execute", str(res.plan_path), "--rounds", "2",
                        "--kill-trainer", "2:1", "--timeout", "60", "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert "trainer 2 STOPPED at round 1 (step 2)" in p.stdout
    run = json.loads((out / "run.json").read_text())
    assert run["schema"] == "autopar.tournament-run/1" and run["stopped"] == [2]
    chk = subprocess.run([sys.executable, "-m", "autopar.cli", "check", str(out / "run.json")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert chk.returncode == 0 and "stopped: [2]" in chk.stdout


@pytest.mark.dist
def test_a_hung_trainer_is_stopped_at_the_time_out_and_the_others_finish(root, tmp_path, profile):
    """Trainer 3 hangs (sleeps) at round 1: the launcher's progress watchdog stops it once it
    has posted nothing for the time-out, its death marker lets the others' round go on, and
    they finish; the run names it as hung."""
    res = _plan(root, tmp_path, profile, trainers=4)
    t0 = time.monotonic()
    # 20 s: with 10 s a loaded 2-core machine once let a healthy trainer post nothing that long
    run, _ = _run(res.plan_path, tmp_path, "hang", kill=(3, 1), kill_mode="hang", timeout_s=20)
    assert time.monotonic() - t0 < 60
    assert run["stopped"] == [3]
    s = run["trainers_detail"][3]["stopped"]
    assert "hung" in s["reason"] and s["round"] == 1
    assert [d["status"] for d in run["trainers_detail"][:3]] == ["finished"] * 3
