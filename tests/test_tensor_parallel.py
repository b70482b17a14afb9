"""Megatron-style tensor parallelism (``autopar.decomp.tensor_parallel``): head-parallel
attention (fused q|k|v of the shipped GPT, separate q/k/v with grouped KV heads of a Llama-style
model), sequence parallelism, vocabulary-parallel embedding, each alone and mixed with data
parallelism on a 2-D (sample x tensor) mesh. Every distributed run is checked by the validation
``autopar execute`` uses: output, loss, every parameter gradient and every parameter after one
SGD step against one process in float64 (``max|a-b| <= 1e-9 max|ref| + 1e-12`` per tensor)."""

import os
from pathlib import Path

import pytest

from autopar.decomp.base import ParamShard
from autopar.decomp.sharding import Sharding, Shard

LLAMA = Path(__file__).resolve().parent / "tp_llama.py"


def _graph(model, batch=4):
    from autopar.modelfile import load_model_file
    from autopar.planner import attention_units
    from autopar.trace.tracer import trace_model
    return attention_units(trace_model(load_model_file(model), batch))


def _index(graph, module, nth=0):
    return [lay.index for lay in graph.layers if lay.module == module][nth]


def _plan(model, tmp_path, profile, world, force, batch=4, **kw):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    g = _graph(model, batch)
    pins = {(_index(g, *k) if isinstance(k, tuple) else _index(g, k)): v for k, v in force.items()}
    kw.setdefault("max_candidates", 30)     # keep vocab_head, which the pruner ranks behind filter
    return make_plan(model, PlanOptions(world_size=world, batch_size=batch, out_dir=str(tmp_path / f"plan{world}"), **kw),
                     PlanHooks(profile=profile, force=pins))


def _execute(r, tmp_path):
    from autopar.execute.runner import ExecuteOptions, execute
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=240, ddp=False),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures
    names = {c.tensor for c in run.validation.checks}
    return run, names


@pytest.fixture
def llama_env(monkeypatch):
    def set_sizes(heads, kv):
        monkeypatch.setenv("AUTOPAR_LLAMA_HEADS", str(heads))
        monkeypatch.setenv("AUTOPAR_LLAMA_KV_HEADS", str(kv))
    return set_sizes


# ---- plan-time logic, no process ------------------------------------------------------------

def test_segmented_param_shard_takes_each_ranks_heads_of_every_segment():
    import torch
    sh = ParamShard.on(Sharding.of((Shard(0), 2), (Shard(1), 2)), ((0, 1),), (4, 4, 4))
    w = torch.arange(12 * 3).reshape(12, 3)
    rows = [sh.index(w.shape, r, 4)[0] for r in range(4)]
    assert rows[0] == rows[2] == [0, 1, 4, 5, 8, 9] and rows[1] == rows[3] == [2, 3, 6, 7, 10, 11]
    assert sh.local_shape(w.shape, 1, 4) == (6, 3) and sh.grad_group(1, 4) == [1, 3]
    full = torch.zeros_like(w)
    for r in (0, 1):
        full[sh.index(w.shape, r, 4)] = w[sh.index(w.shape, r, 4)]
    assert torch.equal(full, w)
    with pytest.raises(ValueError, match="segmented"):
        sh.local_bounds(w.shape, 0, 4)


def test_attention_blocks_are_found_and_planned_as_units(root):
    g = _graph(root / "strategies/examples/gpt.py")
    units = [lay for lay in g.layers if any(op.kind == "attention" for op in lay.ops)]
    assert [u.module for u in units] == ["blocks.0.attn", "blocks.1.attn"]
    assert units[0].ops[0].module == "blocks.0.attn.qkv" and units[0].ops[-1].module == "blocks.0.attn.proj"
    assert [u.module for u in _graph(LLAMA).layers if any(op.kind == "attention" for op in u.ops)] == ["blocks.0.attn"]


