"""A new plan-level strategy is one file plus one import line (``tests/toys/toy_strategy.py``):
the chooser takes it when it is predicted cheaper (memory permitting), plan.json lists it among
every alternative priced, and the chosen plan executes equal to one process."""

import textwrap
from pathlib import Path

import pytest

from autopar.planner.strategies import STRATEGIES

MLP = (Path(__file__).parent / "toys" / "mlp.py").read_text()


@pytest.fixture
def toy():
    assert "toy_all_sample" not in STRATEGIES
    import toys.toy_strategy  # noqa: F401  (the one import line: registers the strategy)
    yield STRATEGIES["toy_all_sample"]
    STRATEGIES.pop("toy_all_sample")          # keep other tests' plans unchanged
    import sys
    sys.modules.pop("toys.toy_strategy", None)


def _plan(tmp_path, profile, world, **kw):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    model = tmp_path / "mlp.py"
    model.write_text(textwrap.dedent(MLP))
    return make_plan(model, PlanOptions(world_size=world, batch_size=8, out_dir=str(tmp_path / f"plan{world}"), **kw),
                     PlanHooks(profile=profile))


def _alts(plan):
    return {a.strategy: a for a in plan.strategies}


def test_toy_is_chosen_when_cheaper_and_listed_when_not(toy, tmp_path, profile, monkeypatch):
    from autopar.artifacts import load_plan
    monkeypatch.setattr(toy, "scale", 0.5)
    r = _plan(tmp_path, profile, 2)
    alts = _alts(r.plan)
    assert alts["toy_all_sample"].chosen and not alts["op_by_op"].chosen and not alts["native"].chosen
    others = [a.step_time_s for s, a in alts.items() if s != "toy_all_sample" and a.illegal is None]
    assert r.plan.predicted.step_time_s == pytest.approx(alts["toy_all_sample"].step_time_s, rel=1e-12)
    assert r.plan.predicted.step_time_s < min(others)
    assert all(d.choice == "sample(2)" for d in r.plan.layers)
    assert r.plan.runtime.reason == "plan-level strategy toy all-sample chosen"
    assert any("toy strategy chosen" in n for n in r.plan.solver.notes)
    # plan.json keeps every alternative with its prediction, and reads back
    back = _alts(load_plan(r.plan_path))
    assert back["toy_all_sample"].chosen and back["op_by_op"].step_time_s == alts["op_by_op"].step_time_s
    # predicted dearer: listed, priced, not chosen
    monkeypatch.setattr(toy, "scale", 10.0)
    r2 = _plan(tmp_path, profile, 2)
    a2 = _alts(r2.plan)
    assert not a2["toy_all_sample"].chosen and a2["toy_all_sample"].step_time_s > r2.plan.predicted.step_time_s


def test_toy_over_the_memory_limit_is_illegal_by_the_one_rule(toy, tmp_path, profile, monkeypatch):
    monkeypatch.setattr(toy, "scale", 0.5)
    free = _plan(tmp_path, profile, 2)
    mem = _alts(free.plan)["toy_all_sample"].memory_per_rank_bytes
    # a limit the toy's plan does not meet but the solver's (whatever it is) must: the chooser
    # refuses the toy by its memory, not by its time
    r = _plan(tmp_path, profile, 2, memory_limit_bytes=mem * 0.999, kinds=("sample", "replicate", "channel",
                                                                            "filter"))
    toy_alt = _alts(r.plan)["toy_all_sample"]
    assert not toy_alt.chosen and "over the memory limit" in toy_alt.illegal


@pytest.mark.dist
def test_toy_chosen_plan_executes_equal_to_one_process(toy, tmp_path, profile, monkeypatch):
    from autopar.execute.runner import ExecuteOptions, execute
    monkeypatch.setattr(toy, "scale", 0.5)
    r = _plan(tmp_path, profile, 2)
    assert _alts(r.plan)["toy_all_sample"].chosen
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=180, ddp=False),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures
    assert any(c.tensor == "grad:fc2.weight" for c in run.validation.checks)
