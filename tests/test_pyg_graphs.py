"""Graph parallelism of the untouched PyG model (``strategies/examples/pyg_nnconv.py``): the
plan-level alternative ``graphs(P)`` (``autopar.decomp.graph.graphs``) gives every rank B / P
whole graphs of the concatenated batch, split generically from the trace's node / edge marks
(``autopar.runtime.graphs.split_graph_batch``), and runs the user's module natively.

* the generic split equals the model file's own ``ddp_shard`` (inputs and targets), and the
  mean of the ranks' gradients under it equals the batch's gradient in float64;
* graphs(2) and graphs(4) equal to PyG on one process in float64 (output, loss, every input
  and parameter gradient, parameters after a step), run natively;
* the planner prices it against the op-by-op plan and records both predictions; with fewer
  graphs than ranks it is illegal and the op-by-op plan stays;
* bad input: graphs not contiguous in ``batch``, B not divisible by the ranks (named errors);
* the DDP baseline of a model file without ``ddp_shard`` uses the generic split.
"""

import json

import pytest

pytest.importorskip("torch_geometric")

from gnn_helpers import assert_validated, plan_and_validate, small_sizes, trace  # noqa: E402

MODEL = "pyg_nnconv"


@pytest.fixture(autouse=True)
def _small():
    with small_sizes():
        yield


def _load(root):
    from autopar.modelfile import load_model_file
    return load_model_file(root / f"strategies/examples/{MODEL}.py")


def _roles(root):
    from autopar.decomp.graph.graphs import graph_roles
    g = trace(root, MODEL)
    roles, why = graph_roles(g)
    assert roles is not None, why
    return g, roles


def test_roles_come_from_the_trace(root):
    g, roles = _roles(root)
    names = [gi.name for gi in g.inputs]
    assert [names[i] for i in roles.node] == ["x"]
    assert names[roles.batch] == "batch" and names[roles.edge_index] == "edge_index"
    assert sorted(names[i] for i, _ in roles.edge) == ["edge_attr", "edge_index"]
    assert roles.graphs == 4


@pytest.mark.parametrize("world", [2, 4])
def test_generic_split_equals_the_model_files_ddp_shard(root, world):
    import torch
    from autopar.runtime.graphs import split_graph_batch
    _, roles = _roles(root)
    mf = _load(root)
    torch.manual_seed(0)
    xs, ys = list(mf.example_inputs(4)), mf.example_targets(4)
    for r in range(world):
        mine, y, sh = split_graph_batch(roles, xs, ys, r, world)
        theirs, ty, _ = mf.ddp_shard()(tuple(xs), ys, r, world)
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert torch.equal(y, ty)
        assert sh.g1 - sh.g0 == 4 // world


@pytest.mark.parametrize("world", [2, 4])
def test_generic_split_gradients_sum_to_the_batch_gradient(root, world):
    """Each rank runs the user's module (built for the whole batch: ``global_add_pool(size=B)``)
    on its graphs, keeps its B / P output rows (``graph_rows``) and weights its loss by
    n_r / N: the sum over ranks of the gradients is the batch's, in float64 (rtol 1e-10)."""
    import torch
    from autopar.runtime.graphs import graph_rows, split_graph_batch
    _, roles = _roles(root)
    mf = _load(root)
    torch.manual_seed(0)
    xs = [x.double() if x.is_floating_point() else x for x in mf.example_inputs(4)]
    ys = mf.example_targets(4).double()
    model = mf.build_model().double()
    loss = mf.loss_fn()(model(*xs), ys)
    ref = torch.autograd.grad(loss, list(model.parameters()))
    acc = [torch.zeros_like(g) for g in ref]
    for r in range(world):
        local, y, _ = split_graph_batch(roles, xs, ys, r, world)
        out = graph_rows(model(*local), roles.graphs, world)
        gs = torch.autograd.grad(mf.loss_fn()(out, y) * (y.shape[0] / ys.shape[0]), list(model.parameters()))
        acc = [a + g for a, g in zip(acc, gs)]
    for a, g in zip(acc, ref):
        torch.testing.assert_close(a, g, rtol=1e-10, atol=1e-12)


