"""Engines of a pure data-parallel plan (``autopar.runtime.native``, "Engines"): torch's
``DistributedDataParallel`` itself (its own averaging reducer, each rank back-propagating P times
its loss share) or autopar's wrapper (DDP's reducer with a SUM hook). Both must compute the
single-process function: float64 at world 2 and 4, the shipped GPT and ResNet-2D (local batch
norm) through ``autopar.parallelize``: the output block, the loss, the input gradient where the
input is floating, every parameter gradient, every parameter after an AdamW step and every
buffer; the two engines' gradients equal bit for bit (P a power of two: the factor P is exact).
``autopar execute --engine`` records the engine in run.json; a global batch-norm plan keeps the
traced program with the reason; the default engine is the benchmark's verdict.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.artifacts import PlanHooks, PlanOptions
from autopar.execute.runner import ExecuteOptions, execute
from autopar.planner import make_plan

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "strategies/examples/gpt.py"
RESNET = ROOT / "strategies/examples/resnet2d.py"


def _plan(model, world, tmp_path, profile, name, **kw):
    return make_plan(model, PlanOptions(world_size=world, out_dir=tmp_path / name, **kw), PlanHooks(profile=profile))


def _np(x):
    import torch
    if isinstance(x, torch.Tensor):
        return x.detach().double().numpy().copy()
    if isinstance(x, dict):
        return {k: _np(v) for k, v in x.items()}
    return x


def _close(a, b, rtol=1e-9, atol=1e-12):
    """``execute``'s validation rule (float64): max|a - b| <= rtol * max|b| + atol."""
    import numpy as np
    return bool(np.abs(a - b).max(initial=0.0) <= rtol * float(np.abs(b).max(initial=0.0)) + atol)


def _engines_vs_one_process(rank, world, plan_path):
    """One AdamW step (float64) of the plan on each engine through ``autopar.parallelize``, and
    of the single-process model (with the plan's batch-norm statistics, ``ghost_batch_norm``)."""
    import copy

    import torch

    import autopar
    from autopar.artifacts import load_plan
    from autopar.execute.validate import ghost_batch_norm
    from autopar.modelfile import load_model_file
    from autopar.train.checkpoint import full_state_dict

    plan = load_plan(plan_path)
    mf = load_model_file(plan.model_file(plan_path), env=plan.model_env())
    b = plan.model.batch_size
    torch.manual_seed(1)
    x, y = mf.example_inputs(b)[0], mf.example_targets(b)
    x = x.double() if x.is_floating_point() else x
    bn = plan.bn_stats()
    loss_fn = mf.loss_fn()
    torch.manual_seed(0)
    model = mf.build_model().double()
    out = {}
    # the single process
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_() if x.is_floating_point() else x
    with ghost_batch_norm(bn.group if bn.local else None):
        o = ref(xr)
        loss = loss_fn(o, y)
    loss.backward()
    rec = {"out": o.chunk(world)[rank], "loss": loss,
           "grads": {q: p.grad for q, p in ref.named_parameters()}}
    if x.is_floating_point():
        rec["input_grad"] = xr.grad.chunk(world)[rank]
    torch.optim.AdamW(ref.parameters(), lr=1e-2).step()
    rec["state"] = dict(ref.state_dict())
    out["one"] = _np(rec)
    for engine in ("torch-ddp", "autopar"):
        dm = autopar.parallelize(copy.deepcopy(model), plan_path, engine=engine)
        xs, ys = autopar.shard_batch(dm, x, y)
        if x.is_floating_point():
            xs = [xs[0].clone().requires_grad_()]
        o = dm(*xs)
        loss = dm.reduce_loss(loss_fn(o, ys))
        loss.backward()
        rec = {"engine": dm.engine, "reason": dm._native.engine_reason if dm.native else dm.native_off_reason,
               "out": o, "loss": loss, "grads": dm.full_grads()}
        if x.is_floating_point():
            rec["input_grad"] = xs[0].grad
        torch.optim.AdamW(dm.parameters(), lr=1e-2).step()
        rec["state"] = full_state_dict(dm)
        out[engine] = _np(rec)
    return out


def _check_against_one_process(res, world):
    for rank, r in enumerate(res):
        one = r["one"]
        assert r["torch-ddp"]["engine"] == "torch-ddp", r["torch-ddp"]["reason"]
        assert r["autopar"]["engine"] == "autopar-native", r["autopar"]["reason"]
        for eng in ("torch-ddp", "autopar"):
            got = r[eng]
            assert _close(got["out"], one["out"]), (eng, rank, "out")
            assert _close(got["loss"], one["loss"]), (eng, rank, "loss")
            if "input_grad" in one:
                assert _close(got["input_grad"], one["input_grad"]), (eng, rank, "input grad")
            assert set(got["grads"]) == set(one["grads"])
            for q, g in one["grads"].items():
                assert _close(got["grads"][q], g), (eng, rank, q)
            assert set(got["state"]) == set(one["state"])
            for q, v in one["state"].items():
                assert _close(got["state"][q], v), (eng, rank, q)
        # P a power of two: the averaging reducer and the SUM hook give the same bits
        for q, g in r["autopar"]["grads"].items():
            assert (r["torch-ddp"]["grads"][q] == g).all(), (rank, q)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_gpt_on_torch_ddp_equals_one_process(world, tmp_path, profile):
    from autopar.runtime.launch import run_ranks
    r = _plan(GPT, world, tmp_path, profile, "gpt", batch_size=8, kinds=["sample", "replicate"])
    assert r.plan.runtime.expected == "native"
    res = run_ranks(_engines_vs_one_process, world, args=(str(r.plan_path),), timeout_s=300)
    _check_against_one_process(res, world)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_resnet2d_local_batch_norm_on_torch_ddp_equals_one_process(world, tmp_path, profile):
    from autopar.runtime.launch import run_ranks
    r = _plan(RESNET, world, tmp_path, profile, "resnet", batch_size=8, kinds=["sample"], batch_norm="local")
    assert r.plan.bn_stats().local and r.plan.bn_stats().group == 8 // world
    res = run_ranks(_engines_vs_one_process, world, args=(str(r.plan_path),), timeout_s=300)
    _check_against_one_process(res, world)
    assert any("running_mean" in q for q in res[0]["one"]["state"])


