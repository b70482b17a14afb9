"""Transformers as people write them, untouched: the shipped model files (Hugging Face GPT-2,
BERT with a masked-LM or a classification head, a Llama-style model with RMSNorm, rotary
embeddings and grouped-query attention, ``torch.nn.TransformerEncoder``, the hand-written GPT)
trace, plan with the default kinds, execute on gloo ranks and equal one process.

Validation is ``autopar execute``'s: float64 model and batch, every tensor (output, loss, every
parameter gradient, every parameter after one SGD step, every rank's replicas) within
``max|a-b| <= 1e-9 * max|ref| + 1e-12``. A model returning a ``ModelOutput`` with a
``DynamicCache`` is planned through its training step ``loss_fn(model(x), y)``; a loss that does
not trace is a TraceError naming the loss's line.
"""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("transformers")

from autopar.artifacts import PlanHooks, PlanOptions  # noqa: E402
from autopar.errors import TraceError  # noqa: E402
from autopar.execute.runner import ExecuteOptions, execute  # noqa: E402
from autopar.modelfile import load_model_file  # noqa: E402
from autopar.planner import make_plan  # noqa: E402
from autopar.trace.tracer import STEP_TRACER, trace_model  # noqa: E402

RTOL, ATOL = 1e-9, 1e-12


def _example(root, name):
    return root / "strategies" / "examples" / f"{name}.py"


def _plan_and_validate(model, world, tmp_path, profile, batch_size=8):
    r = make_plan(model, PlanOptions(world_size=world, batch_size=batch_size, out_dir=tmp_path / "plan",
                                     max_candidates=30),
                  PlanHooks(profile=profile))
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=240,
                                                 rtol=RTOL, atol=ATOL),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    v = run.validation
    assert v.passed, [(c.tensor, c.max_abs_diff) for c in v.failures]
    names = {c.tensor for c in v.checks}
    assert {"output", "loss"} <= names
    mf = load_model_file(model)
    params = {q for q, _ in mf.build_model().named_parameters()}
    assert {f"grad:{q}" for q in params} <= names
    assert {f"param_after_step:{q}" for q in params} <= names
    assert run.baseline is not None and run.baseline.equivalent
    _constants_are_local(r.plan_path)
    return r.plan


def _constants_are_local(plan_path):
    """Values made from constants inside forward (position ids, causal masks, rotary tables,
    empty cache tensors) are computed whole on every rank; a consumer that needs a block slices
    it locally: no transition out of such a layer communicates."""
    import json
    p = json.loads(plan_path.read_text())
    layers = p["graph"]["layers"]
    const = {lay["index"] for lay in layers if any(op["attrs"].get("constant") for op in lay["ops"])}
    if not const:
        return
    choice = {d["layer"]: d["choice"] for d in p["layers"]}
    assert all(choice[i] == "replicate" for i in const)
    for t in p["transitions"]:
        if t["src"] in const:
            assert t["steps"].startswith("Slice") and t["fwd_s"] == 0 and t["bwd_s"] == 0, t


@pytest.mark.dist
@pytest.mark.parametrize("name,world", [("hf_gpt2", 2), ("hf_gpt2", 4), ("hf_llama", 2), ("hf_bert", 2),
                                        ("torch_encoder", 2), ("gpt", 2)])
def test_transformer_plans_execute_and_equal_one_process(name, world, root, tmp_path, profile):
    plan = _plan_and_validate(_example(root, name), world, tmp_path, profile)
    assert plan.world_size == world
    assert plan.graph().unregistered == []          # every op has a family (none runs unknown)


@pytest.mark.dist
def test_bert_sequence_classification(root, tmp_path, profile, monkeypatch):
    monkeypatch.setenv("AUTOPAR_BERT_HEAD", "classification")
    plan = _plan_and_validate(_example(root, "hf_bert"), 2, tmp_path, profile)
    out = plan.graph().output
    assert plan.graph().value_shape(out) == [8, 3]      # logits per sequence, not per token


@pytest.mark.dist
def test_encoder_with_a_causal_mask_made_in_forward(root, tmp_path, profile, monkeypatch):
    """``generate_square_subsequent_mask`` inside forward: ``full(-inf)`` then ``triu``, made
    on every rank (-inf travels through the plan's JSON as ``{"float": "-inf"}``)."""
    monkeypatch.setenv("AUTOPAR_ENC_CAUSAL", "1")
    plan = _plan_and_validate(_example(root, "torch_encoder"), 2, tmp_path, profile)
    ops = [op for lay in plan.graph().layers for op in lay.ops]
    assert any(op.kind == "triangular" for op in ops)
    assert any(op.target == "aten.full.default" and {"float": "-inf"} in op.args for op in ops)


