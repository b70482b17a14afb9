"""The native fast path (``autopar.runtime.native``): a pure data-parallel plan runs the user's
module on the plan's parameters, with ``GradSync`` or torch DDP's reducer (SUM hook), and the
plan's running statistics. It must compute exactly what the traced program computes (float64:
outputs, loss, every gradient, every parameter after two SGD steps, every buffer), pass
``autopar execute``'s validation against one process, leave the user's module untouched, and
keep the traced path (with the reason) wherever it would compute another function.
"""

from __future__ import annotations

import textwrap

import pytest

from autopar.artifacts import PlanHooks, PlanOptions
from autopar.execute.runner import ExecuteOptions, execute
from autopar.planner import make_plan

NET = """
import torch
from torch import nn
import torch.nn.functional as F

UNUSED = False


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.b2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 5)
        self.register_buffer("scale", torch.full((1,), 0.5))   # read-only: native is fine
        if UNUSED:
            self.spare = nn.Linear(3, 3)      # never used in forward

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)) + y)
        return self.fc(y.mean((2, 3)) * self.scale)


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 8, 8),)


def example_targets(batch_size):
    return torch.randint(0, 5, (batch_size,))
"""


@pytest.fixture
def net(tmp_path):
    f = tmp_path / "nnet.py"
    f.write_text(textwrap.dedent(NET))
    return f


@pytest.fixture
def net_unused(tmp_path):
    f = tmp_path / "nnet_unused.py"
    f.write_text(textwrap.dedent(NET).replace("UNUSED = False", "UNUSED = True"))
    return f


def _plan(model, world, tmp_path, profile, name="plan", **kw):
    return make_plan(model, PlanOptions(world_size=world, out_dir=tmp_path / name, max_candidates=30, **kw),
                     PlanHooks(profile=profile))


def _native_vs_traced(rank, world, plan_path, reducer):
    """Two SGD steps (float64) of the plan natively and through the traced program."""
    import os

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
    for key, native in (("native", None), ("traced", False)):
        mf, model = build_user_model(plan, plan_path, 0)
        model.double()
        before = {q: p.detach().clone() for q, p in model.named_parameters()}
        os.environ["AUTOPAR_NATIVE_REDUCER"] = reducer
        dm = gen.PlannedModel(plan, model, comm, native=native)
        os.environ.pop("AUTOPAR_NATIVE_REDUCER")
        dm.train()
        xs, ys = synthetic_batch(mf, plan.model.batch_size, 1)
        local = dm.shard_inputs([x.double() for x in xs])
        opt = torch.optim.SGD(dm.parameters(), lr=0.1, momentum=0.9)
        rec = {"native": dm.native, "ddp": bool(dm.native and dm._native.ddp is not None),
               "why": dm.native_off_reason, "reducer": dm._native.reducer if dm.native else None}
        import torch.distributed as dist
        calls = []
        real = dist.all_reduce

        def counted(*a, **k):
            calls.append(1)
            return real(*a, **k)
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            dist.all_reduce = counted       # the steps' own collectives, not validation's
            try:
                o = dm(*local)
                loss = dm.local_loss(o, ys, mf.loss_fn())
                loss.backward()
                dm.finish_grads()
            finally:
                dist.all_reduce = real
            rec[f"out{step}"] = o.detach().clone()
            rec[f"loss{step}"] = loss.detach().clone()
            rec[f"grads{step}"] = dm.full_grads()
            opt.step()
        rec["step_all_reduces"] = len(calls)
        rec["params"] = dm.full_params()
        dm.flush_batch_norm()               # the readers' collective (runtime.native: flush)
        rec["buffers"] = {q: b.clone() for q, b in dm.bufs.items()}
        rec["user_untouched"] = all(torch.equal(p, before[q]) and p is not dm.param(q)
                                    for q, p in model.named_parameters())
        out[key] = _np(rec)
    return out


def _np(x):
    """Tensors as numpy arrays (a rank's result crosses a process boundary by pickle)."""
    import torch
    if isinstance(x, torch.Tensor):
        return x.detach().double().numpy().copy()
    if isinstance(x, dict):
        return {k: _np(v) for k, v in x.items()}
    return x


def _close(a, b, rtol=1e-12, atol=1e-12):
    """The validation rule (``execute.validate``): max|a - b| <= rtol * max|b| + atol (float64;
    the atol covers gradients that are zero in exact arithmetic, e.g. a bias before batch norm)."""
    import numpy as np
    return bool(np.abs(a - b).max(initial=0.0) <= rtol * float(np.abs(b).max(initial=0.0)) + atol)


