"""Data parallelism through broadcast operands and batch-free layers, and the planner's choice of
the native runtime (``autopar.cost.native``).

A GPT adds a position embedding (computed from ``torch.arange`` and a weight: no sample in it)
to its token embeddings, and a causal mask of shape ``[1, 1, S, S]`` to its attention scores.
Under sample parallelism each block of samples reads those operands whole and sends back its
share of their gradient, summed over the ranks like a weight's. These tests check that such a
model gets a pure data-parallel plan, that the plan equals one process (float64) through the
native module and through the traced program, at world 2 and 4, and that the planner prefers
the native plan exactly when the model says it is at least as fast.
"""

from __future__ import annotations

import math
import textwrap

import pytest

from autopar.artifacts import PlanHooks, PlanOptions
from autopar.execute.runner import ExecuteOptions, execute
from autopar.planner import make_plan

TINY_GPT = """
import math
import torch
from torch import nn
import torch.nn.functional as F

V, S, E = 16, 6, 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, E)
        self.pos = nn.Embedding(S, E)
        self.qk = nn.Linear(E, 2 * E)
        self.head = nn.Linear(E, V)
        self.register_buffer("mask", torch.triu(torch.full((1, 1, S, S), float("-inf")), 1))

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        q, k = self.qk(x).split(E, dim=-1)
        att = (q.unsqueeze(1) @ k.unsqueeze(1).transpose(-1, -2)) / math.sqrt(E) + self.mask
        y = (att.softmax(-1) @ x.unsqueeze(1)).squeeze(1)
        return self.head(y)


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randint(0, V, (batch_size, S)),)


def example_targets(batch_size):
    return torch.randint(0, V, (batch_size, S))


def loss_fn(out, y):
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))
"""


@pytest.fixture
def tiny_gpt(tmp_path):
    f = tmp_path / "tiny_gpt.py"
    f.write_text(textwrap.dedent(TINY_GPT))
    return f


def _plan(model, world, tmp_path, profile, name="plan", **kw):
    return make_plan(model, PlanOptions(world_size=world, out_dir=tmp_path / name, **kw),
                     PlanHooks(profile=profile))


def test_broadcast_operands_are_read_whole_by_every_block_of_samples(tiny_gpt, tmp_path, profile):
    from autopar.decomp.ir import batch_free_layers
    from autopar.decomp.sharding import Sharding
    from autopar.decomp.sample import Sample
    r = _plan(tiny_gpt, 2, tmp_path, profile, batch_size=4, kinds=["sample", "replicate"])
    g = r.plan.graph()
    free = batch_free_layers(g)
    names = {g.layers[i].name for i in free}
    assert "arange" in names and any(g.layers[i].module == "pos" for i in free)
    for lay, d in zip(g.layers, r.plan.layers):
        if lay.index in free:
            assert d.choice == "replicate", (lay.name, d.choice)
            continue
        assert d.choice == "sample(2)", (lay.name, d.choice, lay.ops[0].in_shapes)
    # the add of the position embedding: the token embeddings split, the position embedding whole
    add = next(l for l in g.layers if any(op.kind == "binary" and [6, 8] in op.in_shapes for op in l.ops))
    pos_value = next(v for op in add.ops for v, s in zip(op.inputs, op.in_shapes) if list(s) == [6, 8])
    assert Sample(2).in_placement(add, pos_value) == Sharding()
    assert r.plan.runtime.expected == "native"
    # --kinds sample alone: the batch-free layers keep replicate (computed whole under any plan)
    r2 = _plan(tiny_gpt, 2, tmp_path, profile, name="only-sample", batch_size=4, kinds=["sample"])
    assert [d.choice for d in r2.plan.layers] == [d.choice for d in r.plan.layers]


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_gpt_equals_one_process_native_and_traced(world, tiny_gpt, tmp_path, profile, monkeypatch):
    """float64, every output, the loss, every gradient and parameter after a step
    (``execute``'s validation, rtol 1e-9), once through the user's module and once op by op."""
    r = _plan(tiny_gpt, world, tmp_path, profile, batch_size=8, kinds=["sample", "replicate"])
    for native in ("1", "0"):
        monkeypatch.setenv("AUTOPAR_NATIVE", native)
        run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=240),
                         out_dir=tmp_path / f"run{native}", progress=lambda s: None)
        assert run.validation.passed and run.validation.dtype == "float64", \
            (native, [c.tensor for c in run.validation.failures])
        assert run.extra["native_runtime"] is (native == "1"), run.notes[0]
        assert run.baseline.equivalent


