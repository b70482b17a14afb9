"""Batch-norm statistics as a plan-wide choice (``autopar.decomp.bn``): local (per group of G
consecutive samples, what torch DDP computes) and global (the whole batch), computed exactly by
every decomposition and their mixes, each validated in float64 against the matching
single-process reference (the model with "ghost" batch norm for local), at world 2 and 4; a
replica that drifts is caught; bad --bn-group values and a batch-norm mismatch are named errors.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import pytest

from autopar.artifacts import PlanHooks, PlanOptions, load_plan
from autopar.decomp.bn import BatchNormStats
from autopar.errors import AutoparError, PlanFileError, ValidationFailed
from autopar.execute.runner import ExecuteOptions, execute
from autopar.planner import make_plan

pytestmark = pytest.mark.dist

FAST = ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, ddp=False, timeout_s=180)

NET = """
import torch
from torch import nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(8)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.b3 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)))
        y = F.relu(self.b3(self.c3(y)))
        return self.fc(y.mean((2, 3)))


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 12, 12),)


def example_targets(batch_size):
    return torch.randint(0, 5, (batch_size,))
"""

# the three conv + batch norm + relu layers (0, 1, 2) pinned; the rest left to the solver
MIXES = {
    2: {
        "sample": ["sample(2)"] * 3,
        "spatial": ["spatial(1,2x1)", "spatial(1,1x2)", "spatial(1,2x1)"],
        "channel-filter": ["filter(1,2)", "channel(1,2)", "filter(1,2)"],
        "replicate": ["replicate"] * 3,
        "mix": ["replicate", "spatial(1,1x2)", "sample(2)"],
        "mix2": ["sample(2)", "filter(1,2)", "spatial(1,2x1)"],
    },
    4: {
        "sample": ["sample(4)"] * 3,
        "sample-replicas": ["sample(2)"] * 3,
        "spatial": ["spatial(1,2x2)", "spatial(1,4x1)", "spatial(1,1x4)"],
        "hybrid": ["spatial(2,2x1)", "spatial(2,1x2)", "spatial(2,2x1)"],
        "channel-filter": ["filter(2,2)", "channel_filter(1,2,2)", "channel(1,4)"],
        "replicate": ["replicate"] * 3,
        "mix": ["sample(4)", "spatial(2,1x2)", "channel_filter(1,2,2)"],
        "mix2": ["replicate", "filter(1,4)", "spatial(1,2x2)"],
    },
}
CASES = [(w, name, mode) for w, mixes in MIXES.items() for name in mixes for mode in ("local", "global")]


@pytest.fixture
def net(tmp_path):
    f = tmp_path / "bnnet.py"
    f.write_text(textwrap.dedent(NET))
    return f


def _plan(model, world, tmp_path, profile, force=None, name="plan", **kw):
    return make_plan(model, PlanOptions(world_size=world, out_dir=tmp_path / name, max_candidates=30, **kw),
                     PlanHooks(profile=profile, force=force))


@pytest.mark.parametrize("world,mix,mode", CASES, ids=[f"w{w}-{m}-{b}" for w, m, b in CASES])
def test_statistics_equal_the_matching_reference(world, mix, mode, net, tmp_path, profile):
    force = dict(enumerate(MIXES[world][mix]))
    r = _plan(net, world, tmp_path, profile, force=force, batch_size=8, batch_norm=mode)
    assert [r.plan.layer(i).choice for i in force] == list(force.values())
    bn = r.plan.bn_stats()
    assert bn.mode == mode and (bn.group == 8 // world if mode == "local" else bn.group is None)
    run, _ = execute(r.plan_path, FAST, out_dir=tmp_path / "run", progress=lambda s: None)
    v = run.validation
    assert v.passed and v.dtype == "float64", [c.tensor for c in v.failures]
    names = {c.tensor for c in v.checks}
    assert {"buffer:b2.running_mean", "buffer:b3.running_var", "buffer:b1.num_batches_tracked",
            "replica:buffer:b2.running_var", "replica:param_after_step:c2.weight", "replica:output"} <= names


def test_local_and_global_are_different_functions(net, tmp_path, profile):
    """A local plan validated against the global reference fails (the choice is not cosmetic)."""
    from autopar.execute import validate
    r = _plan(net, 2, tmp_path, profile, force={0: "sample(2)", 1: "sample(2)", 2: "sample(2)"},
              batch_size=8, batch_norm="local")
    real = validate.ghost_batch_norm
    validate.ghost_batch_norm = lambda group: real(None)     # the global reference instead
    try:
        with pytest.raises(ValidationFailed):
            execute(r.plan_path, FAST, out_dir=tmp_path / "run", progress=lambda s: None)
    finally:
        validate.ghost_batch_norm = real


def test_bn_group_larger_than_a_rank_aggregates_nothing_it_should_not(net, tmp_path, profile):
    """--bn-group 4 at world 4 (batch 8): sample(4) would hold 2 samples, less than a group, so
    it is illegal, named with the layer; the solver plans around it and validates."""
    r = _plan(net, 4, tmp_path, profile, batch_size=8, bn_group=4)
    why = " ".join(r.plan.layer(0).illegal.values()) if isinstance(r.plan.layer(0).illegal, dict) \
        else str(r.plan.layer(0).illegal)
    assert "--bn-group 4 does not divide the 2 samples a rank holds" in why and "c1" in why
    assert r.plan.layer(0).choice != "sample(4)"
    with pytest.raises(AutoparError, match="sample\\(4\\) is not a legal .*--bn-group 4 does not divide"):
        _plan(net, 4, tmp_path, profile, name="forced", batch_size=8, bn_group=4, force={0: "sample(4)"})
    run, _ = execute(r.plan_path, FAST, out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, [c.tensor for c in run.validation.failures]


def test_bn_group_that_does_not_divide_the_batch_is_named_at_plan_time(net, tmp_path, profile):
    with pytest.raises(AutoparError, match=r"batch norm b1 .*--bn-group 3 does not divide the batch of 8"):
        _plan(net, 2, tmp_path, profile, batch_size=8, bn_group=3)
    # no samples-per-rank exists (6 over 4 ranks): the single-process statistics, said so
    lines = []
    r = make_plan(net, PlanOptions(world_size=4, batch_size=6, out_dir=tmp_path / "b6"),
                  PlanHooks(profile=profile, progress=lines.append))
    assert r.plan.bn_stats().mode == "global" and any("does not split evenly" in s for s in lines)
    r = _plan(net, 4, tmp_path, profile, name="b6g3", batch_size=6, bn_group=3)
    assert r.plan.batch_norm == BatchNormStats("local", 3)


def test_plan_and_execute_must_agree_on_the_statistics(net, tmp_path, profile):
    r = _plan(net, 2, tmp_path, profile, batch_size=8, batch_norm="local")
    assert load_plan(r.plan_path).batch_norm == BatchNormStats("local", 4)
    opts = ExecuteOptions(steps=1, warmup=0, ddp=False, batch_norm="global")
    with pytest.raises(PlanFileError, match="planned with --batch-norm local"):
        execute(r.plan_path, opts, out_dir=tmp_path / "run", progress=lambda s: None)


def test_ddp_is_the_same_function_under_local_statistics(net, tmp_path, profile):
    from autopar.execute.baseline import same_function
    from autopar.decomp.bn import BatchNormStats
    assert same_function(True, BatchNormStats("local", 4), 8, 2, False)[0]
    assert not same_function(True, BatchNormStats("local", 2), 8, 2, False)[0]
    eq, note, sync = same_function(True, BatchNormStats("global"), 8, 2, False)
    assert not eq and not sync and note.startswith("not the same function:") and "none exists here" in note
    assert same_function(True, BatchNormStats("global"), 8, 2, True) == (True, same_function(
        True, BatchNormStats("global"), 8, 2, True)[1], True)
    r = _plan(net, 2, tmp_path, profile, batch_size=8)
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=180),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.baseline.equivalent and run.baseline.note.startswith("same function:")


# ---- a replica that drifts is caught ---------------------------------------------------------
from autopar.decomp import REGISTRY  # noqa: E402
from autopar.decomp.replicate import Replicate  # noqa: E402


@dataclass(frozen=True)
class _DriftingReplicate(Replicate):
    """Replicate whose rank 1 corrupts its copy of the batch-norm running mean (rank 0, whose
    copy is the one assembled, stays right): only the replica check can see it."""
    kind = "test_drifting_replicate"

    def run(self, comm, layer, op, inputs, params, buffers):
        out = super().run(comm, layer, op, inputs, params, buffers)
        if op.kind == "batch_norm" and comm.rank == 1:
            for q in buffers:
                if q.endswith("running_mean"):
                    buffers[q].data.add_(1e-3)   # .data: no autograd version bump
        return out


@pytest.fixture
def drifting():
    REGISTRY[_DriftingReplicate.kind] = _DriftingReplicate
    yield
    del REGISTRY[_DriftingReplicate.kind]


@pytest.mark.parametrize("mode", ["local", "global"])
def test_a_drifting_replica_is_caught(mode, net, tmp_path, profile, drifting):
    r = _plan(net, 2, tmp_path, profile, batch_size=8, batch_norm=mode, kinds=["test_drifting_replicate"])
    with pytest.raises(ValidationFailed, match="replica:buffer:b.\\.running_mean"):
        execute(r.plan_path, FAST, out_dir=tmp_path / "run", progress=lambda s: None)


def _deferred_vs_each_step(rank, world, plan_path, steps):
    """``steps`` SGD steps (float64) of the traced program twice: running statistics flushed
    after every step (each step's update applied at once), and flushed once after the last."""
    import torch

    from autopar.artifacts import load_plan
    from autopar.execute.runner import _import_generated
    from autopar.runtime.comm import Comm
    from autopar.runtime.entry import build_user_model, synthetic_batch
    from pathlib import Path

    comm = Comm.from_env()
    plan = load_plan(plan_path)
    gen = _import_generated(Path(plan_path).parent / plan.generated)
    out = {}
    for key in ("each_step", "deferred"):
        mf, model = build_user_model(plan, plan_path, 0)
        model.double()
        dm = gen.PlannedModel(plan, model, comm, native=False)
        dm.train()
        opt = torch.optim.SGD(dm.parameters(), lr=0.1, momentum=0.9)
        start = {q: b.clone() for q, b in dm.bufs.items()}
        unchanged = True
        for step in range(steps):
            xs, ys = synthetic_batch(mf, plan.model.batch_size, step)
            opt.zero_grad(set_to_none=True)
            o = dm(*dm.shard_inputs([x.double() for x in xs]))
            dm.local_loss(o, ys, mf.loss_fn()).backward()
            dm.finish_grads()
            opt.step()
            if key == "each_step":
                dm.flush_batch_norm()
            else:
                unchanged &= all(torch.equal(b, start[q]) for q, b in dm.bufs.items() if "running" in q)
        out[key] = {"pending": dm.bn_runtime.pending, "unchanged": unchanged}
        out[key]["buffers"] = {q: b.detach().numpy().copy() for q, b in dm.full_buffers().items()}
    return out


@pytest.mark.parametrize("world,mix", [(2, "mix2"), (4, "mix2"), (4, "hybrid")])
def test_running_statistics_deferred_over_steps_equal_each_steps_update(world, mix, net, tmp_path, profile):
    """Local statistics: the traced program's running-statistics updates wait for a reader
    (``BatchNormRuntime``: no collective per step); several steps' updates applied by one flush
    equal the updates applied step by step, under channel-sharded and spatial layers too."""
    import numpy as np

    from autopar.runtime.launch import run_ranks
    force = dict(enumerate(MIXES[world][mix]))
    r = _plan(net, world, tmp_path, profile, force=force, batch_size=8, batch_norm="local")
    res = run_ranks(_deferred_vs_each_step, world, args=(str(r.plan_path), 3), timeout_s=180)
    for rank, out in enumerate(res):
        assert out["deferred"]["unchanged"], rank      # nothing applied before a reader
        assert out["deferred"]["pending"] and not out["each_step"]["pending"]
        for q, b in out["each_step"]["buffers"].items():
            d = out["deferred"]["buffers"][q]
            assert np.abs(d - b).max(initial=0.0) <= 1e-12 * np.abs(b).max(initial=1.0), (rank, q)
        assert any("running_var" in q for q in out["deferred"]["buffers"])