def test_head_parallel_finds_the_fused_qkv_segments(root, profile):
    from autopar.decomp.base import CostContext
    from autopar.decomp.tensor_parallel.heads import HeadParallel
    g = _graph(root / "strategies/examples/gpt.py")
    unit = g.layers[_index(g, "blocks.0.attn")]
    ctx = CostContext(profile=profile, world=4, ranks_per_node=4)
    cands = {str(c): c for c in HeadParallel.candidates(unit, ctx)}
    assert set(cands) == {"head(2,2)", "head(1,4)"}
    h = cands["head(1,4)"]
    assert (h.row, h.fused, h.segments) == ("proj", "qkv", (32, 32, 32))
    assert h.check(unit, ctx) is None
    big = CostContext(profile=profile, world=1024, ranks_per_node=8)    # the tensor axis stays on a node
    cands_big = HeadParallel.candidates(unit, big)
    assert [str(c) for c in cands_big] == ["head(512,2)", "head(256,4)", "head(128,8)"]
    assert "4 attention heads are not divisible by 8" in cands_big[-1].check(unit, big)
    qkv = unit.ops[0]
    assert h.param_shard(qkv, "weight").local_shape(qkv.params["weight"], 3, 4) == (24, 32)
    # sharded parameters, gradients and optimizer state: 1/4 of the projections' (the output
    # bias whole), and saved activations of the local heads only
    c1, c4 = cands["head(2,2)"].cost(unit, ctx), h.cost(unit, ctx)
    item = unit.itemsize
    w_all = sum(math_prod(s) for op in unit.ops for s in op.params.values()) * item
    assert c4.param_bytes == pytest.approx((w_all - 32 * item) / 4 + 32 * item)
    assert c4.param_bytes < c1.param_bytes < w_all
    from autopar.decomp.common import price_replicated_weights
    whole = price_replicated_weights(unit, Sharding(), ctx)
    assert c4.activation_bytes < whole.activation_bytes and c1.activation_bytes < whole.activation_bytes


def math_prod(shape):
    import math
    return math.prod(shape)


def test_split_that_the_unit_cannot_take_is_rejected_at_plan_time(llama_env, tmp_path, profile):
    from autopar.errors import AutoparError
    llama_env(4, 2)                  # 2 KV heads cannot be split 4 ways
    with pytest.raises(AutoparError, match=r"blocks\.0\.attn: head parallelism over 4: 2 key/value heads"):
        _plan(LLAMA, tmp_path, profile, 4, {"blocks.0.attn": "head(1,4)"})
    llama_env(4, 4)                  # 4 query heads cannot be split 8 ways: no candidate at all
    from autopar.decomp.base import CostContext
    from autopar.decomp.tensor_parallel.heads import HeadParallel, analyse
    g = _graph(LLAMA)
    unit = g.layers[_index(g, "blocks.0.attn")]
    assert analyse(unit, 8)[1] == "4 attention heads are not divisible by 8 tensor parts"
    bad = HeadParallel(1, 8, "o_proj")
    assert "head parallelism over 8: 4 attention heads" in bad.check(unit, CostContext(profile=profile, world=8,
                                                                                        ranks_per_node=8))


def test_vocab_and_sequence_rejections_name_the_unit(root, profile):
    from autopar.decomp.base import CostContext
    from autopar.decomp.tensor_parallel.sequence import SequenceParallel
    from autopar.decomp.tensor_parallel.vocab import VocabParallel
    g = _graph(root / "strategies/examples/gpt.py")
    ctx = CostContext(profile=profile, world=32, ranks_per_node=32)
    tok = g.layers[_index(g, "tok")]
    ln = g.layers[_index(g, "blocks.0.ln1")]
    assert VocabParallel(1, 32).check(tok, ctx) is None            # 64 rows: uneven blocks are fine
    assert "vocabulary 64 < 128 parts" in VocabParallel(1, 128).check(tok, CostContext(profile=profile, world=128,
                                                                                        ranks_per_node=128))
    assert "blocks.0.ln1: sequence 16 < 32 parts" in SequenceParallel(1, 32).check(ln, ctx)
    assert not SequenceParallel.candidates(g.layers[_index(g, "blocks.0.attn")], ctx)


