"""Megatron-style tensor parallelism of a Transformer MLP: the first linear column-parallel
(``filter``: weight split by output features, output ``Shard(-1)``), the second row-parallel
(``row_parallel``: weight split by input features, output ``Partial``), one reduce-scatter or
all-reduce where the partial sum is resolved; equal to one process (float64)."""

import pytest

from autopar.modelfile import load_model_file
from autopar.trace.tracer import trace_model


def _indices(root):
    from autopar.planner import attention_units   # the graph the planner plans: attention blocks are units
    g = attention_units(trace_model(load_model_file(root / "strategies/examples/gpt.py"), 4))
    idx = {lay.module: lay.index for lay in g.layers}
    return idx["blocks.0.fc"], idx["blocks.0.out"]


def _plan(root, tmp_path, profile, world, row):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    fc, out = _indices(root)
    col = "filter" if world == 2 else "filter(2,2)"
    return make_plan(root / "strategies/examples/gpt.py",
                     PlanOptions(world_size=world, batch_size=4, out_dir=str(tmp_path / f"w{world}")),
                     PlanHooks(profile=profile, force={fc: col, out: row}))


def test_row_parallel_leaves_a_partial_sum_resolved_on_the_edge(root, tmp_path, profile):
    from autopar.decomp.sharding import Partial, Shard, Sharding
    r = _plan(root, tmp_path, profile, 2, "row_parallel")
    fc, out = _indices(root)
    assert r.plan.layer(out).out_placement == Sharding.of((Shard(0), 1), (Partial(), 2))
    # column -> row is a free edge: the filter output is exactly the row-parallel input
    assert not [t for t in r.plan.transitions if t.src == fc and t.dst == out]
    resolve = [t for t in r.plan.transitions if t.src == out]
    assert resolve and any(k in resolve[0].extra["steps"] for k in ("ReduceScatter", "AllReduce"))
    assert resolve[0].fwd_s > 0


@pytest.mark.dist
@pytest.mark.parametrize("world,row", [(2, "row_parallel"), (4, "row_parallel(2,2)")])
def test_megatron_mlp_executes_equal_to_one_process(root, tmp_path, profile, world, row):
    from autopar.execute.runner import ExecuteOptions, execute
    r = _plan(root, tmp_path, profile, world, row)
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=240,
                                                 ddp=False), out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures
    names = {c.tensor for c in run.validation.checks}
    assert {"grad:blocks.0.fc.weight", "grad:blocks.0.out.weight", "grad:blocks.0.out.bias"} <= names
