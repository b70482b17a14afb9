"""A new decomposition is one file plus one import line (``tests/toys/toy_decomp.py``): a
linear layer split over input features that leaves a partial sum, which the planner carries
across the edge and the next layer resolves (all-reduce or reduce-scatter), executed equal to
one process."""

import textwrap
from pathlib import Path

import pytest

from autopar.decomp.base import REGISTRY

MLP = (Path(__file__).parent / "toys" / "mlp.py").read_text()


@pytest.fixture
def toy():
    assert "toy_in_features" not in REGISTRY
    import toys.toy_decomp  # noqa: F401  (the one import line: registers the decomposition)
    yield REGISTRY["toy_in_features"]
    REGISTRY.pop("toy_in_features")          # keep other tests' plan spaces unchanged
    import sys
    sys.modules.pop("toys.toy_decomp", None)


def _plan(tmp_path, profile, world):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    model = tmp_path / "mlp.py"
    model.write_text(textwrap.dedent(MLP))
    return make_plan(model, PlanOptions(world_size=world, batch_size=4, out_dir=tmp_path / f"plan{world}"),
                     PlanHooks(profile=profile, force={1: "toy_in_features"}))


def test_toy_is_planned_with_a_partial_sum_across_the_edge(toy, tmp_path, profile):
    from autopar.decomp.sharding import Partial, Shard, Sharding
    r = _plan(tmp_path, profile, 2)
    lay = r.plan.layer(1)
    assert lay.decomposition().kind == "toy_in_features"
    assert lay.out_placement == Sharding.of((Partial(), 2))
    # the edge out of the partial sum is priced by the redistribution steps that resolve it
    t = [t for t in r.plan.transitions if t.src == 1]
    assert t and t[0].fwd_s > 0 and "Partial(sum)" in t[0].src_placement


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_toy_executes_equal_to_one_process(toy, world, tmp_path, profile):
    from autopar.execute.runner import ExecuteOptions, execute
    r = _plan(tmp_path, profile, world)
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=180,
                                                 ddp=False),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures
    assert any(c.tensor == "grad:fc2.weight" for c in run.validation.checks)