def test_vocab_parallel_loss_needs_one_cross_entropy_of_the_logits(root, profile):
    import torch
    import torch.nn.functional as F
    from autopar.decomp.base import CostContext
    from autopar.decomp.tensor_parallel.cross_entropy import loss_is_cross_entropy
    from autopar.decomp.tensor_parallel.vocab import VocabHead
    from autopar.modelfile import load_model_file
    from autopar.planner import vocab_loss_output
    t = torch.randint(0, 50, (4, 8))
    assert loss_is_cross_entropy(load_model_file(LLAMA).loss_fn(), [4, 8, 50], t) is None
    smooth = lambda o, y: F.cross_entropy(o.reshape(-1, 50), y.reshape(-1), label_smoothing=0.1)  # noqa: E731
    assert "label smoothing" in loss_is_cross_entropy(smooth, [4, 8, 50], t)
    soft = lambda o, y: F.nll_loss(o.log_softmax(-1).reshape(-1, 50), y.reshape(-1))  # noqa: E731
    assert "log_softmax" in loss_is_cross_entropy(soft, [4, 8, 50], t)
    moved = lambda o, y: F.cross_entropy(o.transpose(1, 2), y)  # noqa: E731
    assert "transpose" in loss_is_cross_entropy(moved, [4, 8, 50], t)
    mf = load_model_file(root / "strategies/examples/gpt.py")
    g = _graph(root / "strategies/examples/gpt.py")
    assert vocab_loss_output(mf, g, 4) == g.output
    head = g.layers[_index(g, "head")]
    with_loss = CostContext(profile=profile, world=4, ranks_per_node=4, loss_output=g.output)
    without = CostContext(profile=profile, world=4, ranks_per_node=4)
    assert [str(c) for c in VocabHead.candidates(head, with_loss)] == ["vocab_head(2,2)", "vocab_head(1,4)"]
    assert not VocabHead.candidates(head, without)
    assert "cross-entropy loss_fn" in VocabHead(1, 4).check(head, without)


# ---- distributed runs against one process (float64) -----------------------------------------

@pytest.mark.dist
def test_gpt_megatron_mix_world_2(root, tmp_path, profile):
    """vocab embedding -> SP add/norm -> head attention -> SP residual/norm -> column/row MLP."""
    r = _plan(root / "strategies/examples/gpt.py", tmp_path, profile, 2, {
        "tok": "vocab", ("", 1): "sequence", "blocks.0.ln1": "sequence", "blocks.0.attn": "head",
        "blocks.0": "sequence", "blocks.0.ln2": "sequence", "blocks.0.fc": "filter",
        "blocks.0.out": "row_parallel", "blocks.1.attn": "head"})
    steps = {(t.src, t.dst): str(t.extra["steps"]) for t in r.plan.transitions}
    g = r.plan.graph()
    attn, res = _index(g, "blocks.0.attn"), _index(g, "blocks.0")
    assert "ReduceScatter" in steps[(attn, res)]          # the row-parallel exit into SP
    assert (_index(g, "blocks.0.ln1"), attn) in steps     # the all-gather into the head split
    _, names = _execute(r, tmp_path)
    assert {"grad:blocks.0.attn.qkv.weight", "grad:blocks.0.attn.qkv.bias", "grad:blocks.0.attn.proj.weight",
            "grad:blocks.0.attn.proj.bias", "grad:tok.weight", "param_after_step:blocks.1.attn.qkv.weight",
            "loss", "output"} <= names


@pytest.mark.dist
def test_gpt_2d_data_by_tensor_world_4(root, tmp_path, profile):
    r = _plan(root / "strategies/examples/gpt.py", tmp_path, profile, 4, {
        "tok": "vocab(2,2)", ("", 1): "sequence(2,2)", "blocks.0.ln1": "sequence(2,2)",
        "blocks.0.attn": "head(2,2)", "blocks.0": "sequence(2,2)", "blocks.1.attn": "head(1,4)",
        ("blocks.1", 0): "sequence(1,4)"})
    _, names = _execute(r, tmp_path)
    assert {"grad:blocks.0.attn.qkv.weight", "grad:blocks.1.attn.qkv.weight", "grad:tok.weight"} <= names


@pytest.mark.dist
def test_gpt_2d_world_8(root, tmp_path, profile, monkeypatch):
    """Two nodes of 4: head(2,4) with sequence(2,4), vocab(2,4) and vocab_head(2,4) around it
    (the tensor axis within a node, data parallelism across the nodes)."""
    monkeypatch.setenv("AUTOPAR_GPT_HEADS", "8")
    r = _plan(root / "strategies/examples/gpt.py", tmp_path, profile, 8, {
        "tok": "vocab(2,4)", "blocks.0.ln1": "sequence(2,4)", "blocks.0.attn": "head(2,4)",
        "blocks.0": "sequence(2,4)", "blocks.1.attn": "head(2,4)", "head": "vocab_head(2,4)"})
    _, names = _execute(r, tmp_path)
    assert {"grad:blocks.0.attn.qkv.weight", "grad:blocks.1.attn.proj.weight", "grad:tok.weight"} <= names


