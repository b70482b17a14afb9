"""The GPU path: ranks start with spawn whenever CUDA is involved, and every decomposition,
the DDP baseline and the halo exchange run on NCCL and validate against one process.

The ``gpu`` tests run wherever CUDA is present (each skips when the machine has fewer GPUs
than its world size: NCCL wants one device per rank); the CPU tests check the start-method
rule and run one gloo execution under spawn, the start method every CUDA run uses."""

import pytest
import torch

from autopar.artifacts import PlanHooks, PlanOptions
from autopar.decomp import REGISTRY
from autopar.execute.runner import ExecuteOptions, execute
from autopar.planner import make_plan
from autopar.runtime.launch import start_method_for

N_GPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
QUICK = ExecuteOptions(steps=2, warmup=1, timeout_s=300)


def test_start_method_rule(monkeypatch):
    monkeypatch.delenv("AUTOPAR_START_METHOD", raising=False)
    assert start_method_for("nccl") == "spawn"
    assert start_method_for("nccl", "fork") == "spawn"         # fork cannot use CUDA
    if not torch.cuda.is_initialized():
        assert start_method_for("gloo") == "fork"
        monkeypatch.setenv("AUTOPAR_START_METHOD", "spawn")
        assert start_method_for("gloo") == "spawn"
        monkeypatch.setenv("AUTOPAR_START_METHOD", "bogus")
        with pytest.raises(ValueError):
            start_method_for("gloo")


def _forced_plan(model, world, kind, tmp_path, profile, **kw):
    """A plan of ``model`` in which every layer that has a ``kind`` choice takes it."""
    opts = dict(world_size=world, batch_size=8, write=False, **kw)
    probe = make_plan(model, PlanOptions(**opts), PlanHooks(profile=profile))
    force = {o.layer.index: kind for o in probe.table.layers if any(d.kind == kind for d in o.choices)}
    if not force:
        pytest.skip(f"no layer of {model.name} has a {kind} choice at world {world}")
    opts.update(write=True, out_dir=tmp_path / f"plan-{kind}-w{world}")
    r = make_plan(model, PlanOptions(**opts), PlanHooks(profile=profile, force=force))
    assert any(l.choice.split("(")[0] == kind for l in r.plan.layers)
    return r


@pytest.mark.dist
def test_gloo_execute_under_spawn(tmp_path, root, profile, monkeypatch):
    monkeypatch.setenv("AUTOPAR_START_METHOD", "spawn")
    r = _forced_plan(root / "strategies/examples/resnet2d.py", 2, "spatial", tmp_path, profile)
    run, _ = execute(r.plan_path, QUICK, out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures


@pytest.mark.gpu
@pytest.mark.skipif(N_GPU < 1, reason="needs CUDA")
def test_nccl_one_gpu_plan_and_ddp(tmp_path, root, profile):
    r = make_plan(root / "strategies/examples/resnet2d.py",
                  PlanOptions(world_size=1, batch_size=8, out_dir=tmp_path / "plan"), PlanHooks(profile=profile))
    run, _ = execute(r.plan_path, ExecuteOptions(steps=2, warmup=1, timeout_s=300, backend="nccl"),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures
    assert run.measured.step_time_s > 0 and run.baseline.ddp_step_time_s > 0


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_nccl_every_decomposition(kind, world, tmp_path, root, profile):
    """Each decomposition (spatial: with its halo exchange) forced wherever legal, run on
    NCCL, validated in float64 against one process, timed against DDP."""
    if N_GPU < world:
        pytest.skip(f"needs {world} GPUs, {N_GPU} here")
    model = root / "strategies/examples/resnet2d.py"
    r = _forced_plan(model, world, kind, tmp_path, profile)
    run, _ = execute(r.plan_path, ExecuteOptions(steps=2, warmup=1, timeout_s=300, backend="nccl"),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures
    assert run.baseline.ddp_step_time_s > 0
