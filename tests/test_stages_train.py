"""The user's loop under a pipeline plan (``autopar.parallelize`` -> ``dmodel.loss`` -> backward ->
AdamW) against one process in float64, and checkpoints moving between a pipeline plan at world
2 and a plan without stages at world 1, both ways (issue 41 item 6). Every computation runs in
fresh ranks (the parent only plans and compares). Tolerance: 1e-12 relative + 1e-11 absolute
(parameters after AdamW; see tests/test_stages_runtime.py for why)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.dist
ENV = {"AUTOPAR_GPT_LAYERS": "4", "AUTOPAR_GPT_EMBED": "16", "AUTOPAR_GPT_HEADS": "4", "AUTOPAR_GPT_SEQ": "8",
       "AUTOPAR_GPT_VOCAB": "32"}
M = 4


def _gpt():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_gpt_train_stages", ROOT / "strategies/examples/gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _batch(gpt):
    import torch
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 32, (8, 8), generator=g), torch.randint(0, 32, (8, 8), generator=g)


def _plain_step(rank, world, plan, ckpt_in, ckpt_out):
    """Plan without stages (world 1): optionally load, one user-loop step, save; full params."""
    import torch
    import autopar
    from autopar.train import full_state_dict, load, save
    gpt = _gpt()
    torch.manual_seed(1)
    dm = autopar.parallelize(gpt.GPT().double(), plan)
    if ckpt_in:
        load(ckpt_in, dm)
    before = {k: v.detach().numpy().copy() for k, v in full_state_dict(dm).items()}   # numpy: pickles plainly
    if ckpt_out:
        save(ckpt_out, dm)
    return before


def _pipeline_step(rank, world, plan, ckpt_in, ckpt_out):
    """Pipeline plan (world 2): load a checkpoint of the plain plan, one user-loop step, save."""
    import torch
    import autopar
    from autopar.train import load, save
    gpt = _gpt()
    torch.manual_seed(2)                       # other initial values: the checkpoint must set them
    dm = autopar.parallelize(gpt.GPT().double(), plan, sync_module_states=False)
    load(ckpt_in, dm)
    loaded = {n: p.detach().numpy().copy() for n, p in dm.named_parameters()}
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
    x, y = _batch(gpt)
    opt.zero_grad()
    loss = dm.loss(x, y)
    loss.backward()                            # a no-op: the schedule ran the backward
    opt.step()
    save(ckpt_out, dm)
    return {"loss": loss.item(), "loaded": loaded}


def _reference(rank, world, ckpt_b):
    """One process: the plain plan's checkpoint loaded, the pipelined step's function (mean over
    M microbatches), AdamW; the loss and the parameters."""
    import torch
    import autopar
    from autopar.runtime.stages import reference_step
    gpt = _gpt()
    torch.manual_seed(1)
    model = gpt.GPT().double()
    x, y = _batch(gpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = reference_step(model, x, y, gpt.loss_fn, M)
    opt.step()
    return {"loss": float(loss), "params": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}}
    _ = autopar, ckpt_b


def _pipeline_and_plain_plans(monkeypatch, tmp_path):
    """The GPT planned at world 2 with two pipeline stages (M microbatches) and at world 1 without
    stages, with the committed CPU profile."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.profile import load_profile
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    model = ROOT / "strategies/examples/gpt.py"
    pipe = make_plan(model, PlanOptions(world_size=2, batch_size=8, out_dir=str(tmp_path / "pipe"), placement="block",
                                        trace_cache=False, pipeline=2, microbatches=M), PlanHooks(profile=prof))
    plain = make_plan(model, PlanOptions(world_size=1, batch_size=8, out_dir=str(tmp_path / "plain"),
                                         placement="block", trace_cache=False), PlanHooks(profile=prof))
    return pipe, plain


