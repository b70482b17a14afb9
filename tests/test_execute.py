"""`autopar execute`: validated runs at world 2 and 4 (including a CNN file autopar has never
seen), a wrong decomposition caught with the tensor named, and dead or hung ranks reported."""

import json
import textwrap
from dataclasses import dataclass

import pytest

from autopar.errors import RankFailure, ValidationFailed
from autopar.execute.runner import ExecuteOptions, execute
from autopar.artifacts import PlanHooks, PlanOptions, load_run
from autopar.planner import make_plan

pytestmark = pytest.mark.dist

QUICK = ExecuteOptions(steps=2, warmup=1, timeout_s=180)


def _plan(model, world, tmp_path, profile, out_dir=None, **kw):
    return make_plan(model, PlanOptions(world_size=world, out_dir=out_dir or tmp_path / f"plan-w{world}", **kw),
                     PlanHooks(profile=profile))


@pytest.mark.parametrize("world", [2, 4])
def test_resnet2d_validates(world, tmp_path, root, profile):
    r = _plan(root / "strategies/examples/resnet2d.py", world, tmp_path, profile, batch_size=8)
    run, out = execute(r.plan_path, QUICK, out_dir=tmp_path / "run", progress=lambda s: None)
    v = run.validation
    assert v.passed, v.failures
    names = {c.tensor for c in v.checks}
    assert {"output", "loss", "input_grad:x", "grad:stem.0.weight", "param_after_step:head.bias",
            "buffer:layer1.0.bn1.running_var"} <= names
    assert run.measured.step_time_s > 0 and run.baseline.ddp_step_time_s > 0
    assert run.predicted.step_time_s == r.plan.predicted.step_time_s
    assert load_run(out) == run      # run.json round-trips to the typed run
    saved = json.loads((out / "run.json").read_text())
    assert saved["schema"] == "autopar.run/1" and saved["validation"]["passed"] and (out / "report.md").is_file()
    assert (out / "per_layer.png").is_file() and (out / "plan_vs_ddp.png").is_file()


UNSEEN = """
import torch
from torch import nn
import torch.nn.functional as F

class Res(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.n = nn.BatchNorm2d(c)
        self.b = nn.Conv2d(c, c, 3, padding=1, bias=False)
    def forward(self, x):
        return F.gelu(x + self.b(F.relu(self.n(self.a(x)))))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Conv2d(2, 6, 5, padding=2, stride=2)
        self.blocks = nn.Sequential(Res(6), nn.AvgPool2d(2), Res(6))
        self.fc1 = nn.Linear(6 * 4 * 4, 12)
        self.fc2 = nn.Linear(12, 3)
    def forward(self, x):
        y = self.blocks(torch.tanh(self.inp(x)))
        return self.fc2(torch.sigmoid(self.fc1(y.reshape(y.shape[0], -1))))

def build_model():
    return Net()

def example_inputs(batch_size):
    return (torch.randn(batch_size, 2, 16, 16),)
"""