def test_structured_output_is_planned_through_the_training_step(root):
    """GPT-2 returns logits and a DynamicCache: the step is traced, the loss's own ops and the
    targets are gone, the output is the logits, the tied head is the embedding's weight, and the
    empty cache tensors are remade on every rank (no activation input)."""
    g = trace_model(load_model_file(_example(root, "hf_gpt2")), 4)
    assert g.tracer == STEP_TRACER
    assert [gi.name for gi in g.inputs] == ["xs_0"]                     # no target input
    assert g.value_shape(g.output) == [4, 16, 64]
    ops = [op for lay in g.layers for op in lay.ops]
    assert not any("cross_entropy" in op.target or "nll_loss" in op.target for op in ops)
    pnames = {q for op in ops for q in op.param_names.values()}
    assert "transformer.wte.weight" in pnames and "lm_head.weight" not in pnames
    empties = [op for op in ops if op.target == "aten.empty.memory_format"]
    assert empties and all(op.attrs.get("constant") and not op.inputs for op in empties)
    assert all(not m or not m.startswith("model.") for m in (op.module for op in ops))
    # the distributed model returns the same ModelOutput, its cache dropped as in the trace
    import torch

    from autopar.runtime.model import output_structure, rebuild_output
    t = torch.zeros(2, 16, 64)
    out = rebuild_output(output_structure(load_model_file(_example(root, "hf_gpt2")).build_model(), g), t)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions" and list(out.keys()) == ["logits"]
    assert out.logits is t


def test_casts_follow_the_model_dtype_but_explicit_ones_stay(root):
    """Llama's RMSNorm computes in float32 explicitly (kept), casts back to the input dtype
    (an identity here, so float64 validation keeps float64), and its residual reads the
    block's input, not the float32 copy."""
    g = trace_model(load_model_file(_example(root, "hf_llama")), 2)
    ops = {op.name: op for lay in g.layers for op in lay.ops}
    casts = [op for op in ops.values() if op.target.startswith("aten.to.")]
    kept = [op for op in casts if op.source.endswith(":64")]      # hidden_states.to(torch.float32)
    assert kept and all(op.args[1] == {"dtype": "float32"} for op in kept)
    back = [op for op in ops.values() if op.target == "aten.alias.default" and op.source.endswith(":67")]
    assert len(back) == 2 * 2 + 1                                    # 2 norms per layer + the final norm
    for cast in kept:
        readers = [op for op in ops.values() if cast.name in op.inputs]
        assert all(op.target != "aten.add.Tensor" for op in readers), "a residual reads the float32 copy"


BAD_LOSS = """
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                      bos_token_id=0, eos_token_id=0))


def example_inputs(batch_size):
    return (torch.randint(0, 32, (batch_size, 8)),)


def example_targets(batch_size):
    return torch.randint(0, 32, (batch_size, 8))


def loss_fn(output, targets):
    logits = output.logits
    if logits.mean() > 0:
        return logits.sum()
    return F.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1))
"""


def test_a_loss_that_does_not_trace_names_its_line(tmp_path):
    f = tmp_path / "bad_loss.py"
    f.write_text(textwrap.dedent(BAD_LOSS))
    with pytest.raises(TraceError) as e:
        trace_model(load_model_file(f), 2)
    msg = str(e.value)
    assert "the loss does not trace" in msg and "bad_loss.py:22" in msg and "logits.mean() > 0" in msg


def test_a_loss_reading_two_output_tensors_is_named(tmp_path):
    f = tmp_path / "two_outputs.py"
    f.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Two(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 2)

            def forward(self, x):
                return {"main": self.a(x), "aux": self.b(x)}

        def build_model():
            return Two()

        def example_inputs(batch_size):
            return (torch.randn(batch_size, 4),)

        def loss_fn(out):
            return out["main"].pow(2).mean() + out["aux"].pow(2).mean()
    """))
    with pytest.raises(TraceError, match=r"reads 2 tensors of the model's output \(\['main'\], \['aux'\]\)"):
        trace_model(load_model_file(f), 2)


def test_tied_weights_split_only_the_same_way(root, tmp_path, profile):
    """GPT-2's head is its token embedding's weight: one parameter, used by two layers. The
    runtime holds one sharding per parameter, so both layers must hold it the same way (the
    ILP's tied constraint, ``tests/test_hf_gpt2_parallel.py``); a head pinned to a split that
    no choice of the embedding matches is a named error."""
    from autopar.errors import AutoparError
    from autopar.planner import attention_units
    model = _example(root, "hf_gpt2")
    g = attention_units(trace_model(load_model_file(model), 8))
    head = next(lay.index for lay in g.layers if lay.module == "lm_head")
    assert any(op.attrs.get("tied") == ["weight"] for op in g.layers[head].ops)
    with pytest.raises(AutoparError, match=r"transformer.wte.weight is tied: lm_head"):
        make_plan(model, PlanOptions(world_size=2, batch_size=8, out_dir=tmp_path / "plan", max_candidates=30),
                  PlanHooks(profile=profile, force={head: "row_parallel(1,2)"}))


NO_LOSS = """
import torch
from transformers import BertConfig, BertForSequenceClassification


def build_model():
    return BertForSequenceClassification(BertConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=8, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def example_inputs(batch_size):
    return (torch.randint(0, 32, (batch_size, 8)),)


def example_targets(batch_size):
    return torch.randint(0, 3, (batch_size,))
"""


@pytest.mark.dist
def test_default_loss_reads_the_one_tensor_of_a_model_output(tmp_path, profile):
    """No loss_fn: the default loss (cross-entropy for integer targets) takes the logits of the
    ``SequenceClassifierOutput``, at plan time and on every rank."""
    f = tmp_path / "bert_no_loss.py"
    f.write_text(textwrap.dedent(NO_LOSS))
    (tmp_path / "out").mkdir()
    _plan_and_validate(f, 2, tmp_path / "out", profile)