def test_unsorted_batch_and_indivisible_graphs_are_named_errors(root):
    import torch
    from autopar.runtime.graphs import GraphBatchError, split_graph_batch
    _, roles = _roles(root)
    mf = _load(root)
    xs = list(mf.example_inputs(4))
    batch = xs[roles.batch].clone()
    i = int((batch == 1).nonzero()[0, 0])          # the first node of graph 1 ...
    batch[i], batch[i - 1] = batch[i - 1].clone(), batch[i].clone()   # ... swapped with graph 0's last
    bad = list(xs)
    bad[roles.batch] = batch
    with pytest.raises(GraphBatchError, match=r"graph 0's nodes are not contiguous"):
        split_graph_batch(roles, bad, None, 0, 2)
    with pytest.raises(GraphBatchError, match="4 graphs in the batch do not split evenly over 3 ranks"):
        split_graph_batch(roles, xs, None, 0, 3)
    bad[roles.batch] = torch.where(xs[roles.batch] == 3, 7, xs[roles.batch])
    with pytest.raises(GraphBatchError, match="outside the batch's 4 graphs"):
        split_graph_batch(roles, bad, None, 0, 2)


def test_planner_records_both_predictions_and_refuses_too_few_graphs(root, monkeypatch):
    """Planning with the committed CPU profile: graphs(P) priced beside the ILP's op-by-op plan
    (both in plan.json under solver.graph_parallel); with 2 graphs at world 4 it is illegal and
    the op-by-op plan (a split one) stays."""
    from autopar.artifacts import PlanOptions
    from autopar.planner import make_plan
    cal = str(root / "calibration/cpu-2core-gloo.json")
    r = make_plan(root / f"strategies/examples/{MODEL}.py",
                  PlanOptions(world_size=2, batch_size=4, calibration=cal, measure_shapes=False, write=False))
    rec = r.plan.solver.extra["graph_parallel"]
    assert rec["illegal"] is None and rec["graphs_step_time_s"] > 0 and rec["op_by_op_step_time_s"] > 0
    # priced at the largest rank's share of the example batch's nodes and edges (graphs differ)
    sh = rec["priced_shares"]
    assert 0.5 <= sh["node"] < 1 and 0.5 <= sh["edge"] < 1 and "largest rank" in sh["source"]
    chosen_graphs = rec["chosen"] == "graphs(2)"
    assert chosen_graphs == (rec["graphs_step_time_s"] < rec["op_by_op_step_time_s"])
    if chosen_graphs:
        assert {d.choice for d in r.plan.layers} == {"graphs(2,4)"}
        assert r.plan.predicted.step_time_s == pytest.approx(rec["graphs_step_time_s"])
    monkeypatch.setenv("AUTOPAR_GNN_GRAPHS", "2")
    r = make_plan(root / f"strategies/examples/{MODEL}.py",
                  PlanOptions(world_size=4, batch_size=2, calibration=cal, measure_shapes=False, write=False))
    rec = r.plan.solver.extra["graph_parallel"]
    assert rec["chosen"] == "op-by-op" and "2 graphs < 4 ranks" in rec["illegal"]
    assert not any(d.kind == "graphs" for d in r.plan.layers)
    assert {d.kind for d in r.plan.layers} - {"replicate"}       # still split op by op


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_graphs_equal_to_pyg_on_one_process(root, tmp_path, profile, world):
    g = trace(root, MODEL)
    force = {lay.index: "graphs" for lay in g.layers}
    r, run = plan_and_validate(root, tmp_path, profile, MODEL, world, force)
    assert {d.choice for d in r.plan.layers} == {f"graphs({world},4)"}
    assert r.plan.solver.extra["graph_parallel"]["chosen"] == f"graphs({world})"
    params = {q for lay in g.layers for op in lay.ops for q in op.param_names.values()}
    assert_validated(run, params)
    names = {c.tensor for c in run.validation.checks}
    assert {"input_grad:x", "input_grad:edge_attr", "output", "loss"} <= names
    assert {f"param_after_step:{p}" for p in params} <= names
    assert run.extra["native_runtime"] is True