def test_unseen_cnn_file_validates_with_default_loss(tmp_path, profile):
    f = tmp_path / "unseen.py"
    f.write_text(textwrap.dedent(UNSEEN))
    r = _plan(f, 2, tmp_path, profile, batch_size=6)
    run, _ = execute(r.plan_path, QUICK, out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures


# A deliberately wrong decomposition: sample parallelism with local batch-norm statistics
# (what DDP without SyncBatchNorm computes) in a plan made for global statistics. Validation
# must catch it and name the tensor.
from autopar.decomp import REGISTRY  # noqa: E402
from autopar.decomp.sample import Sample  # noqa: E402


@dataclass(frozen=True)
class _LocalStatsSample(Sample):
    kind = "test_local_bn_sample"

    def run(self, comm, layer, op, inputs, params, buffers):
        from autopar.runtime.ops import call_local
        return call_local(op, inputs, params, buffers,
                          local_out_shape=self.sharding().local_shape(op.out_shape, comm.rank, comm.world))


@pytest.fixture
def wrong_decomposition():
    REGISTRY[_LocalStatsSample.kind] = _LocalStatsSample   # registered for this test only
    yield
    del REGISTRY[_LocalStatsSample.kind]


def test_wrong_decomposition_fails_validation_and_keeps_good_report(tmp_path, root, profile, wrong_decomposition):
    model = root / "strategies/examples/resnet2d.py"
    good = _plan(model, 2, tmp_path, profile, batch_size=8, kinds=["sample", "replicate"],
                 batch_norm="global")
    out = tmp_path / "run"
    execute(good.plan_path, QUICK, out_dir=out, progress=lambda s: None)
    bad = _plan(model, 2, tmp_path, profile, out_dir=tmp_path / "bad", batch_size=8,
                kinds=["test_local_bn_sample"], batch_norm="global")
    with pytest.raises(ValidationFailed) as e:
        execute(bad.plan_path, QUICK, out_dir=out, progress=lambda s: None)
    assert "worst" in str(e.value) and "rel" in str(e.value)
    assert json.loads((out / "run.json").read_text())["validation"]["passed"], "good report overwritten"
    failed = list(out.glob("failed-*/run.json"))
    assert failed and not json.loads(failed[0].read_text())["validation"]["passed"]


DYING = """
import os, time
import torch
from torch import nn
import torch.distributed as dist

MODE = {mode!r}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 2)
    def forward(self, x):
        if dist.is_available() and dist.is_initialized() and dist.get_rank() == 1:
            if MODE == "die":
                os._exit(7)
            if MODE == "raise":
                raise RuntimeError("rank one is broken")
            time.sleep(600)
        return self.l(x)

def build_model():
    return Net()

def example_inputs(b):
    return (torch.randn(b, 4),)
"""


@pytest.mark.parametrize("mode", ["die", "raise", "hang"])
def test_dead_or_hung_rank_stops_everyone_and_is_named(mode, tmp_path, profile):
    f = tmp_path / f"{mode}.py"
    f.write_text(DYING.format(mode=mode))
    r = _plan(f, 2, tmp_path, profile, batch_size=4)
    opts = ExecuteOptions(steps=1, warmup=0, timeout_s=8 if mode == "hang" else 60)
    with pytest.raises(RankFailure) as e:
        execute(r.plan_path, opts, out_dir=tmp_path / "run", progress=lambda s: None)
    msg = str(e.value)
    assert msg.startswith("rank 1 failed") or "did not finish" in msg, msg
    if mode == "raise":
        assert "rank one is broken" in msg


def test_plan_and_ddp_steps_are_timed_in_alternating_rounds(monkeypatch):
    """``execute`` times DDP beside the plan in the same rounds (``runner.interleaved``): a block
    of each per round, the order alternating, every step counted once."""
    import autopar.execute.timing as timing
    from autopar.execute.runner import INTERLEAVE_ROUNDS, interleaved
    calls = []

    def fake(model, optim, inputs, loss_of, finish, n, comm, sync, barrier):
        calls.append((model, n))
        return [float(len(calls))] * n
    monkeypatch.setattr(timing, "timed_steps", fake)
    plan_t, ddp_t = interleaved(("plan", None, None, None, None), ("ddp", None, None, None, None), 20,
                                None, None, None)
    assert len(plan_t) == len(ddp_t) == 20
    assert len(calls) == 2 * INTERLEAVE_ROUNDS and sum(n for _, n in calls) == 40
    firsts = [calls[2 * k][0] for k in range(INTERLEAVE_ROUNDS)]
    assert firsts == ["plan", "ddp"] * (INTERLEAVE_ROUNDS // 2)
    assert [n for who, n in calls if who == "plan"] == [4, 4, 3, 3, 3, 3]
    calls.clear()      # 2 steps: 2 rounds, plan first then DDP first (calls 1, 2 | 3, 4)
    assert interleaved(("plan",) * 5, ("ddp",) * 5, 2, None, None, None) == ([1.0, 4.0], [2.0, 3.0])