def test_checkpoints_move_between_a_pipeline_plan_and_a_plain_plan(monkeypatch, tmp_path):
    import torch

    from autopar.runtime.launch import run_ranks
    pipe, plain = _pipeline_and_plain_plans(monkeypatch, tmp_path)
    assert pipe.plan.runtime.expected == "stages"
    ck_b, ck_a = tmp_path / "ck_plain", tmp_path / "ck_pipe"
    # plain plan at world 1 writes its initial state (seed 1)
    b0 = run_ranks(_plain_step, 1, args=(str(plain.plan_path), None, str(ck_b)), timeout_s=120)[0]
    # the pipeline plan at world 2 loads it, trains one step, saves
    res = run_ranks(_pipeline_step, 2, args=(str(pipe.plan_path), str(ck_b), str(ck_a)), timeout_s=120)
    for r in res:
        for n, p in r["loaded"].items():
            assert (p == b0[n]).all(), n                          # plain -> pipeline: exact
    # the plain plan at world 1 loads the pipeline's checkpoint: the one-process step's parameters
    after = run_ranks(_plain_step, 1, args=(str(plain.plan_path), str(ck_a), None), timeout_s=120)[0]
    ref = run_ranks(_reference, 1, args=(None,), timeout_s=120)[0]
    assert res[0]["loss"] == res[1]["loss"] == pytest.approx(ref["loss"], rel=1e-12)
    for n, want in ref["params"].items():
        torch.testing.assert_close(torch.from_numpy(after[n]), torch.from_numpy(want), rtol=1e-12, atol=1e-11)


def _steps(rank, world, plan, ckpt_in, ckpt_out, n, pipeline):
    """``n`` user-loop steps with AdamW under ``plan`` (pipeline or not), after loading model AND
    optimizer from ``ckpt_in`` (if given); save both to ``ckpt_out``; the full parameters."""
    import torch
    import autopar
    from autopar.train import full_state_dict, load, save
    gpt = _gpt()
    torch.manual_seed(1)
    dm = autopar.parallelize(gpt.GPT().double(), plan, **({"sync_module_states": False} if pipeline else {}))
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
    if ckpt_in:
        load(ckpt_in, dm, opt)
    x, y = _batch(gpt)
    for _ in range(n):
        opt.zero_grad()
        loss = dm.loss(x, y) if pipeline else gpt.loss_fn(dm(x), y)
        loss.backward()
        opt.step()
    save(ckpt_out, dm, opt)
    return {k: v.detach().numpy().copy() for k, v in full_state_dict(dm).items()} if not pipeline else None


