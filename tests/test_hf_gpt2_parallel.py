"""Tensor parallelism on the untouched Hugging Face GPT-2 (``strategies/examples/hf_gpt2.py``):
its attention and MLP use transformers' ``Conv1D``, traced as ``view(-1, E)`` ->
``addmm(bias, x, w_CF)`` -> ``view(N, S, F)`` with the weight stored transposed (output
features LAST), and a fused ``c_attn`` (q|k|v in one ``[E, 3E]`` weight, sliced after the view).

* head parallelism ``head(s, p)`` of the attention unit: ``c_attn`` column-parallel by segment
  on the weight's last dim, ``c_proj`` row-parallel on its first dim;
* the Megatron MLP pair ``mlp(s, p)`` of the Conv1D MLP unit: ``c_fc`` column, the GELU on the
  split features, ``c_proj`` row;
* mixed with data parallelism on a 2-D (sample x tensor) mesh, with sequence parallelism on the
  layer norms and residuals, at world 2, 4 and 8.

Every run is checked by ``autopar execute``'s validation: float64 model and batch; output, loss,
every parameter gradient and every parameter after one SGD step against one process, per tensor
``max|a-b| <= 1e-9 max|ref| + 1e-12``.

The LM head's weight IS the token embedding's (tied): it may be split when both uses take the
same shard of it (``vocab(s, p)`` rows of the embedding == ``vocab_head(s, p)`` logit columns,
the loss run vocabulary-parallel), which the ILP enforces (``solve.ilp._add_tied``); the
runtime holds one shard whose gradient sums both uses.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from autopar.errors import AutoparError  # noqa: E402

RTOL, ATOL = 1e-9, 1e-12


@pytest.fixture
def model(root):
    return root / "strategies" / "examples" / "hf_gpt2.py"


def _graph(model, batch=4):
    from autopar.modelfile import load_model_file
    from autopar.planner import attention_units
    from autopar.trace.tracer import trace_model
    return attention_units(trace_model(load_model_file(model), batch))


def _unit(graph, module):
    """The planning unit of ``module``: its largest layer, the first of equals (constant layers
    such as the empty key/value cache tensors lifted into the attention module stay layers of
    their own)."""
    lays = [lay for lay in graph.layers if lay.module == module]
    return max(lays, key=lambda lay: len(lay.ops))


def _plan(model, tmp_path, profile, world, force, batch=4, **kw):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    g = _graph(model, batch)
    pins = {_unit(g, m).index: v for m, v in force.items()}
    kw.setdefault("max_candidates", 30)
    return make_plan(model, PlanOptions(world_size=world, batch_size=batch,
                                        out_dir=str(tmp_path / f"plan{world}"), **kw),
                     PlanHooks(profile=profile, force=pins))


def _execute_all_checked(r, model, tmp_path):
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.modelfile import load_model_file
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=240,
                                                 ddp=False, rtol=RTOL, atol=ATOL),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    v = run.validation
    assert v.passed, [(c.tensor, c.max_abs_diff) for c in v.failures]
    names = {c.tensor for c in v.checks}
    params = {q for q, _ in load_model_file(model).build_model().named_parameters()}
    assert {"output", "loss"} <= names
    assert {f"grad:{q}" for q in params} <= names
    assert {f"param_after_step:{q}" for q in params} <= names
    return run


# ---- plan-time logic, no process ------------------------------------------------------------

def test_conv1d_attention_and_mlp_are_found_as_units(model):
    g = _graph(model)
    att = [lay for lay in g.layers if any(op.kind == "attention" for op in lay.ops)]
    assert [u.module for u in att] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    mods = [op.module for op in att[0].ops if op.target.startswith("aten.addmm")]
    assert mods == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj"]
    mlp = _unit(g, "transformer.h.0.mlp")
    assert [op.module for op in mlp.ops if op.target.startswith("aten.addmm")] == \
        ["transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
    # the empty cache tensors made in the attention module are not inside the unit
    assert not any(op.attrs.get("constant") for op in att[0].ops)
    consts = [lay for lay in g.layers if lay.module == "transformer.h.0.attn" and lay is not att[0]]
    assert consts and all(any(op.attrs.get("constant") for op in lay.ops) for lay in consts)


def test_head_parallel_shards_the_transposed_fused_weight_by_segment(model, profile):
    import torch

    from autopar.decomp.base import CostContext
    from autopar.decomp.tensor_parallel.heads import HeadParallel
    g = _graph(model)
    unit = _unit(g, "transformer.h.0.attn")
    ctx = CostContext(profile=profile, world=4, ranks_per_node=4, batch_size=4)
    cands = {str(c): c for c in HeadParallel.candidates(unit, ctx)}
    assert set(cands) == {"head(2,2)", "head(1,4)"}
    h = cands["head(1,4)"]
    assert (h.row, h.fused, h.segments) == ("c_proj", "c_attn", (32, 32, 32))
    assert h.check(unit, ctx) is None and cands["head(2,2)"].check(unit, ctx) is None
    c_attn, c_proj = [op for op in unit.ops if op.target.startswith("aten.addmm")]
    w = torch.arange(32 * 96).reshape(32, 96)          # Conv1D weight [E, 3E]: outputs last
    sh = h.param_shard(c_attn, "mat2")
    assert sh.dims == ((1, 0),) and sh.local_shape(w.shape, 1, 4) == (32, 24)
    cols = sh.index(w.shape, 1, 4)[1]                  # rank 1: head 1 of each of q, k and v
    assert cols == [*range(8, 16), *range(40, 48), *range(72, 80)]
    assert h.param_shard(c_attn, "self").index((96,), 1, 4)[0] == cols
    assert h.param_shard(c_proj, "mat2").local_bounds((32, 32), 2, 4) == ((16, 8), (0, 32))
    assert h.param_shard(c_proj, "self").dims == ()    # the output bias is whole, added once
    # a quarter of the projections' parameters (the output bias whole)
    c4 = h.cost(unit, ctx)
    item = unit.itemsize
    whole = sum(n for op in unit.ops for n in [__import__("math").prod(s) for s in op.params.values()])
    assert c4.param_bytes == pytest.approx(((whole - 32) / 4 + 32) * item)


def test_local_conv1d_shapes_for_pricing_and_exact_measurement(model):
    """A row-parallel Conv1D ``addmm`` on p = 4 runs x (N S, C/4) @ w (C/4, F): the spec an
    exact measurement builds holds that local weight, and the priced bytes count it, not the
    whole weight."""
    import torch

    from autopar.profile.keys import op_spec
    from autopar.ops import family_of
    unit = _unit(_graph(model), "transformer.h.0.mlp")
    c_fc, c_proj = [op for op in unit.ops if op.target.startswith("aten.addmm")]
    spec = op_spec(c_proj, [[64, 32]], [64, 32])
    assert spec["params"]["mat2"] == [32, 32] and spec["params"]["self"] == [32]
    x, w, b = torch.randn(64, 32), torch.randn(*spec["params"]["mat2"]), torch.randn(32)
    assert torch.addmm(b, x, w).shape == (64, 32)
    fam = family_of(c_fc.kind)
    whole = fam.local_bytes(c_fc, [[64, 32]], [64, 128], None, 8)
    split = fam.local_bytes(c_fc, [[64, 32]], [64, 32], (32, 32), 8)
    assert whole - split == ((64 * 128 - 64 * 32) + (32 * 128 - 32 * 32) + (128 - 32)) * 8


def test_mlp_pair_is_offered_on_the_conv1d_mlp(model, profile):
    from autopar.cost.table import layer_options
    from autopar.decomp.base import CostContext
    from autopar.decomp.tensor_parallel.heads import MlpParallel
    g = _graph(model)
    unit = _unit(g, "transformer.h.0.mlp")
    ctx = CostContext(profile=profile, world=4, ranks_per_node=4, batch_size=4, max_candidates=30)
    opts = layer_options(unit, ctx, prune=False)
    assert {"mlp(2,2)", "mlp(1,4)", "sample(4)"} <= {str(c) for c in opts.choices}
    m = next(c for c in opts.choices if str(c) == "mlp(1,4)")
    assert (m.row, m.fused, m.segments) == ("c_proj", "", ())
    c_fc, c_proj = [op for op in unit.ops if op.target.startswith("aten.addmm")]
    assert m.param_shard(c_fc, "mat2").local_shape((32, 128), 0, 4) == (32, 32)
    assert m.param_shard(c_fc, "self").local_shape((128,), 0, 4) == (32,)
    assert m.param_shard(c_proj, "mat2").local_shape((128, 32), 0, 4) == (32, 32)
    # the attention unit is head parallelism's, not the MLP pair's
    assert not MlpParallel.candidates(_unit(g, "transformer.h.0.attn"), ctx)
    assert "holds attention" in MlpParallel(1, 4, "c_proj").check(_unit(g, "transformer.h.0.attn"), ctx)


def test_heads_not_divisible_are_rejected_at_plan_time(model, tmp_path, profile, monkeypatch):
    monkeypatch.setenv("AUTOPAR_HF_HEADS", "2")        # 2 heads of 16 cannot be split 4 ways
    with pytest.raises(AutoparError, match=r"transformer\.h\.0\.attn: head parallelism over 4: "
                                           r"2 attention heads are not divisible by 4"):
        _plan(model, tmp_path, profile, 4, {"transformer.h.0.attn": "head(1,4)"})


def test_tied_weight_is_split_only_the_same_way_in_both_uses(model, tmp_path, profile):
    """The ILP ties the choices of the two layers that use ``transformer.wte.weight``: pinning
    the embedding to a vocabulary split makes the head take the same split; pinning it whole
    keeps the head whole; no solution mixes them (``solve.ilp.tied_ok``)."""
    from autopar.cost.table import tied_choice_sets
    from autopar.runtime.model import param_shards
    from autopar.solve.ilp import solve, tied_ok
    for pin, head in (("vocab(1,4)", "vocab_head(1,4)"), ("vocab(2,2)", "vocab_head(2,2)")):
        r = _plan(model, tmp_path, profile, 4, {"transformer.wte": pin})
        g = r.plan.graph()
        assert r.plan.layer(_unit(g, "lm_head").index).choice == head
        shards = param_shards(g, {d.layer: d.decomposition() for d in r.plan.layers})
        assert shards["transformer.wte.weight"].local_shape((64, 32), 1, 4) == ((32 if pin == "vocab(2,2)" else 16), 32)
    r = _plan(model, tmp_path, profile, 4, {"transformer.wte": "sample(4)"})
    g = r.plan.graph()
    assert r.plan.layer(_unit(g, "lm_head").index).choice in ("sample(4)", "replicate")
    # the sets themselves: the embedding's and the head's choices grouped by how they hold it
    r = _plan(model, tmp_path, profile, 4, {})
    sets = dict(tied_choice_sets(r.table))
    per_shard = sets["transformer.wte.weight"]
    wte, head = _unit(g, "transformer.wte").index, _unit(g, "lm_head").index
    names = [({str(r.table.layers[wte].choices[i]) for i in by[wte]},
              {str(r.table.layers[head].choices[i]) for i in by[head]}) for by in per_shard]
    assert ({"vocab(1,4)"}, {"vocab_head(1,4)"}) in names and ({"vocab(2,2)"}, {"vocab_head(2,2)"}) in names
    assert any("sample(4)" in a and "sample(4)" in b for a, b in names)
    assert tied_ok(r.table, r.solution.choice)
    # the cheapest choice per layer that mixes the two is not a plan; the solver never returns one
    bad = list(r.solution.choice)
    bad[wte] = next(i for i, d in enumerate(r.table.layers[wte].choices) if str(d) == "vocab(1,4)")
    bad[head] = next(i for i, d in enumerate(r.table.layers[head].choices) if str(d) == "sample(4)")
    assert not tied_ok(r.table, bad)
    assert tied_ok(r.table, solve(r.table).choice)


def test_tied_table_is_priced_once(model, profile):
    """One tensor, one price: the table's bytes, gradient and all-reduce are the embedding's
    (the first user); the head's prices hold none of it, whichever way both hold it."""
    from autopar.cost.table import build_cost_table
    from autopar.decomp.base import CostContext
    from autopar.modelfile import load_model_file
    from autopar.planner import vocab_loss_output
    g = _graph(model)
    ctx = CostContext(profile=profile, world=4, ranks_per_node=4, batch_size=4, max_candidates=30,
                      loss_output=vocab_loss_output(load_model_file(model), g, 4))
    t = build_cost_table(g, ctx)
    wte, head = t.layers[_unit(g, "transformer.wte").index], t.layers[_unit(g, "lm_head").index]
    table_bytes = 64 * 32 * g.layers[0].itemsize
    cost = {str(d): c for d, c in zip(wte.choices, wte.costs)}
    assert cost["sample(4)"].param_bytes == table_bytes and cost["sample(4)"].grad_sync_bytes == table_bytes
    assert cost["vocab(1,4)"].param_bytes == table_bytes / 4 and cost["vocab(1,4)"].grad_sync_s == 0.0
    for d, c in zip(head.choices, head.costs):
        assert c.param_bytes == 0.0 and c.grad_sync_s == 0.0 and c.grad_sync_bytes == 0.0, d


