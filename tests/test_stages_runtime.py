"""Pipeline stages run with torch's schedules on gloo against one process, in float64: outputs
(the loss), every gradient and the parameters after an AdamW step (issue 41 item 5); and what
torch's PipelineStage sends over each cut, per rank pair and microbatch, is what the plan's cut
steps (``decomp.stages.plan_cuts``) say: shapes and bytes (``runtime.stages.check_cut_messages``).

Each rank builds the model from the same seed, computes the one-process reference
(``reference_step``: the same microbatches, the mean of their losses) on a copy, runs its part of
the pipelined step and compares the parameters it holds (its tp slice of them) with the
reference's. Tolerance in float64: loss and gradients 1e-12 relative + 1e-13 absolute; parameters
after AdamW 1e-12 relative + 1e-11 absolute, because AdamW divides by sqrt(v): a gradient that is
zero analytically (attention's key bias) turns its rounding noise (1e-17) into an lr-sized step
whose sign is noise; seen: 8.5e-13."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from autopar.modelfile import model_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.dist
TOL = dict(rtol=1e-12, atol=1e-13)
PARAM_TOL = dict(rtol=1e-12, atol=1e-11)


def _load_gpt(layers: int):
    env = {"AUTOPAR_GPT_LAYERS": str(layers), "AUTOPAR_GPT_EMBED": "16", "AUTOPAR_GPT_HEADS": "4",
           "AUTOPAR_GPT_SEQ": "8", "AUTOPAR_GPT_VOCAB": "32"}
    with model_env(env):
        spec = importlib.util.spec_from_file_location(f"_gpt_stages_{layers}", ROOT / "strategies/examples/gpt.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


def _two_value_model(layers: int):
    """Blocks that pass two values on (a residual stream and a gate stream both updated by every
    block), so that every cut is crossed by two tensors, each with its gradient."""
    import torch
    from torch import nn

    class Blk(nn.Module):
        returns_all_values = True

        def __init__(self):
            super().__init__()
            self.a, self.g = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, gate):
            return x + torch.tanh(self.a(x)) * torch.sigmoid(gate), gate + self.g(x)

    class Pre(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 8)

        def forward(self, x):
            h = self.inp(x)
            return h, h * 0.5

    class Post(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(8, 3)

        def forward(self, x, gate):
            return self.out(x * gate)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.blocks, self.post = Pre(), nn.ModuleList(Blk() for _ in range(layers)), Post()

        def pipeline_parts(self):
            return self.pre, list(self.blocks), self.post

        def forward(self, x):
            v = self.pre(x)
            for b in self.blocks:
                v = b(*v)
            return self.post(*v)

    return Net()


def _bn_model(layers: int):
    """Blocks with batch norm: statistics per microbatch (the stated semantics); the toy model
    file ``tests/toys/bn_blocks.py`` (its ``LAYERS`` blocks)."""
    spec = importlib.util.spec_from_file_location("_bn_blocks", ROOT / "tests/toys/bn_blocks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.LAYERS == layers
    return mod.build_model()


def _case(rank, world, kind, schedule, stages, tp, microbatches, batch, data="replicate", virtual=1):
    import torch
    import torch.nn.functional as F

    from autopar.decomp.stages import CutValue, Schedule, chunk_holder, even_layout, plan_cuts
    from autopar.runtime.dtensor import whole
    from autopar.runtime.stages import build_runner, check_cut_messages, record_sends, reference_step, shard_of

    torch.manual_seed(0)
    heads = None
    if kind == "gpt":
        gpt = _load_gpt(layers=4)
        model = gpt.GPT().double()
        x = torch.randint(0, 32, (batch, 8))
        y = torch.randint(0, 32, (batch, 8))
        loss_fn, heads = gpt.loss_fn, 4
    elif kind == "hf_gpt2":     # Hugging Face GPT-2: its embedding is tied to the head (stages 0 and 1)
        from autopar.modelfile import load_model_file
        with model_env({"AUTOPAR_HF_LAYERS": "4", "AUTOPAR_HF_EMBED": "16", "AUTOPAR_HF_HEADS": "4",
                        "AUTOPAR_HF_SEQ": "8", "AUTOPAR_HF_VOCAB": "32"}):
            mf = load_model_file(ROOT / "strategies/examples/hf_gpt2.py")
            model = mf.build_model().double()
            x, y = mf.example_inputs(batch)[0], mf.example_targets(batch)
        loss_fn = mf.loss_fn()
    elif kind == "hf_llama":    # Hugging Face Llama: rotary tables and causal mask made again in each block
        from autopar.modelfile import load_model_file
        with model_env({"AUTOPAR_HF_LAYERS": "4", "AUTOPAR_HF_EMBED": "16", "AUTOPAR_HF_HEADS": "4",
                        "AUTOPAR_HF_KV_HEADS": "2", "AUTOPAR_HF_SEQ": "8", "AUTOPAR_HF_VOCAB": "32"}):
            mf = load_model_file(ROOT / "strategies/examples/hf_llama.py")
            model = mf.build_model().double()
            x, y = mf.example_inputs(batch)[0], mf.example_targets(batch)
        loss_fn = mf.loss_fn()
    elif kind == "two_values":
        model = _two_value_model(4).double()
        x, y = torch.randn(batch, 4, dtype=torch.float64), torch.randint(0, 3, (batch,))
        loss_fn = F.cross_entropy
    else:
        model = _bn_model(4).double()
        x, y = torch.randn(batch, 4, dtype=torch.float64), torch.randint(0, 2, (batch,))
        loss_fn = F.cross_entropy
    layout = even_layout(4, world, stages, Schedule(schedule, microbatches, virtual), tp=tp, data=data)
    st = layout.stage_of(rank)

    ref = copy.deepcopy(model)
    ref_loss = reference_step(ref, x, y, loss_fn, microbatches, dp=st.dp)
    ref_params = dict(ref.named_parameters())
    ref_grads = {k: p.grad.clone() for k, p in ref_params.items()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.step()

    runner = build_runner(model, layout, rank, loss_fn, heads=heads,
                          example_microbatch=x[:batch // st.dp // microbatches])
    # the plan's cut steps for these values (float64): what torch must send per rank pair
    mb_rows = st.dp * (batch // st.dp // microbatches)
    shapes = {"gpt": [(mb_rows, 8, 16)], "hf_gpt2": [(mb_rows, 8, 16)], "hf_llama": [(mb_rows, 8, 16)],
              "two_values": [(mb_rows, 8), (mb_rows, 8)],
              "bn": [(mb_rows, 6)]}[kind]
    n_cuts = stages * layout.schedule.virtual - 1
    cuts = plan_cuts(layout, [[CutValue(f"v{i}", sh, 8) for i, sh in enumerate(shapes)]] * n_cuts)
    sends = record_sends(runner)
    sharded = {}
    if st.tp > 1:
        sharded = {f"blocks.{i}.{n}": (d, b, runner.groups.coords[1]) for i in range(4)
                   for n, (d, b) in {"attn.qkv.weight": (0, 3), "attn.qkv.bias": (0, 3), "attn.proj.weight": (1, 1),
                                     "fc.weight": (0, 1), "fc.bias": (0, 1), "out.weight": (1, 1)}.items()}
    loss = runner.step(x, y)
    checked = check_cut_messages(runner, sends, cuts, itemsize=8)
    held = runner.held_parameters(model)     # FSDP2 stages: DTensor shards, gathered by ``whole``
    assert len(held) == len(list(runner.parameters()))
    opt = torch.optim.AdamW(list(runner.parameters()), lr=1e-2)
    grads = {n: whole(p.grad).clone() for n, p in held.items()}
    opt.step()
    bad = []
    torch.testing.assert_close(loss, ref_loss.to(torch.float64), **TOL)
    for n, p in held.items():
        want_g, want_p = ref_grads[n], ref_params[n].detach()
        if n in sharded:
            want_g, want_p = shard_of(want_g, sharded[n], st.tp), shard_of(want_p, sharded[n], st.tp)
        for what, got, want, tol in (("grad", grads[n], want_g, TOL), ("param", whole(p.detach()), want_p, PARAM_TOL)):
            if not torch.allclose(got, want, **tol):
                bad.append(f"{what} {n}: max diff {(got - want).abs().max().item():.3g}")
    if kind == "bn":   # running statistics: updated once per microbatch, in order, like the reference
        rb = dict(ref.named_buffers())
        for n, b in model.named_buffers():
            if any(b is q for _, m in runner.modules for q in m.buffers()) \
                    and not torch.allclose(b.double(), rb[n].double(), **TOL):
                bad.append(f"buffer {n}: {b.double().sum().item()} vs {rb[n].double().sum().item()}")
    from torch.distributed.tensor import DTensor
    return {"rank": rank, "stage": st.index, "params": len(held), "bad": bad, "loss": float(loss),
            "cut_messages_checked": checked, "values": len(shapes), "sending_chunks": sum(
                1 for c, _ in runner.modules if c < n_cuts and chunk_holder(layout, c + 1) != st.index),
            "dtensors": sum(isinstance(p, DTensor) for p in held.values())}


def _run(world, kind, schedule, stages, tp=1, microbatches=4, batch=8, data="replicate", virtual=1):
    from autopar.runtime.launch import run_ranks
    res = run_ranks(_case, world, args=(kind, schedule, stages, tp, microbatches, batch, data, virtual), timeout_s=120)
    for r in res:     # FSDP2 stages hold every parameter as a DTensor shard, replicated ones none
        mine = data if isinstance(data, str) else data[r["stage"]]
        assert r["dtensors"] == (r["params"] if mine == "fsdp" else 0), r
    for r in res:
        assert r["bad"] == [], r
        assert r["params"] > 0, r
    assert len({r["loss"] for r in res}) == 1, res       # the global loss on every rank
    for r in res:   # every chunk sending to another rank group sent M microbatches of every value, as planned
        assert r["cut_messages_checked"] == r["sending_chunks"] * microbatches * r["values"], r
        assert virtual > 1 or r["sending_chunks"] == (0 if r["stage"] == stages - 1 else 1), r
    return res


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_two_stages_world_2(schedule):
    _run(2, "gpt", schedule, 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_two_stages_with_data_parallelism_inside_world_4(schedule):
    res = _run(4, "gpt", schedule, 2)
    assert [r["stage"] for r in res] == [0, 0, 1, 1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_two_stages_with_tensor_parallelism_inside_world_4(schedule):
    _run(4, "gpt", schedule, 2, tp=2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_two_stages_with_fsdp_inside_world_4(schedule):
    """Each stage's dp pair shards its parameters, gradients and AdamW state with FSDP2
    (``Stage.data == "fsdp"``): the same loss, gradients and parameters after the step."""
    _run(4, "gpt", schedule, 2, data="fsdp")


@pytest.mark.parametrize("world,data", [(2, "replicate"), (4, "fsdp")])
def test_hf_llama_on_two_stages(world, data):
    """Hugging Face Llama cut between its decoder layers: only the hidden states cross the cut
    (each block makes the rotary tables and the causal mask again), the same function."""
    _run(world, "hf_llama", "1f1b", 2, data=data)


def _accumulated(rank, world, data):
    """Two pipelined steps without zero_grad on HF GPT-2 (its embedding tied across the stages):
    the gradients are the sum of both steps', as one process accumulates them."""
    import torch

    from autopar.decomp.stages import Schedule, even_layout
    from autopar.modelfile import load_model_file
    from autopar.runtime.dtensor import whole
    from autopar.runtime.stages import build_runner, reference_step
    with model_env({"AUTOPAR_HF_LAYERS": "4", "AUTOPAR_HF_EMBED": "16", "AUTOPAR_HF_HEADS": "4",
                    "AUTOPAR_HF_SEQ": "8", "AUTOPAR_HF_VOCAB": "32"}):
        mf = load_model_file(ROOT / "strategies/examples/hf_gpt2.py")
        torch.manual_seed(0)
        model = mf.build_model().double()
        x, y = mf.example_inputs(8)[0], mf.example_targets(8)
    loss_fn = mf.loss_fn()
    layout = even_layout(4, world, 2, Schedule("1f1b", 4), data=data)
    st = layout.stage_of(rank)
    ref = copy.deepcopy(model)
    want = float(reference_step(ref, x, y, loss_fn, 4, dp=st.dp)) + float(
        reference_step(ref, x.flip(0), y.flip(0), loss_fn, 4, dp=st.dp))
    ref_g = {n: p.grad for n, p in ref.named_parameters()}
    runner = build_runner(model, layout, rank, loss_fn, example_microbatch=x[:8 // st.dp // 4])
    got = float(runner.step(x, y)) + float(runner.step(x.flip(0), y.flip(0)))
    bad = [n for n, p in runner.held_parameters(model).items()
           if not torch.allclose(whole(p.grad), ref_g[n], **TOL)]
    return {"bad": bad, "loss": got, "want": want}


@pytest.mark.parametrize("world,data", [(2, "replicate"), (4, "fsdp")])
def test_gradients_accumulate_over_steps_without_zero_grad(world, data):
    """Each microbatch's loss is divided by M before backward (not torch's scale_grads, which
    divides the whole .grad after a step and so the gradient left by the step before), and a
    tied weight's parts are summed for this step only: two steps add up as in one process."""
    from autopar.runtime.launch import run_ranks
    for r in run_ranks(_accumulated, world, args=(data,), timeout_s=120):
        assert r["bad"] == [] and r["loss"] == pytest.approx(r["want"], rel=1e-12), r


def test_fsdp_and_tensor_parallelism_inside_stages_world_8():
    """Two stages of dp 2 x tp 2: Megatron's split over tp, then FSDP2 over dp cuts each tp
    shard again (torchtitan's order); every tp slice of every gradient and parameter (gathered
    over dp) against one process."""
    res = _run(8, "gpt", "1f1b", 2, tp=2, data="fsdp")
    assert all(r["dtensors"] == r["params"] for r in res)


def test_fsdp_stages_with_two_chunks_per_rank_world_4():
    """Interleaved 1F1B, V = 2 chunks per rank, each chunk its own FSDP2 root over the dp pair."""
    _run(4, "gpt", "interleaved_1f1b", 2, data="fsdp", virtual=2)


def _zero_bubble_fsdp(rank, world):
    import torch

    from autopar.decomp.stages import Schedule, even_layout
    from autopar.errors import PipelineError
    from autopar.runtime.stages import build_runner
    gpt = _load_gpt(layers=4)
    model = gpt.GPT().double()
    layout = even_layout(4, world, 2, Schedule("zbv", 4, 2), data="fsdp")
    try:
        build_runner(model, layout, rank, gpt.loss_fn, example_microbatch=torch.randint(0, 32, (1, 8)))
    except PipelineError as e:
        return str(e)
    return "built"


def test_fsdp_stages_under_a_zero_bubble_schedule_are_refused_by_name():
    """torch's split backward (input / weight steps) leaves FSDP2's sharded parameters without
    gradients: every rank refuses before the first step, naming the schedule."""
    from autopar.runtime.launch import run_ranks
    res = run_ranks(_zero_bubble_fsdp, 4, timeout_s=120)
    assert all("zbv" in r and "FSDP2" in r for r in res), res


def test_fsdp_on_the_first_stage_only_world_4():
    """Stage 0 FSDP2, stage 1 replicated (the search's "mixed" option): the same function."""
    _run(4, "gpt", "1f1b", 2, data=("fsdp", "replicate"))


def test_hf_gpt2_tied_embedding_with_fsdp_stages_world_4():
    """The embedding tied to the head, on two FSDP2 stages of dp 2: each holds the same rows of
    it, so the tied gradient's parts are summed shard by shard."""
    _run(4, "hf_gpt2", "1f1b", 2, data="fsdp")


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_two_chunks_per_rank_send_what_the_chunk_cuts_say(schedule):
    """V = 2 chunks per rank at world 2 (looped and V-shaped): the same function as one process,
    and every chunk's sends are the plan's chunk cut (``plan_cuts``) for its rank pair."""
    res = _run(2, "gpt", schedule, 2, virtual=2)
    assert sum(r["sending_chunks"] for r in res) == (3 if schedule == "interleaved_1f1b" else 2)


def test_gpt_four_stages_world_4():
    _run(4, "gpt", "1f1b", 4)


def test_hf_gpt2_with_its_tied_embedding_on_two_stages():
    _run(2, "hf_gpt2", "1f1b", 2)


@pytest.mark.parametrize("world,schedule", [(2, "1f1b"), (4, "gpipe")])
def test_cut_crossed_by_two_values(world, schedule):
    """Two values cross the cut (world 4: two stages of dp 2), each sent as the plan's cut steps say."""
    _run(world, "two_values", schedule, 2)


@pytest.mark.parametrize("data", ["replicate", "fsdp"])
def test_batch_norm_running_statistics_with_data_parallel_stages_world_4(data):
    """Two stages of dp 2: each replica updates its running statistics over its own microbatches
    from the same start, and the step ends with their mean (reference_step(dp=2) does the same);
    the gradients are the whole batch's."""
    _run(4, "bn", "gpipe", 2, batch=16, data=data)


def test_batch_norm_statistics_per_microbatch():
    _run(2, "bn", "gpipe", 2)


class _Dies(RuntimeError):
    pass


def _dying(rank, world):
    """Rank 1 (the last stage) raises in its third microbatch's forward; rank 0 is then blocked in
    the schedule's point-to-point receive of that microbatch's gradient."""
    import torch

    from autopar.decomp.stages import Schedule, even_layout
    from autopar.runtime.stages import build_runner
    torch.manual_seed(0)
    gpt = _load_gpt(layers=4)
    model = gpt.GPT().double()
    x, y = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    runner = build_runner(model, even_layout(4, world, 2, Schedule("1f1b", 4)), rank, gpt.loss_fn,
                          example_microbatch=x[:2])
    if rank == 1:
        calls = {"n": 0}

        def boom(mod, args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise _Dies("rank 1 stopped mid-schedule")
        runner.modules[0][1].register_forward_pre_hook(boom)
    runner.step(x, y)


def test_a_rank_that_dies_mid_schedule_is_named_and_nobody_hangs():
    import time

    from autopar.errors import RankFailure
    from autopar.runtime.launch import run_ranks
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"^rank 1 failed"):
        run_ranks(_dying, 2, timeout_s=60)
    assert time.monotonic() - t0 < 30


def _killed(rank, world, victim):
    """Rank ``victim`` exits on the spot (os._exit: no report, no error) when its stage starts
    its second microbatch's forward; the others are then mid-schedule."""
    import os

    import torch

    from autopar.decomp.stages import Schedule, even_layout
    from autopar.runtime.stages import build_runner
    torch.manual_seed(0)
    gpt = _load_gpt(layers=4)
    model = gpt.GPT().double()
    x, y = torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8))
    runner = build_runner(model, even_layout(4, world, 4, Schedule("1f1b", 4)), rank, gpt.loss_fn,
                          example_microbatch=x[:2])
    if rank == victim:
        calls = {"n": 0}

        def die(mod, args):
            calls["n"] += 1
            if calls["n"] == 2:
                os._exit(3)
        runner.modules[0][1].register_forward_pre_hook(die)
    runner.step(x, y)


@pytest.mark.parametrize("victim", [2, 0])
def test_a_rank_killed_mid_schedule_is_named_by_every_other_rank_world_4(victim):
    """Four stages at world 4; one rank exits without a word after its first microbatch. Every
    rank stops within the time-out, and each survivor's own error (as the launcher collects it)
    is a PeerFailure naming the dead rank, not a bare closed connection."""
    import time

    from autopar.errors import RankFailure
    from autopar.runtime.launch import run_ranks
    timeout_s = 60
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=rf"^rank {victim} failed: died") as info:
        run_ranks(_killed, 4, args=(victim,), timeout_s=timeout_s)
    assert time.monotonic() - t0 < timeout_s
    errs = info.value.rank_errors
    assert sorted(errs) == [0, 1, 2, 3], errs
    assert "without reporting" in errs[victim]
    for r in sorted(set(errs) - {victim}):
        first = errs[r].splitlines()[0]
        assert first.startswith("PeerFailure: ") and f"rank {victim} died without reporting" in first, (r, errs[r])
        assert f"rank {r})" in first                    # and says where this rank was