def _reference_adamw(rank, world, kinds):
    """One process: AdamW over the steps in ``kinds`` ("p": the pipelined step's function, mean
    over M microbatches; "f": the full batch), from the same initial values (seed 1)."""
    import torch
    from autopar.runtime.stages import reference_step
    gpt = _gpt()
    torch.manual_seed(1)
    model = gpt.GPT().double()
    x, y = _batch(gpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for k in kinds:
        opt.zero_grad()
        if k == "p":
            reference_step(model, x, y, gpt.loss_fn, M)
        else:
            gpt.loss_fn(model(x), y).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_optimizer_state_moves_between_a_pipeline_plan_and_a_plain_plan(monkeypatch, tmp_path):
    """Pipeline plan at world 2: AdamW 2 steps, save model + optimizer; a plan without stages at
    world 1 loads both and steps once, saves; the pipeline plan loads that and steps once more;
    the plain plan reads the result. Equal (float64) to one process running the same 4 steps:
    only so if Adam's moments and step count crossed every checkpoint."""
    import torch

    from autopar.runtime.launch import run_ranks
    pipe, plain = _pipeline_and_plain_plans(monkeypatch, tmp_path)
    p, f = str(pipe.plan_path), str(plain.plan_path)
    c1, c2, c3, c4 = (str(tmp_path / f"ck{i}") for i in range(1, 5))
    run_ranks(_steps, 2, args=(p, None, c1, 2, True), timeout_s=120)
    run_ranks(_steps, 1, args=(f, c1, c2, 1, False), timeout_s=120)
    run_ranks(_steps, 2, args=(p, c2, c3, 1, True), timeout_s=120)
    after = run_ranks(_steps, 1, args=(f, c3, c4, 0, False), timeout_s=120)[0]
    ref = run_ranks(_reference_adamw, 1, args=("ppfp",), timeout_s=120)[0]
    for n, want in ref.items():
        torch.testing.assert_close(torch.from_numpy(after[n]), torch.from_numpy(want), rtol=1e-12, atol=1e-11)
    stale = run_ranks(_reference_adamw, 1, args=("ppf",), timeout_s=120)[0]   # the test can tell: one step fewer
    assert any(not (stale[n] == ref[n]).all() for n in ref)


def _steps_extra(rank, world, plan, ckpt_in, ckpt_out, n, pipeline, extra_out):
    """``_steps`` that also saves ``extra_out`` and returns what ``load`` gave back as ``extra``."""
    import torch
    import autopar
    from autopar.train import full_state_dict, load, save
    gpt = _gpt()
    torch.manual_seed(2 if pipeline and ckpt_in else 1)    # other initial values when a checkpoint must set them
    dm = autopar.parallelize(gpt.GPT().double(), plan, **({"sync_module_states": False} if pipeline else {}))
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
    extra = load(ckpt_in, dm, opt) if ckpt_in else None
    x, y = _batch(gpt)
    for _ in range(n):
        opt.zero_grad()
        loss = dm.loss(x, y) if pipeline else gpt.loss_fn(dm(x), y)
        loss.backward()
        opt.step()
    save(ckpt_out, dm, opt, extra=extra_out)
    full = {k: v.detach().numpy().copy() for k, v in full_state_dict(dm).items()} if not pipeline else None
    return {"extra": extra, "full": full}


def test_tensor_parallel_stages_at_world_4_round_trip_through_a_plain_plan_at_world_2(monkeypatch, tmp_path):
    """A pipeline plan at world 4 whose stages are dp 1 x tp 2 (chosen under a memory limit only
    they fit, as in test_stages_plan): AdamW 2 steps, save (each tp slice of the weights and of
    Adam's moments gathered whole) -> a plan without stages at world 2 loads model, optimizer and
    extra, steps once, saves -> the pipeline plan loads that (cutting its slices), steps once, saves
    -> the plain plan reads it. Equal in float64 to one process running the same 4 steps; ``load``
    returns the ``extra`` the previous plan saved, under both plans."""
    import torch

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    from autopar.runtime.launch import run_ranks
    for k, v in {**ENV, "AUTOPAR_GPT_EMBED": "64"}.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    model = ROOT / "strategies/examples/gpt.py"

    def pipe_plan(limit, out=None):
        return make_plan(model, PlanOptions(world_size=4, batch_size=8, placement="block", trace_cache=False,
                                            pipeline=2, microbatches=M, memory_limit_bytes=limit,
                                            write=out is not None, out_dir=out), PlanHooks(profile=prof))
    peak = {}
    for o in pipe_plan(None).plan.runtime.to_json()["stage_counts_priced"]:
        if "refused" not in o:
            peak[o["tp"]] = min(peak.get(o["tp"], float("inf")), o["peak_bytes_max"])
    pipe = pipe_plan((peak[1] + peak[2]) / 2, str(tmp_path / "pipe"))
    assert [(s["dp"], s["tp"]) for s in pipe.plan.runtime.to_json()["stages"]["stages"]] == [(1, 2), (1, 2)]
    plain = make_plan(model, PlanOptions(world_size=2, batch_size=8, out_dir=str(tmp_path / "plain"),
                                         placement="block", trace_cache=False), PlanHooks(profile=prof))
    assert plain.plan.runtime is None or plain.plan.runtime.expected != "stages"
    p, f = str(pipe.plan_path), str(plain.plan_path)
    c1, c2, c3, c4 = (str(tmp_path / f"ck{i}") for i in range(1, 5))
    run_ranks(_steps_extra, 4, args=(p, None, c1, 2, True, {"step": 2, "by": "pipeline"}), timeout_s=180)
    r2 = run_ranks(_steps_extra, 2, args=(f, c1, c2, 1, False, {"step": 3, "by": "plain"}), timeout_s=180)
    r3 = run_ranks(_steps_extra, 4, args=(p, c2, c3, 1, True, {"step": 4, "by": "pipeline"}), timeout_s=180)
    r4 = run_ranks(_steps_extra, 2, args=(f, c3, c4, 0, False, {}), timeout_s=180)
    assert all(r["extra"] == {"step": 2, "by": "pipeline"} for r in r2)
    assert all(r["extra"] == {"step": 3, "by": "plain"} for r in r3)          # pipeline load returns extra
    assert all(r["extra"] == {"step": 4, "by": "pipeline"} for r in r4)
    ref = run_ranks(_reference_adamw, 1, args=("ppfp",), timeout_s=120)[0]
    after = r4[0]["full"]
    for n, want in ref.items():
        torch.testing.assert_close(torch.from_numpy(after[n]), torch.from_numpy(want), rtol=1e-12, atol=1e-11)
    stale = run_ranks(_reference_adamw, 1, args=("ppf",), timeout_s=120)[0]   # the test can tell: one step fewer
    assert any(not (stale[n] == ref[n]).all() for n in ref)


def test_fsdp_stages_at_world_4_round_trip_through_a_plain_plan_at_world_2(monkeypatch, tmp_path):
    """A pipeline plan at world 4 whose two stages shard their dp pair with FSDP2
    (``--stage-data fsdp``): AdamW 2 steps in the user's loop, save (every DTensor shard of the
    weights and of Adam's moments gathered whole) -> a plan without stages at world 2 loads model
    and optimizer, steps once, saves -> the FSDP2 pipeline loads that (cutting its dp rows), steps
    once, saves -> the plain plan reads it. Equal in float64 to one process running the same 4 steps."""
    import torch

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    from autopar.runtime.launch import run_ranks
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    model = ROOT / "strategies/examples/gpt.py"
    pipe = make_plan(model, PlanOptions(world_size=4, batch_size=8, placement="block", trace_cache=False,
                                        pipeline=2, microbatches=M, stage_data="fsdp",
                                        kinds=("sample", "replicate", "sharded"), out_dir=str(tmp_path / "pipe")),
                     PlanHooks(profile=prof))
    st = pipe.plan.runtime.to_json()["stages"]["stages"]
    assert [(s["dp"], s.get("data")) for s in st] == [(2, "fsdp"), (2, "fsdp")]
    plain = make_plan(model, PlanOptions(world_size=2, batch_size=8, out_dir=str(tmp_path / "plain"),
                                         placement="block", trace_cache=False), PlanHooks(profile=prof))
    p, f = str(pipe.plan_path), str(plain.plan_path)
    c1, c2, c3, c4 = (str(tmp_path / f"ck{i}") for i in range(1, 5))
    run_ranks(_steps_extra, 4, args=(p, None, c1, 2, True, {"by": "fsdp pipeline"}), timeout_s=180)
    r2 = run_ranks(_steps_extra, 2, args=(f, c1, c2, 1, False, {"by": "plain"}), timeout_s=180)
    r3 = run_ranks(_steps_extra, 4, args=(p, c2, c3, 1, True, {"by": "fsdp pipeline"}), timeout_s=180)
    r4 = run_ranks(_steps_extra, 2, args=(f, c3, c4, 0, False, {}), timeout_s=180)
    assert all(r["extra"] == {"by": "fsdp pipeline"} for r in r2) and all(r["extra"] == {"by": "plain"} for r in r3)
    ref = run_ranks(_reference_adamw, 1, args=("ppfp",), timeout_s=120)[0]
    for n, want in ref.items():
        torch.testing.assert_close(torch.from_numpy(r4[0]["full"][n]), torch.from_numpy(want), rtol=1e-12, atol=1e-11)
    stale = run_ranks(_reference_adamw, 1, args=("ppf",), timeout_s=120)[0]   # the test can tell: one step fewer
    assert any(not (stale[n] == ref[n]).all() for n in ref)


def _clipped(rank, world, plan, hf):
    """One pipelined step in the user's loop, then ``autopar.train.clip_grad_norm_``: the norm
    before clipping and every clipped gradient (gathered whole) under its single-process name."""
    import torch
    import autopar
    from autopar.train import clip_grad_norm_
    from autopar.modelfile import load_model_file
    if hf:
        mf = load_model_file(ROOT / "strategies/examples/hf_gpt2.py")
        torch.manual_seed(1)
        model = mf.build_model().double()
        x, y = mf.example_inputs(8)[0], mf.example_targets(8)
    else:
        gpt = _gpt()
        torch.manual_seed(1)
        model = gpt.GPT().double()
        x, y = _batch(gpt)
    dm = autopar.parallelize(model, plan, sync_module_states=False)
    dm.loss(x, y)
    total = clip_grad_norm_(dm, 0.05)
    grads = {n: dm.whole(n, p.grad).numpy().copy() for n, p in sorted(dm.named_parameters())}
    return {"norm": float(total), "grads": grads}


def _clipped_reference(rank, world, hf):
    import torch
    from autopar.modelfile import load_model_file
    from autopar.runtime.stages import reference_step
    if hf:
        mf = load_model_file(ROOT / "strategies/examples/hf_gpt2.py")
        torch.manual_seed(1)
        model, loss_fn = mf.build_model().double(), mf.loss_fn()
        x, y = mf.example_inputs(8)[0], mf.example_targets(8)
    else:
        gpt = _gpt()
        torch.manual_seed(1)
        model, loss_fn = gpt.GPT().double(), gpt.loss_fn
        x, y = _batch(gpt)
    reference_step(model, x, y, loss_fn, M)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    return {"norm": float(total), "grads": {n: p.grad.numpy().copy() for n, p in model.named_parameters()}}


TP_KINDS = ("sample", "replicate", "head", "filter", "row_parallel")


@pytest.mark.parametrize("data,kinds,hf", [("replicate", None, False), ("fsdp", ("sample", "replicate", "sharded"), False),
                                           ("replicate", None, True), ("plan", TP_KINDS, False), ("plan", None, True)])
def test_clip_grad_norm_under_a_pipeline_plan_at_world_4(monkeypatch, tmp_path, data, kinds, hf):
    """``autopar.train.clip_grad_norm_`` under a pipeline plan at world 4 (2 stages of dp 2,
    replicated or FSDP2, or running the solver's stage plan: the GPT's heads, filters and rows split
    over each stage's two ranks; HF GPT-2 with its embedding tied across the stages): the global
    norm counts every element once over stages, replicas, shards and splits, equal to torch's in
    one process, and every clipped gradient equals the reference's clipped one (float64, 1e-12)."""
    import torch

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    from autopar.runtime.launch import run_ranks
    env = {"AUTOPAR_HF_LAYERS": "4", "AUTOPAR_HF_EMBED": "16", "AUTOPAR_HF_HEADS": "4", "AUTOPAR_HF_SEQ": "8",
           "AUTOPAR_HF_VOCAB": "32"} if hf else ENV
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    model = ROOT / ("strategies/examples/hf_gpt2.py" if hf else "strategies/examples/gpt.py")
    pipe = make_plan(model, PlanOptions(world_size=4, batch_size=8, placement="block", trace_cache=False, pipeline=2,
                                        microbatches=M, stage_data=data, kinds=kinds or ("sample", "replicate"),
                                        pins=("blocks.*.attn=head", "blocks.*.fc=filter", "blocks.*.out=row_parallel")
                                        if kinds == TP_KINDS else (),
                                        out_dir=str(tmp_path / "pipe")), PlanHooks(profile=prof))
    st = pipe.plan.runtime.to_json()["stages"]["stages"]
    assert [(s["dp"], s.get("data", "replicate")) for s in st] == [(2, data), (2, data)]
    res = run_ranks(_clipped, 4, args=(str(pipe.plan_path), hf), timeout_s=180)
    ref = run_ranks(_clipped_reference, 1, args=(hf,), timeout_s=120)[0]
    assert ref["norm"] > 0.05                                  # the clip bites
    for r in res:
        assert r["norm"] == pytest.approx(ref["norm"], rel=1e-12)
        for n, g in r["grads"].items():
            torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(ref["grads"][n]), rtol=1e-12, atol=1e-14)


