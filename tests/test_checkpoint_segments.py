"""Checkpoints of plans whose parameters are not one box per rank (``autopar/train/checkpoint.py``).

* A head-split GPT plan holds a *segmented* shard of the fused q|k|v weight (each rank a block
  of q, of k and of v): ``autopar.save`` writes each block as its own chunk, and the checkpoint
  loads into the single-process plan and back into the head plan.
* A branch plan holds each tower's parameters on one branch group's ranks only: every
  parameter is saved by its owners, whatever group holds it.

Both failed in the conformance matrix (``reports/conformance.md``): a ValueError "a segmented
shard ... is not one box", and DCP's "invalid fill ... chunks-volume: 0".
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BATCH = 8


def _plan(tmp: Path, model: str, world: int, pin: str | None) -> str:
    from fakes import synthetic_profile

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    out = tmp / f"{Path(model).stem}-{pin or 'free'}-w{world}"
    opts = PlanOptions(world_size=world, batch_size=BATCH, out_dir=str(out), placement="block",
                       speed_history=False, write=True, pins=(f"*={pin}",) if pin else ())
    return str(make_plan(str(ROOT / model), opts, PlanHooks(profile=synthetic_profile())).plan_path)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_segments")
    gpt, towers = "strategies/examples/gpt.py", "strategies/examples/towers.py"
    return {"tmp": tmp, "gpt": gpt, "towers": towers,
            "gpt-head-w2": _plan(tmp, gpt, 2, "head"), "gpt-w1": _plan(tmp, gpt, 1, None),
            "towers-branch-w2": _plan(tmp, towers, 2, "branch"), "towers-w1": _plan(tmp, towers, 1, None)}


def _choices(plan_path: str) -> list[str]:
    import json
    return [d["choice"] for d in json.loads(Path(plan_path).read_text())["layers"]]


def _dmodel(plan, model, seed):
    import torch

    import autopar
    from autopar.modelfile import load_model_file
    torch.manual_seed(seed)
    m = load_model_file(str(ROOT / model)).build_model()
    return autopar.parallelize(m, plan)


def _optimizer(dm, step: bool):
    import torch
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
    if step:      # optimizer state shaped like each parameter (exp_avg, exp_avg_sq): sharded with it
        for i, p in enumerate(dm.parameters()):
            p.grad = torch.full_like(p, 0.1 * (i + 1))
        opt.step()
    return opt


def _save(rank, world, plan, model, ck, want):
    import torch

    import autopar
    from autopar.train import full_optimizer_state_dict
    dm = _dmodel(plan, model, 0)
    opt = _optimizer(dm, True)
    autopar.save(ck, dm, opt, extra={"step": 7})
    full = autopar.full_state_dict(dm)
    osd = full_optimizer_state_dict(dm, opt)
    if rank == 0:
        torch.save({"model": full, "optim": osd["state"]}, want)


def _load(rank, world, plan, model, ck, want):
    import torch

    import autopar
    from autopar.train import full_optimizer_state_dict
    dm = _dmodel(plan, model, 1)
    opt = _optimizer(dm, False)
    extra = autopar.load(ck, dm, opt)
    full = autopar.full_state_dict(dm)
    osd = full_optimizer_state_dict(dm, opt)["state"]
    w = torch.load(want)
    return {"extra": extra, "keys": len(w["model"]),
            "differ": sorted(k for k, v in w["model"].items() if not torch.equal(full[k], v)),
            "optim_differ": sorted(f"{q}.{k}" for q, st in w["optim"].items() for k, v in st.items()
                                   if isinstance(v, torch.Tensor) and not torch.equal(osd[q][k], v))}


def _round_trip(plans, model, saved, loads):
    from autopar.runtime.launch import run_ranks
    ck, want = str(plans["tmp"] / f"ck-{saved}"), str(plans["tmp"] / f"want-{saved}.pt")
    world = int(saved.rsplit("-w", 1)[1])
    run_ranks(_save, world, args=(plans[saved], model, ck, want), timeout_s=240)
    for name in loads:
        w = int(name.rsplit("-w", 1)[1])
        got = run_ranks(_load, w, args=(plans[name], model, ck, want), timeout_s=240)
        for r in got:
            assert r["extra"] == {"step": 7}
            assert r["keys"] > 0 and r["differ"] == [] and r["optim_differ"] == [], (name, r)


@pytest.mark.dist
def test_head_split_checkpoint_loads_into_another_plan(plans):
    assert any(c.startswith("head") for c in _choices(plans["gpt-head-w2"]))
    _round_trip(plans, plans["gpt"], "gpt-head-w2", ["gpt-w1", "gpt-head-w2"])


@pytest.mark.dist
def test_branch_checkpoint_saves_every_tower(plans):
    assert any(c.startswith("branch") for c in _choices(plans["towers-branch-w2"]))
    _round_trip(plans, plans["towers"], "towers-branch-w2", ["towers-w1", "towers-branch-w2"])
