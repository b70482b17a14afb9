"""Targets of any shape in ``autopar.shard_batch`` and ``autopar.plan_loader`` (issue 38, item 1c),
and batches that do not fit the plan (its "bad input").

The target is cut along dim 0 only, as the output's dim 0 is under the loss layout
(``runtime.model.target_rows``). Each case runs the user's path at its world size --
``parallelize``, ``shard_batch`` of a global batch (and ``plan_loader`` over per-sample items,
which must yield the same blocks), ``dmodel.loss`` -- and compares the loss and every parameter
gradient with one process in float64 (``max|a-b| <= 1e-9 max|ref| + 1e-12``):

* ``lm_vocab``: Hugging Face GPT-2's [B, S] next-token target under a head / MLP / vocabulary
  plan at world 4 (the loss vocabulary-parallel, the output split on its last dim);
* ``pyg_nodes``: a node-level target [N nodes] of a PyG batch (``pyg_nnconv.py`` predicting per
  node) under node / edge parallelism at world 2, where the output's dim 0 (nodes) is not the
  plan's batch (graphs);
* ``pixels``: dense per-pixel labels [B, H, W] of a small segmentation CNN under a spatial plan;
* ``graph_padded``: the padded GNN's (``gnn_pcqm4m.py``) graph-level target [B];
* ``graph_pyg``: ``pyg_nnconv.py``'s graph-level target [B graphs] under graph parallelism.

Before the fix the first two failed (``IndexError: tuple index out of range`` in
``BatchSharding.target_samples``; node targets cut as if they were graphs); the last three are
guards of the shapes that already worked. Bad input: a data-set item with the wrong number of
fields or a wrong shape, and a batch of wrong shapes, are ``BatchMismatch`` listing what the
plan expects for each input and the target.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

RTOL, ATOL = 1e-9, 1e-12
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "strategies" / "examples"
GNN_SMALL = {"AUTOPAR_GNN_NODE_EMBED": "8", "AUTOPAR_GNN_OUT": "4", "AUTOPAR_GNN_NODES": "6",
             "AUTOPAR_GNN_EDGES": "10", "AUTOPAR_GNN_GRAPHS": "4"}

SEG = """
import torch
from torch import nn
import torch.nn.functional as F

class Seg(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x)))

def build_model():
    return Seg()

def example_inputs(b):
    return (torch.randn(b, 3, 8, 8),)

def example_targets(b):
    return torch.randint(0, 3, (b, 8, 8))

def loss_fn(out, y):
    return F.cross_entropy(out, y)