HF_ENV = {"AUTOPAR_HF_LAYERS": "4", "AUTOPAR_HF_EMBED": "16", "AUTOPAR_HF_HEADS": "4", "AUTOPAR_HF_SEQ": "8",
          "AUTOPAR_HF_VOCAB": "32"}


def _hf():
    from autopar.modelfile import load_model_file
    return load_model_file(ROOT / "strategies/examples/hf_gpt2.py")


def _hf_steps(rank, world, plan, ckpt_in, ckpt_out, n, pipeline):
    """HF GPT-2 under ``plan``: load model and AdamW (if given), ``n`` user-loop steps (with
    clipping), save both; the full state (plain plan) or None."""
    import torch
    import autopar
    from autopar.train import clip_grad_norm_, full_state_dict, load, save
    mf = _hf()
    torch.manual_seed(1)
    dm = autopar.parallelize(mf.build_model().double(), plan, **({"sync_module_states": False} if pipeline else {}))
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
    if ckpt_in:
        load(ckpt_in, dm, opt)
    x, y = mf.example_inputs(8)[0], mf.example_targets(8)
    for _ in range(n):
        opt.zero_grad()
        loss = dm.loss(x, y) if pipeline else mf.loss_fn()(dm(x), y)
        loss.backward()
        clip_grad_norm_(dm, 0.5)
        opt.step()
    if ckpt_out:
        save(ckpt_out, dm, opt)
    return {k: v.detach().numpy().copy() for k, v in full_state_dict(dm).items()} if not pipeline else None