def _with_gap(profile, traced_s: float, native_s: float = 0.0) -> None:
    """Every op family pays ``traced_s`` per op op by op and ``native_s`` in the module."""
    from autopar.ops import FAMILIES
    kinds = set(FAMILIES) | {"view", "other"}
    profile.kernels["runtime_op"] = {"t0_s": traced_s, "s_per_flop": 0.0, "s_per_byte": 0.0, "measured": True,
                                     "by_family": {k: traced_s for k in kinds},
                                     "native_by_family": {k: native_s for k in kinds}}


def _table_and_choices(tiny_gpt, profile):
    from autopar.cost.native import native_choice
    from autopar.cost.table import build_cost_table
    from autopar.decomp.base import CostContext
    from autopar.modelfile import load_model_file
    from autopar.trace.cache import trace_cached
    mf = load_model_file(tiny_gpt)
    graph, _ = trace_cached(mf, 4, use_cache=False)
    ctx = CostContext(profile=profile, world=2, ranks_per_node=2, batch_size=4)
    table = build_cost_table(graph, ctx, kinds=["sample", "replicate"])
    rep = [next(i for i, d in enumerate(o.choices) if d.kind == "replicate") for o in table.layers]
    return table, rep, native_choice(table)


def test_the_native_plan_replaces_an_op_by_op_plan_only_when_predicted_faster(tiny_gpt, profile):
    from autopar.cost.native import choose_runtime, runs_native
    from autopar.cost.primitives import _compute_slowdown, overhead_shares
    from autopar.cost.table import evaluate
    _with_gap(profile, 0.0)
    table, rep, nat = _table_and_choices(tiny_gpt, profile)
    assert nat is not None and nat != rep and runs_native(table, nat) and not runs_native(table, rep)
    t_rep, t_nat = evaluate(table, rep).step_time_s, evaluate(table, nat).step_time_s
    n_ops = sum(len(l.ops) for l in table.graph.layers)
    # no gap between the runtimes: the native plan is taken only if it is at least as fast as priced
    rt0, _ = choose_runtime(table, rep, evaluate, None)
    assert (rt0.runtime == "native") == (t_nat <= t_rep) and rt0.gap_s == 0.0
    # a gap large enough to pay for the difference: the native plan is taken
    g = 2.0 * max(0.0, t_nat - t_rep) / n_ops + 1e-4
    _with_gap(profile, g)
    table, rep, nat = _table_and_choices(tiny_gpt, profile)
    rt, pred = choose_runtime(table, rep, evaluate, None)
    assert rt.runtime == "native" and rt.choice == nat and pred.step_time_s == rt.step_time_s
    assert rt.step_time_s <= rt.ilp_step_time_s == pytest.approx(evaluate(table, rep).step_time_s)
    # every op's gap in the shares it is priced in: ops on the data without parameters (the
    # token ids' embedding lookups, ...) have no backward (primitives.overhead_shares)
    weight = sum(sum(overhead_shares(op)) for lay in table.graph.layers for op in lay.ops)
    assert weight < n_ops
    assert rt.gap_s == pytest.approx(weight * g * _compute_slowdown(table.ctx))
    # ... unless it does not fit the memory limit
    rt2, _ = choose_runtime(table, rep, evaluate, 1.0)
    assert rt2.runtime == "traced" and rt2.choice == rep and "memory" in rt2.reason
    # an ILP plan that is already native is predicted with the module's per-op work, not the
    # op-by-op runtime's: its compute drops by exactly the gap
    _with_gap(profile, 1e-6, 4e-7)
    table, rep, nat = _table_and_choices(tiny_gpt, profile)
    rt4, pred4 = choose_runtime(table, nat, evaluate, None)
    assert rt4.runtime == "native" and rt4.choice == nat
    full = evaluate(table, nat)
    assert pred4.fwd_s + pred4.bwd_s == pytest.approx(
        full.fwd_s + full.bwd_s - weight * 6e-7 * _compute_slowdown(table.ctx), rel=1e-9)
    assert math.isfinite(pred4.step_time_s)


