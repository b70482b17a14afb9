"""The strategies seam at both levels (``autopar.planner.strategies``): padding buckets and the
tournament are registered job-level strategies whose alternatives go through the one chooser and
are listed priced in plan.json; when no candidate is legal the error names every strategy with
its reason; ``autopar execute`` runs a plan by the run kind its strategy recorded."""

from __future__ import annotations

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from autopar.artifacts import PlanHooks, PlanOptions, load_plan
from autopar.errors import InfeasiblePlan
from autopar.planner.strategies import (STRATEGIES, Candidate, LevelPrediction, choose, level_of, none_fits,
                                        offer_all)

ROOT = Path(__file__).resolve().parents[1]
MLP = (Path(__file__).parent / "toys" / "mlp.py").read_text()


def test_registry_holds_both_levels_and_the_plan_level_offer_skips_job_strategies(monkeypatch):
    import autopar.planner.strategies.registry as seam   # where offer_all reads STRATEGIES
    levels = {n: level_of(s) for n, s in STRATEGIES.items()}
    assert {n for n, lv in levels.items() if lv == "plan"} >= {"op_by_op", "native", "graphs", "sharded", "stages"}
    assert {n for n, lv in levels.items() if lv == "job"} == {"padding_buckets", "trainers"}
    # a job-level strategy is never asked for candidates of one solved table (offered None, it would raise)
    fake = SimpleNamespace(name="fake", priority=0, offer=lambda base: (Candidate("fake", "f"),))
    monkeypatch.setattr(seam, "STRATEGIES", {"fake": fake, "padding_buckets": STRATEGIES["padding_buckets"],
                                             "trainers": STRATEGIES["trainers"]})
    assert [c.strategy for c in offer_all(None)] == ["fake"]


def _lvl(cost_s, mem, per="x"):
    return LevelPrediction(cost_s, per, cost_s, mem)


def test_one_rule_for_level_candidates_memory_then_cost_then_priority():
    a = Candidate("trainers", "T=1", _lvl(2.0, 10.0), priority=1)
    b = Candidate("trainers", "T=2", _lvl(1.0, 30.0), priority=2)
    c = Candidate("trainers", "T=4", _lvl(1.0, 20.0), priority=4)
    assert choose([a, b, c], None).chosen is b                     # cheapest, tie to lower priority
    ch = choose([a, b, c], 25.0)                                   # b over the limit: c
    assert ch.chosen is c and "over the memory limit" in next(x for x in ch.candidates if x.label == "T=2").illegal
    none = choose([b, c], 5.0)
    assert none.chosen is None
    e = none_fits(none.candidates, "nothing fits", "raise it", level="job")
    assert isinstance(e, InfeasiblePlan) and "nothing fits" in str(e) and "raise it" in str(e)
    tr = next(line for line in e.strategies if line.startswith("trainers"))
    assert "T=2: 30.00 B" not in tr and "smallest memory reached 0.00 MiB" in tr and "T=4:" in tr
    assert any(line.startswith("padding_buckets: offered no candidate") for line in e.strategies)
    # plan.json's record of a level candidate says what its cost is per
    j = c.to_json(True)
    assert j["level"] == "job" and j["cost_s"] == 1.0 and j["per"] == "x" and j["chosen"] is True


def test_infeasible_plan_names_every_strategy_with_its_reason(tmp_path, profile):
    from autopar.planner import make_plan
    model = tmp_path / "mlp.py"
    model.write_text(textwrap.dedent(MLP))
    with pytest.raises(InfeasiblePlan) as ei:
        make_plan(model, PlanOptions(world_size=2, batch_size=8, write=False, memory_limit_bytes=1024.0),
                  PlanHooks(profile=profile))
    e = ei.value
    msg = str(e)
    assert msg.startswith("no plan fits 0.0 MiB per rank: the smallest possible is")   # the solver's words first
    by = {line.split(" ")[0].rstrip(":"): line for line in e.strategies}
    assert set(by) == {n for n, s in STRATEGIES.items() if level_of(s) == "plan"}
    assert "no per-layer plan fits (the solver's words above)" in by["op_by_op"]
    assert "over the memory limit 0.00 MiB" in by["native"] and "smallest memory reached" in by["native"]
    assert "over the memory limit" in by["sharded"] or "one rank" in by["sharded"]
    assert by["stages"] == "stages: offered no candidate for this request"
    for line in e.strategies:
        assert line in msg


