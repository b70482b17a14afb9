"""Tensors made inside ``forward`` from constants (position ids from ``torch.arange``) are
ordinary ops with no activation input: traced, computed whole on every rank (``replicate``
only), sliced locally for their consumers; a hand-written GPT plans and executes equal to one
process."""

import pytest

from autopar.modelfile import load_model_file
from autopar.trace.tracer import trace_model


def test_arange_is_a_constant_op_only_replicate_takes(root, profile):
    from autopar.cost.table import build_cost_table
    from autopar.decomp.base import CostContext
    mf = load_model_file(root / "strategies/examples/gpt.py")
    graph = trace_model(mf, 4)
    const = [lay for lay in graph.layers if any(op.attrs.get("constant") for op in lay.ops)]
    assert const and any(op.target.startswith("aten.arange") for lay in const for op in lay.ops)
    assert all(not lay.inputs for lay in const)
    assert not graph.unregistered or "aten.arange" not in " ".join(graph.unregistered)
    table = build_cost_table(graph, CostContext(profile=profile, world=2, ranks_per_node=2, batch_size=4))
    for lay in const:
        kinds = {d.kind for d in table.layers[lay.index].choices}
        assert kinds == {"replicate"}, kinds
        assert table.layers[lay.index].illegal      # the others say why they cannot take it


@pytest.mark.dist
def test_gpt_plans_and_executes_equal_to_one_process(root, tmp_path, profile):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan
    r = make_plan(root / "strategies/examples/gpt.py",
                  PlanOptions(world_size=2, batch_size=4, out_dir=str(tmp_path / "plan")),
                  PlanHooks(profile=profile))
    assert "sample" in {lay.kind for lay in r.plan.layers}
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=180,
                                                 ddp=False), out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures
    assert any(c.tensor == "grad:pos.weight" for c in run.validation.checks)