def test_every_plan_that_syncs_gradients_pays_the_reducer_as_measured(tiny_gpt, profile):
    """A profile that measured the gradient reducer (``samples["grad_reducer"]``) charges every
    choice that all-reduces gradients its tensors' hooks and bucket copies in backward, and a
    step its fixed cost once, at the compute slowdown, native and op-by-op plans alike; without
    the measurement every price is unchanged."""
    from autopar.cost.native import choose_runtime
    from autopar.cost.primitives import _compute_slowdown
    from autopar.cost.table import evaluate, layer_param_tensors, plan_grad_reducer_s
    _with_gap(profile, 1e-6, 4e-7)
    profile.samples.pop("grad_reducer", None)
    table0, rep, nat = _table_and_choices(tiny_gpt, profile)
    assert plan_grad_reducer_s(table0, nat) == 0.0 == plan_grad_reducer_s(table0, rep)
    rt0, p0 = choose_runtime(table0, nat, evaluate, None)
    assert rt0.reducer_s == 0.0 and rt0.to_json()["grad_reducer_s"] == 0.0
    before = {tuple(plan): evaluate(table0, plan) for plan in (nat, rep)}
    red = {"fixed_s": 2.5e-4, "per_tensor_s": 5e-6, "per_byte_s": 2e-10}
    profile.samples["grad_reducer"] = red
    table, rep2, nat2 = _table_and_choices(tiny_gpt, profile)
    assert (rep2, nat2) == (rep, nat)
    slow = _compute_slowdown(table.ctx)
    for plan in (nat, rep):
        syncing = [(o.layer, o.costs[i]) for o, i in zip(table.layers, plan) if o.costs[i].grad_sync_s > 0]
        assert len(syncing) >= 3
        want = slow * (red["fixed_s"] + sum(red["per_tensor_s"] * layer_param_tensors(lay)
                                            + red["per_byte_s"] * c.grad_sync_bytes for lay, c in syncing))
        assert plan_grad_reducer_s(table, plan) == pytest.approx(want, rel=1e-12)
        # each syncing layer's backward carries its own share, the first layer's forward the
        # fixed share (where the solvers see it too), nothing else moves
        for k, (o0, o, i) in enumerate(zip(table0.layers, table.layers, plan)):
            c0, c = o0.costs[i], o.costs[i]
            share = (slow * (red["per_tensor_s"] * layer_param_tensors(o.layer) + red["per_byte_s"] * c.grad_sync_bytes)
                     if c.grad_sync_s > 0 else 0.0)
            assert c.bwd_compute_s == pytest.approx(c0.bwd_compute_s + share, rel=1e-12, abs=1e-15)
            assert c.fwd_compute_s == pytest.approx(c0.fwd_compute_s + (slow * red["fixed_s"] if k == 0 else 0.0),
                                                    rel=1e-12, abs=1e-15)
        e0, e = before[tuple(plan)], evaluate(table, plan)
        assert e.fwd_s + e.bwd_s == pytest.approx(e0.fwd_s + e0.bwd_s + want, rel=1e-9)
    rt, p = choose_runtime(table, nat, evaluate, None)
    assert rt.runtime == "native" and rt.reducer_s == pytest.approx(plan_grad_reducer_s(table, nat), rel=1e-12)
    assert p.fwd_s + p.bwd_s == pytest.approx(p0.fwd_s + p0.bwd_s + rt.reducer_s, rel=1e-9)


def test_the_optimizer_steps_fixed_share_is_paid_once_per_step_by_every_plan(tiny_gpt, profile):
    """A profile whose optimizer fit has a fixed share (``calibrate.optimizer``: one per step,
    measured cold) adds it, at the compute slowdown, to the first layer's update in every
    choice, so every plan's predicted optimizer time grows by exactly that and no choice moves;
    a profile without it prices as before."""
    from autopar.cost.primitives import _compute_slowdown
    from autopar.cost.table import evaluate
    _with_gap(profile, 1e-6, 4e-7)
    profile.samples.pop("grad_reducer", None)
    base = {"t0_s": 1.2e-5, "s_per_flop": 0.0, "s_per_byte": 2e-10, "measured": True, "per": "tensor"}
    profile.kernels["optimizer_step"] = base
    table0, rep, nat = _table_and_choices(tiny_gpt, profile)
    fixed = 3.5e-4
    profile.kernels["optimizer_step"] = {**base, "fixed_s": fixed}
    table, rep2, nat2 = _table_and_choices(tiny_gpt, profile)
    assert (rep2, nat2) == (rep, nat)
    slow = _compute_slowdown(table.ctx)
    for k, (o0, o) in enumerate(zip(table0.layers, table.layers)):
        for c0, c in zip(o0.costs, o.costs):
            assert c.optim_step_s == pytest.approx(c0.optim_step_s + (slow * fixed if k == 0 else 0.0),
                                                   rel=1e-12, abs=1e-15)
    for plan in (nat, rep):
        e0, e = evaluate(table0, plan), evaluate(table, plan)
        assert e.optimizer_s == pytest.approx(e0.optimizer_s + slow * fixed, rel=1e-9)
        assert e.step_time_s == pytest.approx(e0.step_time_s + slow * fixed, rel=1e-9)