@pytest.mark.dist
@pytest.mark.parametrize("world,heads,kv,force", [
    (2, 4, 2, {"tok": "vocab", "blocks.0.norm1": "sequence", "blocks.0.attn": "head", "blocks.0": "sequence"}),
    (4, 8, 4, {"tok": "vocab(1,4)", "blocks.0.norm1": "sequence(1,4)", "blocks.0.attn": "head(1,4)",
               "blocks.0": "sequence(1,4)", "head": "vocab_head(1,4)"}),
    (4, 4, 2, {"blocks.0.attn": "head(2,2)", "blocks.0.norm1": "sequence(2,2)"}),
])
def test_llama_grouped_query_attention(llama_env, tmp_path, profile, world, heads, kv, force):
    llama_env(heads, kv)
    r = _plan(LLAMA, tmp_path, profile, world, force)
    _, names = _execute(r, tmp_path)
    assert {"grad:blocks.0.attn.q_proj.weight", "grad:blocks.0.attn.k_proj.weight",
            "grad:blocks.0.attn.o_proj.weight", "param_after_step:blocks.0.attn.v_proj.weight"} <= names


@pytest.mark.dist
def test_memory_limit_forces_tensor_parallel_plan(root, tmp_path, monkeypatch, profile, capsys):
    """Replicated GPT weights (data parallelism) need 6.3 MiB per rank at world 4: under a
    4 MiB limit data parallelism alone is infeasible, and with every decomposition the planner
    finds a head/tensor-parallel plan that fits, which executes and validates."""
    from autopar.artifacts import load_plan
    from autopar.profile import save_profile
    from autopar.cli import main
    monkeypatch.setenv("AUTOPAR_GPT_EMBED", "128")
    monkeypatch.setenv("AUTOPAR_GPT_VOCAB", "512")
    prof = tmp_path / "prof.json"
    save_profile(profile, prof)
    base = ["plan", str(root / "strategies/examples/gpt.py"), "--world-size", "4", "--batch-size", "4",
            "--calibration", str(prof), "--memory-limit", "4MiB"]
    assert main(base + ["--kinds", "sample,replicate", "-o", str(tmp_path / "dp")]) == 2
    cap = capsys.readouterr()
    assert "no plan fits 4.0 MiB" in cap.out + cap.err
    assert main(base + ["-o", str(tmp_path / "tp")]) == 0
    plan = load_plan(tmp_path / "tp/plan.json", world_size=4)
    assert plan.predicted.memory_per_rank_bytes <= 4 * 2 ** 20
    choices = [l.choice for l in plan.layers]
    assert any(c.startswith("head(") for c in choices), choices
    from autopar.execute.runner import ExecuteOptions, execute
    run, _ = execute(tmp_path / "tp/plan.json", ExecuteOptions(steps=1, warmup=0, instrumented_steps=1,
                                                               timeout_s=240, ddp=False),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures


def _vocab_ce(rank, world, vocab, parts):
    import torch
    import torch.nn.functional as F
    from autopar.decomp.sharding import block_extent, block_start
    from autopar.runtime.layers.cross_entropy import vocab_parallel_cross_entropy
    from autopar.runtime.comm import Comm
    comm = Comm.from_env()
    groups = [list(range(s * parts, (s + 1) * parts)) for s in range(world // parts)]
    comm.ensure_partitions([groups])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, vocab, generator=g, dtype=torch.float64)
    t = torch.randint(0, vocab, (3, 5), generator=g)
    t[0, 1] = -100                                   # an ignored position
    x.requires_grad_(True)
    ref = F.cross_entropy(x.reshape(-1, vocab), t.reshape(-1))
    ref.backward()
    c = rank % parts
    v0, n = block_start(vocab, parts, c), block_extent(vocab, parts, c)
    xl = x.detach()[..., v0:v0 + n].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(xl, t, v0, comm.group(groups[rank // parts]))
    (loss / parts).backward()                        # the sum convention: the group's shares add to L
    return (float((loss - ref).abs()), float((xl.grad - x.grad[..., v0:v0 + n]).abs().max()),
            float(ref.abs()), float(x.grad.abs().max()))


@pytest.mark.dist
@pytest.mark.parametrize("world,parts,vocab", [(2, 2, 50), (4, 4, 61), (4, 2, 61)])
def test_vocab_parallel_cross_entropy_equals_one_process(world, parts, vocab):
    """Loss and logits gradient of the vocabulary-split cross-entropy against F.cross_entropy
    (float64, vocabulary not divisible by the split included)."""
    from autopar.runtime.launch import run_ranks
    for dl, dg, ref, gref in run_ranks(_vocab_ce, world, args=(vocab, parts), timeout_s=120):
        assert dl <= 1e-9 * ref + 1e-12 and dg <= 1e-9 * gref + 1e-12