def test_residual_dropout_on_the_partial_sum_is_refused_with_the_reason(model, tmp_path, profile):
    """GPT-2's default ``resid_pdrop = 0.1`` drops out the output projection's result: under a
    row split that is a partial sum, and per-rank masks on partial sums do not add up to the
    masked sum, so head and MLP parallelism are refused, naming the dropout."""
    from autopar.decomp.base import CostContext
    from autopar.decomp.tensor_parallel.heads import HeadParallel, MlpParallel
    src = model.read_text().replace("resid_pdrop=0.0", "resid_pdrop=0.1")
    assert "resid_pdrop=0.1" in src
    f = tmp_path / "gpt2_dropout.py"
    f.write_text(src)
    g = _graph(f)
    ctx = CostContext(profile=profile, world=2, ranks_per_node=2, batch_size=4)
    why = HeadParallel(1, 2, "c_proj", "c_attn", (32, 32, 32)).check(_unit(g, "transformer.h.0.attn"), ctx)
    assert why and "transformer.h.0.attn: head parallelism over 2" in why and "dropout" in why and \
        "after the row-parallel projection" in why, why
    why = MlpParallel(1, 2, "c_proj").check(_unit(g, "transformer.h.0.mlp"), ctx)
    assert why and "MLP tensor parallelism over 2" in why and "dropout" in why, why