def _hf_reference(rank, world, kinds):
    import torch
    from autopar.runtime.stages import reference_step
    mf = _hf()
    torch.manual_seed(1)
    model = mf.build_model().double()
    x, y = mf.example_inputs(8)[0], mf.example_targets(8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for k in kinds:
        opt.zero_grad()
        if k == "p":
            reference_step(model, x, y, mf.loss_fn(), M)
        else:
            mf.loss_fn()(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_hf_gpt2_fsdp_stages_train_and_checkpoint_with_its_tied_embedding(monkeypatch, tmp_path):
    """HF GPT-2 (embedding tied to the head, one on each stage) on two FSDP2 stages of dp 2 at
    world 4: 2 user-loop steps with clipping and AdamW, save -> a plain plan at world 1 loads
    model and optimizer, steps once -> equal in float64 to one process running the same 3 steps."""
    import torch

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    from autopar.runtime.launch import run_ranks
    for k, v in HF_ENV.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    model = ROOT / "strategies/examples/hf_gpt2.py"
    pipe = make_plan(model, PlanOptions(world_size=4, batch_size=8, placement="block", trace_cache=False, pipeline=2,
                                        microbatches=M, stage_data="fsdp", out_dir=str(tmp_path / "pipe")),
                     PlanHooks(profile=prof))
    plain = make_plan(model, PlanOptions(world_size=1, batch_size=8, placement="block", trace_cache=False,
                                         out_dir=str(tmp_path / "plain")), PlanHooks(profile=prof))
    c1 = str(tmp_path / "ck1")
    run_ranks(_hf_steps, 4, args=(str(pipe.plan_path), None, c1, 2, True), timeout_s=180)
    after = run_ranks(_hf_steps, 1, args=(str(plain.plan_path), c1, None, 1, False), timeout_s=180)[0]
    ref = run_ranks(_hf_reference, 1, args=("ppf",), timeout_s=120)[0]
    for n, want in ref.items():
        if n in after:
            torch.testing.assert_close(torch.from_numpy(after[n]), torch.from_numpy(want), rtol=1e-12, atol=1e-11)
    assert "transformer.wte.weight" in after


def _full_sd(rank, world, plan):
    """parallelize HF GPT-2 under a pipeline plan: full_state_dict against the single-process
    state_dict (tied alias included), then load_full_state_dict of other values and read back."""
    import torch
    import autopar
    from autopar.train import full_state_dict, load_full_state_dict
    mf = _hf()
    torch.manual_seed(1)
    model = mf.build_model().double()
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dm = autopar.parallelize(model, plan, sync_module_states=False)
    got = full_state_dict(dm)
    same = list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    other = {k: v + 0.5 if v.is_floating_point() else v for k, v in want.items()}
    load_full_state_dict(dm, other)
    back = full_state_dict(dm)
    return {"same": same, "keys": list(got), "round_trip": all(torch.equal(back[k], other[k]) for k in other)}


def test_full_state_dict_of_a_pipeline_plan_is_the_single_process_state_dict(monkeypatch, tmp_path):
    """HF GPT-2 on two FSDP2 stages of dp 2 at world 4: autopar.train.full_state_dict gives every
    rank the single-process state_dict (names, order, values; the head's alias of the tied
    embedding included), and load_full_state_dict puts one back into the stages."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    from autopar.runtime.launch import run_ranks
    for k, v in HF_ENV.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    pipe = make_plan(ROOT / "strategies/examples/hf_gpt2.py",
                     PlanOptions(world_size=4, batch_size=8, placement="block", trace_cache=False, pipeline=2,
                                 microbatches=M, stage_data="fsdp", out_dir=str(tmp_path / "pipe")),
                     PlanHooks(profile=prof))
    for r in run_ranks(_full_sd, 4, args=(str(pipe.plan_path),), timeout_s=180):
        assert r["same"] and r["round_trip"], r["keys"]
        assert "lm_head.weight" in r["keys"]