@pytest.mark.dist
def test_execute_records_the_engine_and_validates_each(tmp_path, profile):
    """``autopar execute --engine``: both engines pass float64 validation (resnet2d, local batch
    norm, world 2); run.json says which ran. A global batch-norm plan has no native engine on
    CPU (DDP + SyncBatchNorm has no gloo path): the traced program, with the reason."""
    r = _plan(RESNET, 2, tmp_path, profile, "local", batch_size=8, kinds=["sample"], batch_norm="local")
    for engine, want in (("torch-ddp", "torch-ddp"), ("autopar", "autopar-native")):
        run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, ddp=False,
                                                     engine=engine, timeout_s=300),
                         out_dir=tmp_path / f"run-{engine}", progress=lambda s: None)
        assert run.validation.passed and run.validation.dtype == "float64", \
            [c.tensor for c in run.validation.failures]
        assert run.extra["engine"]["engine"] == want, run.extra["engine"]
        assert want in run.notes[0]
    g = _plan(RESNET, 2, tmp_path, profile, "global", batch_size=8, kinds=["sample"], batch_norm="global")
    run, _ = execute(g.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, ddp=False,
                                                 engine="torch-ddp", timeout_s=300),
                     out_dir=tmp_path / "run-global", progress=lambda s: None)
    assert run.validation.passed
    assert run.extra["engine"]["engine"] == "autopar-traced"
    assert "global batch-norm" in run.extra["engine"]["reason"]


def _accumulate(rank, world, plan_path, engine):
    """The user's loop: two micro-batches accumulated per step (``set_requires_gradient_sync``),
    two AdamW steps, float64."""
    import torch

    import autopar
    from autopar.artifacts import load_plan
    from autopar.modelfile import load_model_file
    from autopar.train.checkpoint import full_state_dict

    plan = load_plan(plan_path)
    mf = load_model_file(plan.model_file(plan_path), env=plan.model_env())
    torch.manual_seed(0)
    kw = {"engine": engine} if engine != "traced" else {}
    if engine == "traced":
        import os
        os.environ["AUTOPAR_NATIVE"] = "0"
    dm = autopar.parallelize(mf.build_model().double(), plan_path, **kw)
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
    b = plan.model.batch_size
    torch.manual_seed(1)
    x, y = mf.example_inputs(2 * b)[0], mf.example_targets(2 * b)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        for i in range(2):
            dm.set_requires_gradient_sync(i == 1)
            xs, ys = autopar.shard_batch(dm, x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
            loss = dm.loss(xs, ys)
            loss.backward()
            losses.append(float(loss))
        opt.step()
    return {"engine": dm.engine, "losses": losses, "state": _np(full_state_dict(dm))}


@pytest.mark.dist
def test_parallelize_on_torch_ddp_trains_with_accumulation_like_the_traced_program(tmp_path, profile):
    from autopar.runtime.launch import run_ranks
    r = _plan(GPT, 2, tmp_path, profile, "gpt", batch_size=8, kinds=["sample", "replicate"])
    got = {e: run_ranks(_accumulate, 2, args=(str(r.plan_path), e), timeout_s=300)[0]
           for e in ("torch-ddp", "traced")}
    assert got["torch-ddp"]["engine"] == "torch-ddp" and got["traced"]["engine"] == "autopar-traced"
    assert got["torch-ddp"]["losses"] == pytest.approx(got["traced"]["losses"], rel=1e-12)
    for q, v in got["traced"]["state"].items():
        assert _close(got["torch-ddp"]["state"][q], v), q


def test_engine_names_and_the_environment(monkeypatch):
    from autopar.runtime.native import EngineError, engine_name, engine_request, use_engine
    assert engine_name("ddp") == "torch-ddp" and engine_name("autopar") == "autopar-native"
    with pytest.raises(EngineError, match="use auto, torch-ddp or autopar"):
        engine_name("megatron")
    monkeypatch.setenv("AUTOPAR_ENGINE", "autopar")
    assert engine_request() == "autopar-native"
    with use_engine("torch-ddp"):
        assert engine_request() == "torch-ddp"
    monkeypatch.setenv("AUTOPAR_ENGINE", "nope")
    with pytest.raises(EngineError, match="AUTOPAR_ENGINE"):
        engine_request()


def test_the_default_engine_is_the_benchmarks_verdict():
    """``DEFAULT_ENGINE`` follows ``benchmarks/bench_engines.py``'s verdict (the faster engine
    measured side by side), which its report states with the figures."""
    from autopar.runtime.native import DEFAULT_ENGINE, ENGINES
    rep = json.loads((ROOT / "reports/benchmarks/engines.json").read_text())
    assert rep["verdict"] in ENGINES
    assert DEFAULT_ENGINE == rep["verdict"]
    assert {(r["model"], r["world"]) for r in rep["rows"]} >= {("gpt", 2), ("gpt", 4), ("hf_gpt2", 2), ("hf_gpt2", 4)}