# ---- gloo ranks, float64, everything compared -----------------------------------------------

CASES = [
    # world, pins (module -> decomposition)
    (2, {"transformer.h.0.attn": "head(1,2)", "transformer.h.1.attn": "head(1,2)",
         "transformer.h.0.mlp": "mlp(1,2)", "transformer.h.1.mlp": "mlp(1,2)"}),
    (4, {"transformer.h.0.attn": "head(2,2)", "transformer.h.1.attn": "head(2,2)",
         "transformer.h.0.mlp": "mlp(2,2)", "transformer.h.1.mlp": "mlp(2,2)"}),
    (4, {"transformer.h.0.attn": "head(1,4)", "transformer.h.0.mlp": "mlp(2,2)",
         "transformer.h.0.ln_1": "sequence(1,4)", "transformer.h.0.ln_2": "sequence(2,2)",
         "transformer.h.0": "sequence(1,4)",                    # the residual add after attention
         "transformer.h.1.attn": "sample(4)", "transformer.h.1.mlp": "mlp(1,4)"}),
    # the tied table split by vocabulary: only the embedding is pinned, the ILP ties the head
    (2, {"transformer.wte": "vocab(1,2)", "transformer.h.0.attn": "head(1,2)", "transformer.h.1.mlp": "mlp(1,2)"}),
    (4, {"transformer.wte": "vocab(2,2)", "lm_head": "vocab_head(2,2)", "transformer.h.0.attn": "head(2,2)",
         "transformer.h.0.mlp": "mlp(2,2)", "transformer.h.1.attn": "head(2,2)", "transformer.h.1.mlp": "mlp(2,2)",
         "transformer.ln_f": "sequence(2,2)"}),
    # world 8: 4 heads over 4 tensor ranks x 2 sample blocks, the MLP over 2 x 4
    (8, {"transformer.wte": "vocab(2,4)", "transformer.h.0.attn": "head(2,4)", "transformer.h.0.mlp": "mlp(4,2)",
         "transformer.h.1.attn": "head(4,2)", "transformer.h.1.mlp": "mlp(2,4)", "transformer.h.1.ln_2": "sequence(2,4)"}),
]