@pytest.mark.dist
@pytest.mark.parametrize("world,reducer", [(2, "ddp"), (2, "gradsync"), (4, "ddp"), (4, "gradsync")])
def test_native_path_computes_what_the_traced_program_computes(world, reducer, net, tmp_path, profile):
    from autopar.runtime.launch import run_ranks
    r = _plan(net, world, tmp_path, profile, batch_size=8, kinds=["sample"])
    assert {d.choice for d in r.plan.layers} == {f"sample({world})"}
    res = run_ranks(_native_vs_traced, world, args=(str(r.plan_path), reducer), timeout_s=180)
    for rank, out in enumerate(res):
        nat, tr = out["native"], out["traced"]
        assert nat["native"] and nat["ddp"] == (reducer == "ddp"), nat["why"]
        if reducer == "ddp":    # DDP's hook reduces gradients; running statistics wait for a reader
            assert nat["step_all_reduces"] == 0
        assert not tr["native"] and tr["why"] == "native=False"
        assert nat["user_untouched"] and tr["user_untouched"]
        for step in range(2):
            assert _close(nat[f"out{step}"], tr[f"out{step}"]), (rank, step)
            assert _close(nat[f"loss{step}"], tr[f"loss{step}"]), (rank, step)
            for q, g in tr[f"grads{step}"].items():
                assert _close(nat[f"grads{step}"][q], g), (rank, step, q)
        for q, p in tr["params"].items():
            assert _close(nat["params"][q], p), (rank, q)
        assert set(nat["buffers"]) == set(tr["buffers"]) and "b2.running_var" in tr["buffers"]
        for q, b in tr["buffers"].items():
            assert _close(nat["buffers"][q], b), (rank, q)     # num_batches_tracked == 2 too


@pytest.mark.dist
def test_execute_validates_the_native_path_against_one_process(net, tmp_path, profile):
    r = _plan(net, 2, tmp_path, profile, batch_size=8, kinds=["sample"])
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=180),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed and run.validation.dtype == "float64", \
        [c.tensor for c in run.validation.failures]
    assert run.baseline.equivalent
    # the default reducer: torch DDP's (the model's every parameter gets a gradient)
    assert run.notes[0].startswith("runtime: native") and "torch DDP's reducer" in run.notes[0]
    assert run.extra["native_runtime"] is True
    # per-layer times come from the leaf modules that name a layer: the convolutions measured
    assert sum(l.measured_s for l in run.measured.per_layer) > 0


@pytest.mark.dist
def test_a_parameter_without_gradient_keeps_gradsync_and_validates(net_unused, tmp_path, profile):
    from autopar.runtime.launch import run_ranks
    r = _plan(net_unused, 2, tmp_path, profile, batch_size=8, kinds=["sample"])
    res = run_ranks(_native_vs_traced, 2, args=(str(r.plan_path), "ddp"), timeout_s=180)
    assert res[0]["native"]["native"] and not res[0]["native"]["ddp"]
    assert "a parameter gets no gradient" in res[0]["native"]["reducer"]
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, ddp=False,
                                                 timeout_s=180), out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, [c.tensor for c in run.validation.failures]


@pytest.mark.parametrize("case,why", [
    ("mixed", "not sample(2)"),
    ("global", "global batch-norm statistics"),
    ("group", "batch-norm groups of 2 samples, not the 4 samples of a rank"),
    ("replicas", "not sample(4)"),
])
def test_the_traced_path_stays_where_native_would_compute_another_function(case, why, net, tmp_path, profile):
    """Pure logic (no process): ``why_not_native`` names the reason."""
    from autopar.modelfile import load_model_file
    from autopar.runtime.native import why_not_native
    world = 4 if case == "replicas" else 2
    kw = {"mixed": dict(kinds=["sample", "replicate"]), "global": dict(kinds=["sample"], batch_norm="global"),
          "group": dict(kinds=["sample"], bn_group=2), "replicas": dict(kinds=["sample"])}[case]
    force = {0: "replicate"} if case == "mixed" else ({0: "sample(2)"} if case == "replicas" else None)
    r = make_plan(net, PlanOptions(world_size=world, batch_size=8, write=False, max_candidates=30, **kw),
                  PlanHooks(profile=profile, force=force))
    plan = r.plan
    decisions = {d.layer: d.decomposition() for d in plan.layers}
    model = load_model_file(net).build_model()
    got = why_not_native(plan.graph(), decisions, world, plan.bn_stats(), model, 8)
    assert got is not None and why in got, got
    if case != "mixed" and case != "replicas":
        return
    pure = make_plan(net, PlanOptions(world_size=2, batch_size=8, write=False, kinds=["sample"]),
                     PlanHooks(profile=profile)).plan
    assert why_not_native(pure.graph(), {d.layer: d.decomposition() for d in pure.layers}, 2,
                          pure.bn_stats(), model, 8) is None


