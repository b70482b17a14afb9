"""Activation checkpointing per unit in the sharded strategy (issue 40): its price
(``decomp.fsdp``: "Activation checkpointing"), the chooser taking it only where the memory limit
needs it, and the run on torch (``torch.utils.checkpoint`` inside FSDP2's hooks) in ``autopar
execute``, ``autopar.parallelize`` and the generated module, against one process in float64.

The model: the shipped GPT with 4 blocks over 128 positions (activations outweigh parameters, as
in a real transformer), planned at world 2 under 3 MiB per rank, which the fastest sharding alone
(4.99 MiB) misses. Tolerances: 1e-10 absolute on parameters after AdamW steps (float64; the sums
differ from one process only in their order); measured peak memory within 20 % of the prediction."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from autopar.decomp.fsdp import (DDP_ZERO, Sharded, UnitParams, UnitTime, ac_order, ac_segments, recompute_times,
                                 step_peak_bytes)

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 3 * 2**20


# ---- pure: the price -----------------------------------------------------------------------------

def test_ac_priced_by_hand():
    root = UnitParams("<root>", ((100,),), itemsize=1)        # F = 100
    blk = UnitParams("b", ((400,),), itemsize=1)              # F = 400, S = 100 at 4 ranks
    z3, z3ac = Sharded(3, True, 4), Sharded(3, True, 4, ac=True)
    segs, acts, ins = [0, 1, 0], [10.0, 50.0, 5.0], [0.0, 8.0, 0.0]
    assert ac_segments([z3, z3ac], segs, acts, ins) == ([10.0, 8.0, 5.0], [0.0, 42.0, 0.0])
    res = 3 * 25 + 3 * 100
    off = step_peak_bytes([root, blk], [z3, z3], 1.0, segs, acts, segment_inputs=ins)
    on = step_peak_bytes([root, blk], [z3, z3ac], 1.0, segs, acts, segment_inputs=ins)
    # without AC the peak is in b's backward: res + 60 + 900 (test_fsdp.test_step_peak_by_hand);
    # with AC b keeps 8 of its 50 and rebuilds 42 there: the same peak (b is the last unit)
    assert off.total_bytes == on.total_bytes == res + 60 + 900
    assert on.activation_bytes == 23
    # two blocks: checkpointing the first saves its 50 - 8 at the second's backward peak
    b2 = UnitParams("c", ((400,),), itemsize=1)
    segs2, acts2, ins2 = [0, 1, 2, 0], [10.0, 50.0, 50.0, 5.0], [0.0, 8.0, 8.0, 0.0]
    base = step_peak_bytes([root, blk, b2], [z3, z3, z3], 1.0, segs2, acts2, segment_inputs=ins2)
    ac1 = step_peak_bytes([root, blk, b2], [z3, z3ac, z3], 1.0, segs2, acts2, segment_inputs=ins2)
    assert base.total_bytes - ac1.total_bytes == 42
    with pytest.raises(ValueError, match="input bytes"):
        step_peak_bytes([root, blk], [z3, z3ac], 1.0, segs, acts)
    # time: the AC unit's forward again in its backward; order by bytes saved per second added
    t = [UnitTime(1.0, 2.0), UnitTime(3.0, 6.0), UnitTime(0.5, 1.0)]
    assert recompute_times(t, [z3, z3ac], segs) == [t[0], UnitTime(3.0, 9.0), t[2]]
    t2 = [UnitTime(1.0, 2.0), UnitTime(2.0, 4.0), UnitTime(1.0, 2.0), UnitTime(0.5, 1.0)]
    assert ac_order([1, 2], segs2, acts2, ins2, t2) == [2, 1]         # 42 B/s vs 21 B/s
    assert ac_order([1], [0, 1], [1.0, 4.0], [0.0, 4.0], t) == []     # saves nothing: left out
    # plan.json and legality
    assert Sharded.from_json(z3ac.to_json()) == z3ac and z3ac.to_json()["ac"] is True
    assert Sharded.from_json({k: v for k, v in z3.to_json().items() if k != "ac"}) == z3    # older plan files
    assert str(z3ac) == "zero3(dp4,reshard,ac)" and z3ac.check() is None
    assert "FSDP2 units only" in Sharded(1, False, 4, engine=DDP_ZERO, ac=True).check()


# ---- planning: AC where the limit needs it ----------------------------------------------------------

@pytest.fixture(scope="module")
def ac_plan(tmp_path_factory):
    from fakes import synthetic_profile

    from autopar.artifacts import PlanOptions
    from autopar.planner import make_plan
    from autopar.profile import save_profile
    base = tmp_path_factory.mktemp("fsdp-ac")
    prof = base / "prof.json"
    save_profile(synthetic_profile(), prof)
    text = (ROOT / "strategies/examples/gpt.py").read_text()
    text = text.replace('"AUTOPAR_GPT_SEQ", 16', '"AUTOPAR_GPT_SEQ", 128').replace('"AUTOPAR_GPT_LAYERS", 2',
                                                                                  '"AUTOPAR_GPT_LAYERS", 4')
    model = base / "gpt_model.py"
    model.write_text(text)
    free = make_plan(model, PlanOptions(world_size=2, calibration=str(prof), out_dir=str(base / "free")))
    ac = make_plan(model, PlanOptions(world_size=2, calibration=str(prof), out_dir=str(base / "ac"),
                                      memory_limit_bytes=LIMIT))
    return free, ac, model


def _decisions(plan):
    sh = dict(plan.runtime.extra)["sharded"]
    return {k: (Sharded.from_json(v) if v is not None else None) for k, v in sh["units"].items()}, sh


def test_ac_chosen_only_where_the_limit_needs_it(ac_plan):
    from autopar.cost.native import choose_runtime, native_choice
    from autopar.cost.table import evaluate
    from autopar.planner.strategies.sharded import _Pricer
    free, r, _ = ac_plan
    assert not any(s is not None and s.ac for s in
                   (_decisions(free.plan)[0].values() if free.plan.runtime.expected == "fsdp" else []))
    plan = r.plan
    assert plan.runtime.expected == "fsdp"
    decs, sh = _decisions(plan)
    assert all("ac" in v for v in sh["units"].values() if v is not None)          # recorded per unit
    on = [k for k, s in decs.items() if s is not None and s.ac]
    assert on and len(on) < len(decs), decs                                       # some units, not all
    assert sh["root"] is None or not sh["root"]["ac"]
    assert plan.predicted.memory_per_rank_bytes <= LIMIT
    assert "activation checkpointing on" in next(s.label for s in plan.strategies if s.chosen)
    # the chosen assignment re-priced: with AC it is the prediction; without, over the limit and faster
    table = r.table
    nat = native_choice(table)
    _, pred = choose_runtime(table, nat, evaluate, None)
    pr = _Pricer(table, tuple(nat), pred)
    a = tuple([Sharded.from_json(sh["root"]) if sh["root"] else None] + [decs[n] for n in pr.units.names[1:]])
    p = pr.price(a)
    assert p.memory_bytes == pytest.approx(plan.predicted.memory_per_rank_bytes, rel=1e-12)
    assert p.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    q = pr.price(tuple(dataclasses.replace(s, ac=False) if s is not None else None for s in a))
    assert q.memory_bytes > LIMIT and q.step_time_s < p.step_time_s
    # the minimal prefix: dropping AC from any one checkpointed unit no longer fits
    for n in on:
        i = pr.units.names.index(n)
        fewer = tuple(dataclasses.replace(s, ac=False) if k == i else s for k, s in enumerate(a))
        assert pr.price(fewer).memory_bytes > LIMIT, n


# ---- run: autopar execute, autopar.parallelize, the generated module ----------------------------------

def _without_ac(plan_path: Path) -> Path:
    """A copy of the plan directory (beside it: the model file's path is relative) whose plan.json
    checkpoints no unit (the same plan otherwise)."""
    out = plan_path.parent.with_name(plan_path.parent.name + "-noac")
    shutil.copytree(plan_path.parent, out, dirs_exist_ok=True)
    p = out / plan_path.name
    d = json.loads(p.read_text())
    for v in d["runtime"]["sharded"]["units"].values():
        if v is not None:
            v["ac"] = False
    p.write_text(json.dumps(d, indent=1))
    return p


@pytest.mark.dist
def test_execute_validates_ac_and_its_memory_drops_as_predicted(ac_plan, tmp_path):
    """``autopar execute`` of the AC plan: float64 validation against one process (outputs, loss,
    every gradient, parameters after a step); the measured peak (live tensor bytes, float32) within
    20 % of the prediction, and below the same plan's without AC by about what the price says."""
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner.strategies.sharded import _Pricer  # noqa: F401  (the price: test above)
    _, r, _ = ac_plan
    opts = ExecuteOptions(steps=2, warmup=1, ddp=False)
    run, _ = execute(r.plan_path, opts, out_dir=tmp_path / "ac", progress=lambda s: None)
    assert run.validation.passed and run.validation.checked > 50
    sh = dict(run.extra)["sharded"]
    assert any(",ac)" in v for v in sh["units"].values())
    assert 0.8 <= sh["memory_ratio_measured_to_predicted"] <= 1.2, sh
    off, _ = execute(_without_ac(r.plan_path), opts, out_dir=tmp_path / "off", progress=lambda s: None)
    assert off.validation.passed
    sh_off = dict(off.extra)["sharded"]
    assert not any(",ac)" in v for v in sh_off["units"].values())
    dropped = sh_off["measured_peak_bytes_per_rank"] - sh["measured_peak_bytes_per_rank"]
    assert dropped > 0.2 * sh_off["measured_peak_bytes_per_rank"], (sh, sh_off)


def _user_loop_ac(rank, world, plan_path, model_path):
    """``autopar.parallelize`` of the AC plan in a user's loop (AdamW, two steps) against one
    process; each checkpointed unit's forward runs twice a step (the recompute)."""
    import importlib.util

    import autopar
    spec = importlib.util.spec_from_file_location("gpt_ac_model", model_path)
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    torch.manual_seed(0)
    ref = mf.build_model().double()
    model = mf.build_model().double()
    model.load_state_dict(ref.state_dict())
    model = autopar.parallelize(model, plan_path)
    ac = [n for n, m in model.named_modules() if getattr(m, "_autopar_ac", False)]
    calls = []
    for n in ac:
        model.get_submodule(n + ".fc").register_forward_pre_hook(lambda m, a: calls.append(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randint(0, mf.VOCAB, (4, mf.SEQ), generator=g)
        y = torch.randint(0, mf.VOCAB, (4, mf.SEQ), generator=g)
        mf.loss_fn(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        mf.loss_fn(ref(x), y).backward()
        opt.step(); ropt.step(); opt.zero_grad(); ropt.zero_grad()  # noqa: E702
    rp = dict(ref.named_parameters())
    err = max((p.detach().full_tensor() - rp[q].detach()).abs().max().item() for q, p in model.named_parameters())
    return {"ac": ac, "calls": len(calls), "err": err, "names": sorted(q for q, _ in model.named_parameters()),
            "ref_names": sorted(rp)}


@pytest.mark.dist
def test_parallelize_and_generated_module_run_ac(ac_plan):
    from test_fsdp import _generated_step

    from autopar.runtime.launch import run_ranks
    _, r, model = ac_plan
    decs, _ = _decisions(r.plan)
    want = sorted(k for k, s in decs.items() if s is not None and s.ac)
    res = run_ranks(_user_loop_ac, 2, args=(str(r.plan_path), str(model)), start_method="fork", timeout_s=240)
    for o in res:
        assert sorted(o["ac"]) == want
        assert o["calls"] == 2 * 2 * len(want)           # 2 steps, forward + recompute per AC unit
        assert o["names"] == o["ref_names"]              # parameter names untouched by the checkpoint
        assert o["err"] < 1e-10, o["err"]
    text = r.module_path.read_text()
    assert "def checkpoint_unit(module):" in text
    assert text.count("    checkpoint_unit(model.get_submodule(") == len(want)
    for u in want:
        assert text.index(f"checkpoint_unit(model.get_submodule({u!r}))") < text.index(
            f"fully_shard(model.get_submodule({u!r})")
    shutil.copy(model, r.plan_path.parent / "gpt_model.py")
    errs = run_ranks(_generated_step, 2, args=(str(r.module_path), str(model)), start_method="fork", timeout_s=240)
    assert max(errs) < 1e-10