@pytest.mark.dist
@pytest.mark.parametrize("world,force", CASES, ids=["w2-head-mlp", "w4-2x2-head-mlp", "w4-mixed-seq",
                                                   "w2-tied-vocab", "w4-2x2-everything", "w8-2d-mixed"])
def test_hf_gpt2_tensor_parallel_equals_one_process(model, tmp_path, profile, world, force):
    r = _plan(model, tmp_path, profile, world, force)
    g = r.plan.graph()
    for m, want in force.items():
        assert r.plan.layer(_unit(g, m).index).choice == want, m
    if "transformer.wte" in force:              # the tied head follows the embedding's split
        p = r.plan.layer(_unit(g, "transformer.wte").index).choice.split("(")[1]
        assert r.plan.layer(_unit(g, "lm_head").index).choice == f"vocab_head({p}"
    _execute_all_checked(r, model, tmp_path)


@pytest.mark.dist
def test_memory_limit_forces_tensor_parallelism_that_validates(model, tmp_path, profile, monkeypatch):
    """A wider GPT-2 (E = 128, V = 512) under 2.5 MiB per rank at world 4 (synthetic profile):
    data parallelism and replication alone do not fit, and the planner, unpinned, picks head
    and MLP tensor parallelism and splits the tied table by vocabulary in both its uses; the
    plan equals one process."""
    from autopar.errors import InfeasiblePlan
    monkeypatch.setenv("AUTOPAR_HF_EMBED", "128")
    monkeypatch.setenv("AUTOPAR_HF_VOCAB", "512")
    with pytest.raises(InfeasiblePlan):
        _plan(model, tmp_path / "dp", profile, 4, {}, memory_limit_bytes=2.5 * 2**20, kinds=["sample", "replicate"])
    r = _plan(model, tmp_path, profile, 4, {}, memory_limit_bytes=2.5 * 2**20)
    kinds = {d.choice.split("(")[0] for d in r.plan.layers}
    assert {"head", "mlp"} <= kinds, kinds
    g = r.plan.graph()
    emb, head = r.plan.layer(_unit(g, "transformer.wte").index).choice, r.plan.layer(_unit(g, "lm_head").index).choice
    assert emb.startswith("vocab(") and head == "vocab_head(" + emb.split("(")[1], (emb, head)
    assert r.plan.predicted.memory_per_rank_bytes <= 2.5 * 2**20
    _execute_all_checked(r, model, tmp_path)