"""

GPT2_TP = {"transformer.wte": "vocab(2,2)", "lm_head": "vocab_head(2,2)", "transformer.h.0.attn": "head(2,2)",
           "transformer.h.1.attn": "head(2,2)", "transformer.h.0.mlp": "mlp(2,2)", "transformer.h.1.mlp": "mlp(2,2)"}


def _pyg_nodes_file(base: Path) -> Path:
    """``pyg_nnconv.py`` predicting one value per node (no pooling), with a per-node target."""
    src = (EXAMPLES / "pyg_nnconv.py").read_text()
    pooled = ("        pooled = global_add_pool(h, batch, size=self.num_graphs)\n"
              "        return self.head(pooled).squeeze(-1)")
    targets = "def example_targets(batch_size):\n    return torch.randn(batch_size)"
    assert pooled in src and targets in src
    src = src.replace(pooled, "        return self.head(h).squeeze(-1)")
    src = src.replace(targets, "def example_targets(batch_size):\n"
                               "    return torch.randn(sum(graph_sizes(batch_size)[0]))")
    f = base / "pyg_nodes.py"
    f.write_text(src)
    return f


def _plan(model, out_dir, world, batch, force=None, kinds=None, env=None):
    from fakes import synthetic_profile

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    with pytest.MonkeyPatch.context() as mp:
        for k, v in (env or {}).items():
            mp.setenv(k, v)
        force = force(model) if callable(force) else force
        r = make_plan(model, PlanOptions(world_size=world, batch_size=batch, out_dir=str(out_dir), kinds=kinds,
                                         max_candidates=64),
                      PlanHooks(profile=synthetic_profile(), force=force or {}))
    return r


def _gpt2_force(model):
    from autopar.modelfile import load_model_file
    from autopar.planner import attention_units
    from autopar.trace.tracer import trace_model
    g = attention_units(trace_model(load_model_file(model), 4))

    def unit(m):
        return max((lay for lay in g.layers if lay.module == m), key=lambda lay: len(lay.ops)).index
    return {unit(m): c for m, c in GPT2_TP.items()}


def _mixed_graph_force(model):
    from fakes import synthetic_profile
    from gnn_helpers import forced

    from autopar.modelfile import load_model_file
    from autopar.trace.tracer import trace_model
    return forced(trace_model(load_model_file(model), 4), synthetic_profile(), 2, "mix")


def _graphs_force(model):
    from autopar.modelfile import load_model_file
    from autopar.trace.tracer import trace_model
    g = trace_model(load_model_file(model), 4)
    return {lay.index: "graphs(2,4)" for lay in g.layers}


#: case -> (model file (or a function of the temp folder making it), world, batch, force, kinds,
#:          environment, whether per-sample items make sense for plan_loader, what the plan must hold)
CASES = {
    "lm_vocab": (EXAMPLES / "hf_gpt2.py", 4, 4, _gpt2_force, None, {}, True, {"vocab_head(2,2)", "head(2,2)"}),
    "pyg_nodes": (_pyg_nodes_file, 2, 4, _mixed_graph_force, None, GNN_SMALL, False, {"nodes(1,2)", "edges(1,2)"}),
    "pixels": ("seg", 2, 4, {0: "spatial(1,2x1)", 1: "spatial(1,2x1)"}, ("spatial", "sample", "replicate"), {},
               True, {"spatial(1,2x1)"}),
    "graph_padded": (EXAMPLES / "gnn_pcqm4m.py", 2, 4, None, None, GNN_SMALL, True, set()),
    "graph_pyg": (EXAMPLES / "pyg_nnconv.py", 2, 4, _graphs_force, None, GNN_SMALL, False, {"graphs(2,4)"}),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("targets")


def _model_file(case, base):
    m = CASES[case][0]
    if m == "seg":
        f = base / "seg.py"
        f.write_text(textwrap.dedent(SEG))
        return f
    return m(base) if callable(m) else m


def _batch(mf, batch):
    import torch
    torch.manual_seed(1)
    xs = [x.double() if x.is_floating_point() else x for x in mf.example_inputs(batch)]
    y = mf.example_targets(batch)
    return xs, (y.double() if y.is_floating_point() else y)


class _Items:
    def __init__(self, xs, y):
        self.xs, self.y = xs, y

    def __len__(self):
        return int(self.y.shape[0])

    def __getitem__(self, i):
        return (*[x[i] for x in self.xs], self.y[i])


def _run(rank, world, model, plan, batch, env, loader):
    import torch

    import autopar
    from autopar.modelfile import load_model_file
    os.environ.update(env)
    mf = load_model_file(model)
    torch.manual_seed(0)
    dm = autopar.parallelize(mf.build_model().double(), plan)
    xs, y = _batch(mf, batch)
    local, t = autopar.shard_batch(dm, xs, y)
    if loader:        # per-sample items, unshuffled: the loader's one batch is the same global batch
        (lx, lt), = list(autopar.plan_loader(_Items(xs, y), dm, shuffle=False))
        assert len(lx) == len(local) and all(torch.equal(a, b) for a, b in zip(lx, local)), rank
        assert torch.equal(lt, t), rank
    else:             # a concatenated PyG batch has no per-sample items: the loader says so
        from autopar.train import BatchMismatch
        try:
            autopar.plan_loader(_Items(xs, y), dm)
            raise AssertionError("plan_loader took a batch of nodes for samples")
        except BatchMismatch as e:
            assert "autopar.shard_batch" in e.hint, e.hint
    loss = dm.loss(local, t)
    loss.backward()
    res = {"loss": loss.item(), "grads": {q: g.tolist() for q, g in dm.full_grads().items()},
           "target_shape": list(t.shape)}
    if rank == 0:
        torch.manual_seed(0)
        ref = mf.build_model().double()
        rloss = mf.loss_fn()(ref(*xs), y)
        rloss.backward()
        res["ref"] = {"loss": rloss.item(), "grads": {q: p.grad.tolist() for q, p in ref.named_parameters()},
                      "target_shape": list(y.shape)}
    return res


def _close(a, b):
    import torch
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max()) <= RTOL * float(b.abs().max()) + ATOL


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_targets_of_any_shape_give_the_single_process_loss(case, base):
    if case.startswith("pyg") or case.startswith("graph_pyg"):
        pytest.importorskip("torch_geometric")
    if case == "lm_vocab":
        pytest.importorskip("transformers")
    from autopar.runtime.launch import run_ranks
    _, world, batch, force, kinds, env, loader, must = CASES[case]
    model = _model_file(case, base)
    r = _plan(model, base / case, world, batch, force, kinds, env)
    assert must <= {d.choice for d in r.plan.layers}, [d.choice for d in r.plan.layers]
    got = run_ranks(_run, world, args=(str(model), str(r.plan_path), batch, env, loader), timeout_s=300)
    ref = got[0]["ref"]
    rows = 0
    for rank, res in enumerate(got):
        assert res["target_shape"][1:] == ref["target_shape"][1:], (rank, res["target_shape"])   # rows cut only
        rows += res["target_shape"][0]
        assert abs(res["loss"] - ref["loss"]) <= RTOL * abs(ref["loss"]), (rank, res["loss"], ref["loss"])
        bad = [q for q in ref["grads"] if not _close(res["grads"][q], ref["grads"][q])]
        assert set(res["grads"]) == set(ref["grads"]) and not bad, (rank, bad)
    # every target row read by some rank (replicas read theirs again)
    assert rows >= ref["target_shape"][0]


# ---- bad input: named errors listing what the plan expects ----------------------------------

@pytest.fixture(scope="module")
def seg_w1(base):
    """The segmentation model parallelized at world 1 (no process group needed)."""
    import torch

    import autopar
    from autopar.modelfile import load_model_file
    model = _model_file("pixels", base)
    r = _plan(model, base / "seg-w1", 1, 4)
    torch.manual_seed(0)
    return autopar.parallelize(load_model_file(model).build_model().double(), r.plan_path)


EXPECTS = "input 0 (x) [4, 3, 8, 8], an item's [3, 8, 8]; target [4, 8, 8], an item's [8, 8]"


def test_items_of_the_wrong_form_are_named_with_what_the_plan_expects(seg_w1):
    import torch

    import autopar
    from autopar.train import BatchMismatch
    x, y = torch.randn(8, 3, 8, 8, dtype=torch.float64), torch.randint(0, 3, (8, 8, 8))
    good = [(x[i], y[i]) for i in range(8)]
    assert len(list(autopar.plan_loader(good, seg_w1))) == 2
    for items, what in (([(x[i], y[i], y[i]) for i in range(8)], "has 3 field(s); the plan's model takes 1 input(s)"),
                        ([(x[i, :, :4], y[i]) for i in range(8)], "input 0 has shape [3, 4, 8]"),
                        ([(x[i], y[i, :4]) for i in range(8)], "the target has shape [4, 8]"),
                        ([(x[i], y[i]) for i in range(7)] + [(x[7],)], "items have 1 and 2 fields")):
        with pytest.raises(BatchMismatch) as e:
            list(autopar.plan_loader(items, seg_w1, shuffle=False))
        assert what in str(e.value) and EXPECTS in str(e.value), str(e.value)
        assert isinstance(e.value, ValueError)          # what shard_batch raised before


def test_batches_of_the_wrong_shape_are_named_with_what_the_plan_expects(seg_w1):
    import torch

    import autopar
    from autopar.train import BatchMismatch
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.randint(0, 3, (4, 8, 8))
    (xl,), t = autopar.shard_batch(seg_w1, x, y)
    assert torch.equal(xl, x) and torch.equal(t, y)
    for args, what in (((x, y[:2]), "the target has shape [2, 8, 8]"),
                       ((x, y[..., 0]), "the target has shape [4, 8]"),
                       ((x[:2], y), "input 0 has shape [2, 3, 8, 8]"),
                       (([x, x], y), "the batch has 2 input(s), the plan's model takes 1")):
        with pytest.raises(BatchMismatch) as e:
            autopar.shard_batch(seg_w1, *args)
        assert what in str(e.value) and EXPECTS in str(e.value), str(e.value)


def test_without_example_targets_the_target_rows_are_checked(seg_w1):
    """A sharding that does not know the target's shape (a loss of the caller's own) checks its
    rows: those of the output's dim 0."""
    import dataclasses

    import torch

    import autopar
    from autopar.train import BatchMismatch, BatchSharding
    sh = dataclasses.replace(BatchSharding.of(seg_w1), target_shape=None)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    _, t = autopar.shard_batch(sh, x, torch.zeros(4, 5))         # any trailing shape
    assert t.shape == (4, 5)
    with pytest.raises(BatchMismatch, match=r"the target has shape \[3, 5\].*target \[4, \.\.\.\]"):
        autopar.shard_batch(sh, x, torch.zeros(3, 5))