def test_native_switch_is_read_from_the_environment(monkeypatch):
    from autopar.runtime.native import native_enabled, reducer_choice
    monkeypatch.setenv("AUTOPAR_NATIVE", "0")
    assert not native_enabled()
    monkeypatch.delenv("AUTOPAR_NATIVE")
    assert native_enabled() and reducer_choice() == "ddp"
    monkeypatch.setenv("AUTOPAR_NATIVE_REDUCER", "nccl-magic")
    with pytest.raises(ValueError, match="use ddp or gradsync"):
        reducer_choice()


def _train_api(rank, world, plan_path, native):
    """The training library's loop on a pure data-parallel plan: ``.double()`` after
    ``parallelize`` (the DDP reducer is rebuilt for the new dtype), two micro-batches
    accumulated per step (``set_requires_gradient_sync``), two steps."""
    import os

    import torch

    import autopar
    from autopar.artifacts import load_plan
    from autopar.modelfile import load_model_file
    from autopar.train.checkpoint import full_state_dict

    os.environ["AUTOPAR_NATIVE"] = "1" if native else "0"
    os.environ["AUTOPAR_NATIVE_REDUCER"] = "ddp"      # the reducer with the more delicate wiring
    plan = load_plan(plan_path)
    torch.manual_seed(0)
    model = load_model_file(plan.model_file(plan_path)).build_model()
    dm = autopar.parallelize(model.float(), plan_path).double()
    opt = torch.optim.SGD(dm.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 8, 8, generator=g, dtype=torch.float64)
    t = torch.randint(0, 5, (16,), generator=g)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        for i, (xb, tb) in enumerate(((x[:8], t[:8]), (x[8:], t[8:]))):
            dm.set_requires_gradient_sync(i == 1)
            xs, ts = autopar.shard_batch(dm, xb, tb)
            loss = dm.loss(xs, ts)
            loss.backward()
            losses.append(float(loss))
        opt.step()
    return {"native": dm.native, "losses": losses, "state": _np(full_state_dict(dm))}


@pytest.mark.dist
def test_training_library_with_accumulation_runs_natively_and_equals_traced(net, tmp_path, profile):
    from autopar.runtime.launch import run_ranks
    r = _plan(net, 2, tmp_path, profile, batch_size=8, kinds=["sample"])
    nat = run_ranks(_train_api, 2, args=(str(r.plan_path), True), timeout_s=180)[0]
    tr = run_ranks(_train_api, 2, args=(str(r.plan_path), False), timeout_s=180)[0]
    assert nat["native"] and not tr["native"]
    assert nat["losses"] == pytest.approx(tr["losses"], rel=1e-12)
    assert set(nat["state"]) == set(tr["state"]) and "b1.running_mean" in tr["state"]
    for q, v in tr["state"].items():
        assert _close(nat["state"][q], v), q


def test_cached_substitution_equals_the_template_walk():
    """The traced path builds each op's argument substitution once (``substitute_cached``): it
    returns what ``substitute`` returns, fresh containers each call, and a new template object
    gets its own builder."""
    import torch

    from autopar.runtime.ops import substitute, substitute_cached
    v = {"x": torch.ones(2), "y": torch.zeros(3)}
    p = {"w": torch.full((2,), 2.0)}
    b = {"rm": torch.full((2,), 3.0)}
    args = [{"v": "x"}, {"p": "w"}, None, [1, [2, 3]], {"dtype": "float64"},
            [{"v": "x"}, {"v": "y"}], {"k": {"b": "rm"}, "n": 4}, 0.5, "mode", True]
    for _ in range(2):
        a, ref = substitute_cached(args, v, p, b), substitute(args, v, p, b)
        assert a[0] is v["x"] and a[1] is p["w"] and a[2] is None and a[3] == [1, [2, 3]]
        assert a[4] is torch.float64 and a[5][0] is v["x"] and a[5][1] is v["y"]
        assert a[6]["k"] is b["rm"] and a[6]["n"] == 4 and a[7:] == ref[7:] == [0.5, "mode", True]
        assert a is not substitute_cached(args, v, p, b)        # a fresh list: callers may edit it
    other = [{"v": "y"}]
    assert substitute_cached(other, v, p, b)[0] is v["y"]
    assert substitute_cached({"alpha": 2}, v, p, b) == {"alpha": 2}