@pytest.mark.dist
def test_ddp_baseline_without_ddp_shard_splits_whole_graphs(root, tmp_path):
    """A copy of the PyG model file without ``ddp_shard``: ``autopar execute`` still times a
    same-function DDP baseline, split by the generic graph split."""
    from autopar.cli import main
    src = (root / f"strategies/examples/{MODEL}.py").read_text()
    cut = src.index("def ddp_shard(")
    end = src.index("def loss_fn(")
    model = tmp_path / "pyg_plain.py"
    model.write_text(src[:cut] + src[end:])
    out = tmp_path / "plan"
    assert main(["plan", str(model), "--world-size", "2", "--batch-size", "4", "--calibration",
                 str(root / "calibration/cpu-2core-gloo.json"), "-o", str(out)]) == 0
    assert main(["execute", str(out / "plan.json"), "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["validation"]["passed"]
    assert run["baseline"]["equivalent"] and "generic graph split" in run["baseline"]["note"]


def test_kinds_graphs_alone_asks_for_it_and_a_padded_batch_refuses(root):
    from autopar.artifacts import PlanOptions
    from autopar.errors import AutoparError
    from autopar.planner import make_plan
    cal = str(root / "calibration/cpu-2core-gloo.json")
    r = make_plan(root / f"strategies/examples/{MODEL}.py",
                  PlanOptions(world_size=2, batch_size=4, calibration=cal, measure_shapes=False, write=False,
                              kinds=("graphs",)))
    assert {d.choice for d in r.plan.layers} == {"graphs(2,4)"}
    assert r.plan.solver.extra["graph_parallel"]["why"] == "forced"
    with pytest.raises(AutoparError, match="a padded batch: sample"):
        make_plan(root / "strategies/examples/gnn_pcqm4m.py",
                  PlanOptions(world_size=2, batch_size=4, calibration=cal, measure_shapes=False, write=False,
                              kinds=("graphs",)))


@pytest.mark.dist
def test_small_batch_under_a_memory_limit_splits_edges(root, tmp_path, monkeypatch):
    """LBANN's PCQM4M sizes in the PyG model, 2 graphs at world 4, 4 MiB per rank: graphs(4)
    is illegal (fewer graphs than ranks), so the planner splits edges; ``autopar execute``
    validates it against PyG on one process (committed CPU profile)."""
    from autopar.cli import main
    for k in ("AUTOPAR_GNN_NODE_EMBED", "AUTOPAR_GNN_OUT", "AUTOPAR_GNN_NODES", "AUTOPAR_GNN_EDGES"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AUTOPAR_GNN_GRAPHS", "2")
    out = tmp_path / "plan"
    assert main(["plan", str(root / f"strategies/examples/{MODEL}.py"), "--world-size", "4",
                 "--batch-size", "2", "--memory-limit", "4MiB",
                 "--calibration", str(root / "calibration/cpu-2core-gloo.json"), "-o", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert "2 graphs < 4 ranks" in plan["solver"]["graph_parallel"]["illegal"]
    kinds = {d["decomposition"]["kind"] for d in plan["layers"]}
    assert kinds & {"edges", "nodes"}, kinds
    assert main(["execute", str(out / "plan.json"), "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "run.json").read_text())["validation"]["passed"]


def test_largest_shares_are_the_biggest_rank_of_the_split(root):
    import torch
    from autopar.runtime.graphs import largest_shares, split_graph_batch
    _, roles = _roles(root)
    mf = _load(root)
    xs = list(mf.example_inputs(4))
    for world in (2, 4):
        sh = largest_shares(roles, xs, world)
        parts = [split_graph_batch(roles, xs, None, r, world)[0] for r in range(world)]
        assert sh["node"] == max(p[0].shape[0] for p in parts) / xs[0].shape[0]
        assert sh["edge"] == max(p[2].shape[0] for p in parts) / xs[2].shape[0]
        assert sh["node"] >= 1 / world and torch.is_tensor(xs[0])