def test_tournament_candidates_are_priced_in_plan_json_and_chosen_by_samples_per_second(root, tmp_path, profile):
    from autopar.planner import make_tournament_plan
    from autopar.tournament.pricing import TournamentOptions
    res = make_tournament_plan(root / "strategies/examples/ltfb_surrogate.py",
                               PlanOptions(world_size=4, out_dir=str(tmp_path / "t")),
                               TournamentOptions(trainers="auto", interval_steps=2), PlanHooks(profile=profile))
    plan = load_plan(res.plan_path)
    alts = [a for a in plan.strategies if a.strategy == "trainers"]
    assert [a.label.split(" ")[0] for a in alts] == ["1", "2", "4"]
    rows = {r["trainers"]: r for r in res.rows}
    for a in alts:
        T = int(a.label.split(" ")[0])
        assert a.extra["cost_s"] == pytest.approx(1.0 / rows[T]["samples_per_s"], rel=1e-12)
        assert a.memory_per_rank_bytes == pytest.approx(rows[T]["memory_per_rank_bytes"], rel=1e-12)
    chosen = [a for a in alts if a.chosen]
    assert len(chosen) == 1 and int(chosen[0].label.split(" ")[0]) == res.chosen == plan.trainers.trainers
    assert res.chosen == max(rows, key=lambda t: (rows[t]["samples_per_s"], -t))
    # the trainer plan's own plan-level alternatives follow the job-level ones
    assert any(a.strategy == "op_by_op" for a in plan.strategies)
    # a limit between the trainer counts' memories: the chooser's rule drops the larger ones
    mems = sorted(r["memory_per_rank_bytes"] for r in res.rows)
    if mems[0] < mems[-1]:
        lim = (mems[0] + mems[-1]) / 2
        r2 = make_tournament_plan(root / "strategies/examples/ltfb_surrogate.py",
                                  PlanOptions(world_size=4, write=False, memory_limit_bytes=lim),
                                  TournamentOptions(trainers="auto", interval_steps=2), PlanHooks(profile=profile))
        fits = {r["trainers"]: r["fits_memory"] for r in r2.rows if not r.get("error")}
        assert fits[r2.chosen] and not all(fits.values())


def test_padding_policies_are_priced_in_plan_json_and_chosen_by_training_seconds(tmp_path):
    from autopar.planner import PaddingOptions, make_padded_plan
    sizes = tmp_path / "sizes.csv"
    sizes.write_text("nodes,edges,count\n6,10,900\n51,118,100\n")
    res, d = make_padded_plan(ROOT / "strategies/examples/gnn_pcqm4m.py",
                              PlanOptions(world_size=2, batch_size=8, calibration=str(ROOT / "calibration/cpu-2core-gloo.json"),
                                          out_dir=str(tmp_path / "plan"), placement="block"),
                              PaddingOptions(str(sizes), sampling="grouped", steps=100_000))
    plan = load_plan(res.plan_path)
    alts = [a for a in plan.strategies if a.strategy == "padding_buckets"]
    assert len(alts) == len(d.candidates) >= 2
    for a, c in zip(alts, d.candidates):
        assert a.extra["cost_s"] == pytest.approx(c.total_s, rel=1e-12) and a.extra["level"] == "job"
        assert a.step_time_s == pytest.approx(c.expected_step_time_s, rel=1e-12)
        assert a.chosen == (c is d.chosen)
    assert d.chosen.total_s == min(c.total_s for c in d.candidates)
    # the small bucket's plan lists the same alternatives
    small = load_plan(res.plan_path.parent / plan.padding.buckets[0]["plan"])
    assert [a.to_json() for a in small.strategies if a.strategy == "padding_buckets"] == [a.to_json() for a in alts]


def test_execute_runs_a_plan_by_the_run_kind_its_strategy_recorded():
    from autopar.execute import runner
    def plan(expected=None, trainers=None):
        return SimpleNamespace(trainers=trainers, runtime=None if expected is None else SimpleNamespace(expected=expected))
    assert runner.run_kind(plan(trainers=object(), expected="native")) == "tournament"
    assert runner.run_kind(plan()) == "traced"
    for kind, fn in (("tournament", runner._execute_tournament), ("stages", runner._execute_stages),
                     ("fsdp", runner._execute_sharded), ("fsdp+traced", runner._execute_sharded)):
        assert runner.EXECUTORS[runner.run_kind(plan(kind) if kind != "tournament" else plan(trainers=1))] is fn
    for kind in ("native", "traced"):
        assert runner.EXECUTORS.get(runner.run_kind(plan(kind)), runner._execute_mesh) is runner._execute_mesh
    assert runner.RANK_MAINS == {"fsdp": runner._fsdp_rank_main}
