"""The untouched PyTorch Geometric NNConv model (``strategies/examples/pyg_nnconv.py``: NNConv
with an edge MLP, ``global_add_pool``, the concatenated PyG batch, MAE loss) traced on meta and
split by ``edges`` (edge_attr / edge_index blocks per rank, the NNConv scatter-add left as a
partial sum) and ``nodes`` (node-wise layers, the ``global_add_pool`` scatter as a partial sum),
at world 2 and 4 equal to PyG on one process in float64 (every tensor the ``autopar execute``
validation checks). Also ``autopar plan`` + ``autopar execute`` through the CLI."""

import json

import pytest

pytest.importorskip("torch_geometric")

from gnn_helpers import assert_validated, forced, plan_and_validate, small_sizes, trace  # noqa: E402

MODEL = "pyg_nnconv"


@pytest.fixture(autouse=True)
def _small():
    with small_sizes():
        yield


def _params(graph):
    return {q for lay in graph.layers for op in lay.ops for q in op.param_names.values()}


def test_pyg_model_traces_with_every_op_registered(root):
    g = trace(root, MODEL)
    assert not g.unregistered, g.unregistered
    kinds = [op.kind for lay in g.layers for op in lay.ops]
    assert "gather" in kinds and kinds.count("scatter") == 2      # message passing + pooling
    items = {v: tuple(it) for lay in g.layers for op in lay.ops for v, it in (op.attrs.get("items") or {}).items()}
    assert items["edge_index"] == (1, "edge") and items["edge_attr"] == (0, "edge")
    assert items["x"] == (0, "node") and items["batch"] == (0, "node")


CASES = [(2, "edges"), (4, "edges"), (2, "mix"), (4, "mix")]


@pytest.mark.dist
@pytest.mark.parametrize("world,mode", CASES, ids=[f"w{w}-{m}" for w, m in CASES])
def test_pyg_split_equal_to_pyg_on_one_process(root, tmp_path, profile, world, mode):
    g = trace(root, MODEL)
    force = forced(g, profile, world, mode)
    r, run = plan_and_validate(root, tmp_path, profile, MODEL, world, force)
    chosen = {d.layer: str(d.decomposition()) for d in r.plan.layers}
    scatters = [lay.index for lay in g.layers if lay.anchor.kind == "scatter"]
    assert chosen[scatters[0]] == f"edges(1,{world})"
    if mode == "mix":
        assert chosen[scatters[1]] == f"nodes(1,{world})"          # global_add_pool
    assert_validated(run, _params(g))


def test_edge_joining_two_graphs_is_a_named_error(root):
    import torch
    from autopar.decomp.graph.inputs import EdgeIndexError, check_edge_indices
    from autopar.modelfile import load_model_file
    g = trace(root, MODEL)
    mf = load_model_file(root / f"strategies/examples/{MODEL}.py")
    x, ei, ea, batch = mf.example_inputs(4)
    check_edge_indices(g, [x, ei, ea, batch])
    bad = ei.clone()
    bad[1, 0] = int(x.shape[0]) - 1                  # edge 0 of graph 0 into the last graph
    with pytest.raises(EdgeIndexError, match="joins graph 0 to graph 3"):
        check_edge_indices(g, [x, bad, ea, batch])
    bad[1, 0] = int(x.shape[0])
    with pytest.raises(EdgeIndexError, match="outside the batch"):
        check_edge_indices(g, [x, bad, ea, batch])


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_cli_plan_and_execute_non_replicated(root, tmp_path, world):
    """``autopar plan`` (committed CPU profile) + ``autopar execute``: a plan that splits
    something, validated against PyG on one process."""
    from autopar.cli import main
    out = tmp_path / "plan"
    assert main(["plan", str(root / f"strategies/examples/{MODEL}.py"), "--world-size", str(world),
                 "--batch-size", "4", "--calibration", str(root / "calibration/cpu-2core-gloo.json"),
                 "-o", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    kinds = {d["decomposition"]["kind"] for d in plan["layers"]}
    assert kinds - {"replicate"}, kinds
    assert main(["execute", str(out / "plan.json"), "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["validation"]["passed"]
    # a DDP baseline over whole graphs per rank (the model file's ddp_shard), same function
    assert run["baseline"]["equivalent"] and "ddp_shard" in run["baseline"]["note"]
    assert run["ratio_to_ddp"] > 0


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_shard_is_the_same_function(root, world):
    """The DDP baseline's split (whole graphs per rank, edges re-indexed, a model for G / world
    graphs): the mean over ranks of each rank's loss gradient (what DDP computes) equals the
    full batch's gradient on one process, in float64 to rounding (rtol 1e-10)."""
    import torch
    from autopar.modelfile import load_model_file
    mf = load_model_file(root / f"strategies/examples/{MODEL}.py")
    torch.manual_seed(0)
    xs = [x.double() if x.is_floating_point() else x for x in mf.example_inputs(4)]
    ys = mf.example_targets(4).double()
    full = mf.build_model().double()
    loss = mf.loss_fn()(full(*xs), ys)
    ref = torch.autograd.grad(loss, list(full.parameters()))
    acc = [torch.zeros_like(g) for g in ref]
    for r in range(world):
        local, t, model = mf.ddp_shard()(tuple(xs), ys, r, world)
        model = model.double()
        model.load_state_dict(full.state_dict())
        gs = torch.autograd.grad(mf.loss_fn()(model(*local), t), list(model.parameters()))
        acc = [a + g / world for a, g in zip(acc, gs)]
    for a, g in zip(acc, ref):
        torch.testing.assert_close(a, g, rtol=1e-10, atol=1e-12)
