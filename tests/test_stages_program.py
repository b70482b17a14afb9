"""Pipeline stages that run the solver's per-layer plan inside every stage (``--stage-data plan``,
``runtime.stage_program``): planned through ``autopar plan``'s planner, run with torch's schedules
on gloo in fresh ranks, against one process in float64.

Each rank computes the one-process reference (``runtime.stages.reference_step``: the same M
microbatches in order, the mean of their losses) on a copy of the model, runs its part of the
pipelined step, rebuilds every parameter its layers use whole over its stage's mesh
(``DistModel.full_grads`` / ``full_params``) and compares: the loss, every gradient, every
parameter after an SGD step, and batch-norm running statistics; tolerance 1e-12 relative + 1e-13
absolute (float64). What torch sent over each cut is checked against the plan's cut steps
(``check_cut_messages``). Then the user's loop (``autopar.parallelize``) with AdamW and
checkpoints moving to a plan without stages at another world size and back."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.dist
TOL = dict(rtol=1e-12, atol=1e-13)
CONV = ROOT / "strategies/examples/conv_blocks.py"
GPT = ROOT / "strategies/examples/gpt.py"
GPT_ENV = {"AUTOPAR_GPT_LAYERS": "4", "AUTOPAR_GPT_EMBED": "16", "AUTOPAR_GPT_HEADS": "4", "AUTOPAR_GPT_SEQ": "8",
           "AUTOPAR_GPT_VOCAB": "32"}
TP_PINS = ("blocks.*.attn=head", "blocks.*.fc=filter", "blocks.*.out=row_parallel")


def _plan(model, world, env, monkeypatch, out=None, **kw):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.profile import load_profile
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    return make_plan(model, PlanOptions(world_size=world, batch_size=8, placement="block", trace_cache=False,
                                        write=out is not None, out_dir=out, **kw), PlanHooks(profile=prof))


def _rank(rank, world, model_path, env, rt):
    """One pipelined step of the stage plan against the one-process reference (module docstring)."""
    import torch

    from autopar.decomp.stages import CutPlan, StageLayout
    from autopar.modelfile import load_model_file, model_env
    from autopar.runtime.stage_program import build_program_runner
    from autopar.runtime.stages import check_cut_messages, record_sends, reference_step
    with model_env(env):
        mf = load_model_file(model_path)
    layout = StageLayout.from_json(rt["stages"])
    m = layout.schedule.microbatches
    torch.manual_seed(0)
    model = mf.build_model().double()
    x = mf.example_inputs(8)[0]
    x = x.double() if x.is_floating_point() else x
    y = mf.example_targets(8)
    ref = copy.deepcopy(model)
    ref_loss = reference_step(ref, x, y, mf.loss_fn(), m)
    runner = build_program_runner(model, layout, rt["stage_plan"], rank, mf.loss_fn())
    sends = record_sends(runner)
    loss = runner.step(x, y)
    # bytes too where every value is floating (float64 here); shapes only with a mask over the cut
    floating = all(v["itemsize"] == 4 for c in rt["cuts"] for v in c["values"])
    n_msgs = check_cut_messages(runner, sends, [CutPlan.from_json(c) for c in rt["cuts"]],
                                itemsize=8 if floating else None)
    dm = runner.dm
    grads = dm.full_grads()
    torch.optim.SGD(list(runner.parameters()), lr=0.1).step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    params, bufs = dm.full_params(), dm.full_buffers()
    ref_p, ref_b = dict(ref.named_parameters()), dict(ref.named_buffers())
    bad = []
    for what, mine, want in (("grad", grads, {n: p.grad for n, p in ref.named_parameters()}), ("param", params, ref_p),
                             ("buffer", {n: b for n, b in bufs.items() if "running" in n}, ref_b)):
        for n, t in mine.items():
            if not torch.allclose(t, want[n].detach().to(t.dtype), **TOL):
                bad.append(f"{what} {n}: max diff {float((t - want[n].detach()).abs().max()):.3g}")
    return {"loss": float(loss), "ref": float(ref_loss), "bad": bad, "params": sorted(params),
            "running": sorted(n for n in bufs if "running" in n), "messages": n_msgs}


def _check(res, model_params):
    for r in res:
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-12)
        assert not r["bad"], r["bad"]
    held = {n for r in res for n in r["params"]}
    assert held == set(model_params), set(model_params) ^ held      # every parameter checked on some stage


def _run(world, model, env, rt):
    from autopar.runtime.launch import run_ranks
    return run_ranks(_rank, world, args=(str(model), env, rt), timeout_s=180)


def _param_names(model, env):
    from autopar.modelfile import load_model_file, model_env
    with model_env(env):
        return [n for n, _ in load_model_file(model).build_model().named_parameters()]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tensor_parallel_layers_inside_stages_at_world_4(monkeypatch, schedule):
    """Two stages of two ranks, each running the solver's plan with attention heads, the MLP's
    filters and its row-parallel output split over its two ranks (pinned: the solver on this CPU
    profile would keep them data parallel)."""
    res = _plan(GPT, 4, GPT_ENV, monkeypatch, pipeline=2, stage_data="plan", schedule=schedule, microbatches=2,
                pins=TP_PINS)
    rt = res.plan.runtime.to_json()
    kinds = {c.split("(")[0] for c in rt["stage_plan"]["choices"]}
    assert {"head", "filter", "row_parallel"} <= kinds
    assert [s["data"] for s in rt["stages"]["stages"]] == ["plan", "plan"]
    out = _run(4, GPT, GPT_ENV, rt)
    _check(out, _param_names(GPT, GPT_ENV))
    assert sum(r["messages"] for r in out) == 2 * 2      # stage 0's two ranks, one value, two microbatches


def test_spatial_layers_with_batch_norm_and_two_crossing_values_at_world_4(monkeypatch):
    """Convolutions split by height inside each stage (halos on the stage's own ranks), global
    batch-norm statistics per microbatch (running statistics checked), and a long skip from the
    stem to the head: two values cross the cut, one of them produced before stage 0's blocks and
    read only on stage 1."""
    env = {"AUTOPAR_CONV_BN": "1", "AUTOPAR_CONV_SKIP": "1"}
    res = _plan(CONV, 4, env, monkeypatch, pipeline=2, stage_data="plan", microbatches=2, pins=("blocks.*=spatial",),
                batch_norm="global")
    rt = res.plan.runtime.to_json()
    assert any(c.startswith("spatial") for c in rt["stage_plan"]["choices"])
    (cut,) = rt["cuts"]
    assert len(cut["values"]) == 2
    out = _run(4, CONV, env, rt)
    _check(out, _param_names(CONV, env))
    assert {n for r in out for n in r["running"]} >= {"blocks.0.bn.running_mean", "blocks.3.bn.running_var"}


def test_hugging_face_gpt2_with_heads_a_tied_embedding_and_a_mask_over_the_cut_at_world_4(monkeypatch):
    """Hugging Face GPT-2: attention heads split inside each stage, its token embedding tied to the
    head on the last stage (their gradient parts summed over the two stages' peers), and two
    values over the cut: the residual stream and the attention mask made before the blocks (an
    ``expand``ed view, sent contiguous)."""
    gpt2 = ROOT / "strategies/examples/hf_gpt2.py"
    res = _plan(gpt2, 4, {}, monkeypatch, pipeline=2, stage_data="plan", microbatches=2, pins=("*.attn=head",))
    rt = res.plan.runtime.to_json()
    assert any(c.startswith("head") for c in rt["stage_plan"]["choices"])
    (cut,) = rt["cuts"]
    assert len(cut["values"]) == 2
    out = _run(4, gpt2, {}, rt)
    _check(out, _param_names(gpt2, {}))


def test_hugging_face_llama_rotary_tables_cross_in_their_own_dtype_at_world_2(monkeypatch):
    """Hugging Face Llama: its rotary tables are made once before the layers, in float32 even in a
    float64 run (the traced program casts explicitly), and cross the cut beside the residual
    stream and the mask; each crosses widened to the run's dtype (``wire_dtype``), which the
    receiving stage's buffers have (it read float32 bytes as float64 before: NaN losses)."""
    llama = ROOT / "strategies/examples/hf_llama.py"
    res = _plan(llama, 2, {}, monkeypatch, pipeline=2, stage_data="plan", microbatches=2)
    rt = res.plan.runtime.to_json()
    (cut,) = rt["cuts"]
    assert len(cut["values"]) >= 3
    _check(_run(2, llama, {}, rt), _param_names(llama, {}))


def test_interleaved_chunks_and_a_model_the_block_runtime_cannot_cut_at_world_2(monkeypatch):
    """torch's TransformerEncoder (no (pre, blocks, post) the block runtime knows): --pipeline 2
    plans its stages with the solver's plan by default, run here under interleaved 1F1B (two
    chunks per rank, three chunk cuts, the middle one between the two ranks' second chunks)."""
    enc, env = ROOT / "strategies/examples/torch_encoder.py", {"AUTOPAR_ENC_LAYERS": "4", "AUTOPAR_ENC_CAUSAL": "1"}
    res = _plan(enc, 2, env, monkeypatch, pipeline=2, schedule="interleaved_1f1b", microbatches=2)
    rt = res.plan.runtime.to_json()
    assert rt["stages"]["schedule"]["virtual"] == 2 and len(rt["cuts"]) == 3
    out = _run(2, enc, env, rt)
    _check(out, _param_names(enc, env))


def _loop(rank, world, plan, env, model, ckpt_in, ckpt_out, n, pipeline):
    """``n`` user-loop steps with AdamW under ``plan`` after loading model and optimizer from
    ``ckpt_in`` (if given); save both; the full state dict (numpy)."""
    import torch

    import autopar
    from autopar.modelfile import load_model_file, model_env
    from autopar.train import full_state_dict, load, save, shard_batch
    with model_env(env):
        mf = load_model_file(model)
    torch.manual_seed(1)
    dm = autopar.parallelize(mf.build_model().double(), plan)
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
    if ckpt_in:
        load(ckpt_in, dm, opt)
    x, y = mf.example_inputs(8)[0].double(), mf.example_targets(8)
    for _ in range(n):
        opt.zero_grad()
        if pipeline:                 # the schedule's step: every rank passes the whole batch
            loss = dm.loss(x, y)
        else:                        # a plan without stages: this rank's share of the batch
            xs, t = shard_batch(dm, x, y)
            loss = dm.loss(xs, t)
        loss.backward()
        opt.step()
    save(ckpt_out, dm, opt)
    return {k: v.detach().numpy().copy() for k, v in full_state_dict(dm).items()}


def _reference_loop(rank, world, env, model, kinds):
    """One process: AdamW over ``kinds`` ("p": the pipelined step's function, mean over M = 2
    microbatches; "f": the whole batch) from the same initial values."""
    import torch

    from autopar.modelfile import load_model_file, model_env
    from autopar.runtime.stages import reference_step
    with model_env(env):
        mf = load_model_file(model)
    torch.manual_seed(1)
    net = mf.build_model().double()
    x, y = mf.example_inputs(8)[0].double(), mf.example_targets(8)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for k in kinds:
        opt.zero_grad()
        if k == "p":
            reference_step(net, x, y, mf.loss_fn(), 2)
        else:
            mf.loss_fn()(net(x), y).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def test_user_loop_and_checkpoints_round_trip_through_a_plain_plan(monkeypatch, tmp_path):
    """Stage plans at world 4 (spatial convolutions inside two stages): AdamW 2 steps in the user's
    loop, save -> a plan without stages at world 2 loads model and optimizer, steps once, saves ->
    the stage plans load it (cutting their shards), step once, save -> the plain plan reads it.
    Equal in float64 to one process running the same 4 steps (only so if Adam's moments crossed
    every checkpoint)."""
    import torch

    from autopar.runtime.launch import run_ranks
    env = {"AUTOPAR_CONV_SKIP": "1"}
    pipe = _plan(CONV, 4, env, monkeypatch, out=str(tmp_path / "pipe"), pipeline=2, stage_data="plan",
                 microbatches=2, pins=("blocks.*=spatial",))
    plain = _plan(CONV, 2, env, monkeypatch, out=str(tmp_path / "plain"))
    assert pipe.plan.runtime.expected == "stages" and (plain.plan.runtime is None or
                                                       plain.plan.runtime.expected != "stages")
    p, f = str(pipe.plan_path), str(plain.plan_path)
    c1, c2, c3, c4 = (str(tmp_path / f"ck{i}") for i in range(1, 5))
    run_ranks(_loop, 4, args=(p, env, str(CONV), None, c1, 2, True), timeout_s=180)
    run_ranks(_loop, 2, args=(f, env, str(CONV), c1, c2, 1, False), timeout_s=180)
    mid = run_ranks(_loop, 4, args=(p, env, str(CONV), c2, c3, 1, True), timeout_s=180)
    after = run_ranks(_loop, 2, args=(f, env, str(CONV), c3, c4, 0, False), timeout_s=180)[0]
    ref = run_ranks(_reference_loop, 1, args=(env, str(CONV), "ppfp"), timeout_s=120)[0]
    for n, want in ref.items():
        torch.testing.assert_close(torch.from_numpy(after[n]), torch.from_numpy(want), rtol=1e-12, atol=1e-11)
        torch.testing.assert_close(torch.from_numpy(mid[0][n]), torch.from_numpy(want), rtol=1e-12, atol=1e-11)
    stale = run_ranks(_reference_loop, 1, args=(env, str(CONV), "ppf"), timeout_s=120)[0]
    assert any(not (stale[n] == ref[n]).all() for n in ref)
