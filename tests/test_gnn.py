"""The dense padded NNConv (LBANN's PCQM4M model, ``strategies/examples/gnn_pcqm4m.py``) under
the graph decompositions: graphs (``sample``), ``edges`` (blocks of edges, scatter-add left as
a partial sum), ``nodes`` (node-wise layers and the sum pooling), the 2-D grids graphs x edges
and graphs x nodes, their mixes and ``filter`` on the edge MLP's wide output layer; each at
world 2 and 4 equal to one process in float64 (output, loss, input gradients, every parameter
gradient, parameters after a step: the ``autopar execute`` validation, tolerance
``1e-9 * max|ref| + 1e-12`` per tensor). Small sizes through ``AUTOPAR_GNN_*``."""

import pytest

from gnn_helpers import assert_validated, forced, kinds_of, plan_and_validate, small_sizes, trace

MODEL = "gnn_pcqm4m"


@pytest.fixture(autouse=True)
def _small():
    with small_sizes():
        yield


def _params(graph):
    return {q for lay in graph.layers for op in lay.ops for q in op.param_names.values()}


def test_tracer_marks_edge_and_node_values(root):
    g = trace(root, MODEL)
    items = {v: tuple(it) for lay in g.layers for op in lay.ops for v, it in (op.attrs.get("items") or {}).items()}
    assert items["e"] == (1, "edge") and items["src"] == (1, "edge") and items["dst"] == (1, "edge")
    assert items["x"] == (1, "node") and items["node_mask"] == (1, "node")
    assert items["pad"] == (1, "node")            # the extra zero node is a node extent too
    head = [lay for lay in g.layers if lay.module.startswith("head")]
    assert head and not any(kinds_of(lay) for lay in head)   # graph-level values are neither


def test_a_lone_gather_is_not_message_passing(tmp_path):
    """A gather without a scatter into the same nodes (a loss picking each sample's class)
    marks no value as edge or node: no graph decomposition is offered."""
    from autopar.modelfile import load_model_file
    from autopar.trace.tracer import trace_model
    f = tmp_path / "pick.py"
    f.write_text("import torch\nfrom torch import nn\n"
                 "class M(nn.Module):\n"
                 "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(4, 3)\n"
                 "    def forward(self, x, idx):\n        return torch.gather(self.lin(x), 1, idx).squeeze(1)\n"
                 "def build_model():\n    return M()\n"
                 "def example_inputs(b):\n    return torch.randn(b, 4), torch.zeros(b, 2, dtype=torch.long)\n")
    g = trace_model(load_model_file(f), 4)
    assert any(op.kind == "gather" for lay in g.layers for op in lay.ops)
    assert not any(op.attrs.get("items") for lay in g.layers for op in lay.ops)


def test_edges_leave_a_partial_sum_and_nodes_pool_into_one(root, profile):
    from autopar.decomp import CostContext
    from autopar.decomp.graph import Edges, Nodes
    from autopar.decomp.sharding import Partial, Shard, Sharding
    g = trace(root, MODEL)
    ctx = CostContext(profile=profile, world=4, ranks_per_node=4, batch_size=4)
    scatter = next(lay for lay in g.layers if lay.anchor.kind == "scatter")
    gather = next(lay for lay in g.layers if lay.anchor.kind == "gather")
    pool = next(lay for lay in g.layers if lay.anchor.kind == "sum")
    e = Edges(2, 2)
    assert e.check(scatter, ctx) is None and e.check(gather, ctx) is None
    assert e.out_placement(scatter) == Sharding.of((Shard(0), 2), (Partial(), 2))
    assert e.in_placement(gather, "pad") == Sharding.of((Shard(0), 2))          # whole nodes per graph group
    assert e.out_placement(gather) == Sharding.of((Shard(0), 2), (Shard(1), 2))
    assert Nodes(1, 4).out_placement(pool) == Sharding.of((Partial(), 4))
    assert "does not run unchanged" in Nodes(1, 4).check(next(l for l in g.layers if l.anchor.kind == "pad"), ctx)
    # only a sum splits into addends: a max aggregation of messages is not an edge split
    import copy
    amax = copy.deepcopy(scatter)
    amax.ops[0].target = "aten.scatter_reduce.two"
    amax.ops[0].args = amax.ops[0].args + ["amax", True]
    amax.ops[0].attrs = {**amax.ops[0].attrs, "reduce": "amax"}
    assert "must add" in Edges(2, 2).check(amax, ctx)
    # the gather of a block of edges is priced on that block: fewer elements, less time
    from autopar.decomp.replicate import Replicate
    assert 0 < Edges(1, 4).cost(gather, ctx).fwd_compute_s < Replicate().cost(gather, ctx).fwd_compute_s


CASES = [(2, "graphs", None),
         (2, "edges", None), (4, "edges", "(1,4)"), (4, "edges", "(2,2)"),
         (2, "nodes", None), (4, "nodes", "(2,2)"),
         (2, "mix", None), (4, "mix", "(1,4)"), (4, "mix", "(2,2)")]


@pytest.mark.dist
@pytest.mark.parametrize("world,mode,want", CASES, ids=[f"w{w}-{m}{x or ''}" for w, m, x in CASES])
def test_decomposition_equal_to_one_process(root, tmp_path, profile, world, mode, want):
    g = trace(root, MODEL)
    force = forced(g, profile, world, mode, want)
    assert force, "nothing to force"
    r, run = plan_and_validate(root, tmp_path, profile, MODEL, world, force)
    chosen = {d.layer: str(d.decomposition()) for d in r.plan.layers}
    for li, dec in force.items():
        assert chosen[li] == dec
    if mode in ("edges", "mix"):
        scat = next(lay.index for lay in g.layers if lay.anchor.kind == "scatter")
        assert chosen[scat].startswith("edges")
        # the partial sum is resolved on the way out, priced by the redistribution pricing
        out = [t for t in r.plan.transitions if t.src == scat]
        assert out and all(any(k in t.extra["steps"] for k in ("ReduceScatter", "AllReduce")) for t in out)
        assert all(t.fwd_s > 0 for t in out)
    assert_validated(run, _params(g))


@pytest.mark.dist
def test_filter_on_the_edge_mlp_output_composes_with_edges(root, tmp_path, profile):
    g = trace(root, MODEL)
    last = next(lay.index for lay in g.layers if lay.module == "convs.0.edge_mlp.4")
    force = forced(g, profile, 4, "edges", "(2,2)", extra={last: "filter(1,4)"})
    r, run = plan_and_validate(root, tmp_path, profile, MODEL, 4, force)
    assert str(r.plan.layer(last).decomposition()) == "filter(1,4)"
    assert_validated(run, _params(g))


def test_op_families_of_message_passing_code():
    """pad, expand_as and new_zeros (what PyG and the padded form write around message
    passing) are registered: independent where they do not pad or broadcast."""
    from types import SimpleNamespace as Op
    from autopar.ops import FAMILIES
    pad = Op(kind="pad", target="aten.pad.default", args=[{"v": "x"}, [0, 0, 0, 1], "constant", None],
             kwargs={}, in_shapes=[[4, 6, 8]], out_shape=[4, 7, 8], inputs=["x"])
    assert FAMILIES["pad"].independent_dims(pad) == {0, 2}
    pad.args[2] = "reflect"
    assert FAMILIES["pad"].independent_dims(pad) == frozenset()
    ea = Op(kind="expand_as", target="aten.expand_as.default", args=[{"v": "i"}, {"v": "m"}], kwargs={},
            in_shapes=[[10, 1], [10, 4]], out_shape=[10, 4], inputs=["i", "m"])
    assert FAMILIES["expand_as"].independent_dims(ea) == {0}
    nz = Op(kind="new_tensor", target="aten.new_zeros.default", args=[{"v": "m"}, [6, 4]], kwargs={},
            in_shapes=[[10, 4]], out_shape=[6, 4], inputs=["m"])
    assert FAMILIES["new_tensor"].independent_dims(nz) == frozenset()


def test_out_of_range_edge_index_is_a_named_error(root):
    import torch
    from autopar.decomp.graph.inputs import EdgeIndexError, check_edge_indices
    from autopar.modelfile import load_model_file
    g = trace(root, MODEL)
    mf = load_model_file(root / f"strategies/examples/{MODEL}.py")
    torch.manual_seed(0)
    xs = list(mf.example_inputs(4))
    check_edge_indices(g, xs)                       # the example's batch is fine
    nodes = int(xs[4][1].sum())                     # graph 1's real nodes (node_mask)
    bad = xs[2].clone()
    bad[1, 0] = nodes                               # a padded node of graph 1, not the pad index
    with pytest.raises(EdgeIndexError, match=r"src\[1, 0\].*graph 1"):
        check_edge_indices(g, [xs[0], xs[1], bad, xs[3], xs[4]])
    bad = xs[3].clone()
    bad[0, 3] = 99                                  # past the node tensor
    with pytest.raises(EdgeIndexError, match="graph 0"):
        check_edge_indices(g, [xs[0], xs[1], xs[2], bad, xs[4]])


@pytest.mark.dist
def test_small_batch_under_a_memory_limit_splits_edges(root, tmp_path):
    """LBANN's PCQM4M sizes, batch 2 at world 4, 3 MiB per rank: graphs alone cannot use the
    four ranks (two graphs), so the planner splits edges (the 2-D grid graphs x edges) or
    nodes; ``autopar plan`` + ``autopar execute`` validate it (committed CPU profile)."""
    import json
    from autopar.cli import main
    with pytest.MonkeyPatch.context() as mp:
        for k in ("AUTOPAR_GNN_NODE_EMBED", "AUTOPAR_GNN_OUT", "AUTOPAR_GNN_NODES", "AUTOPAR_GNN_EDGES"):
            mp.delenv(k, raising=False)
        out = tmp_path / "plan"
        assert main(["plan", str(root / f"strategies/examples/{MODEL}.py"), "--world-size", "4",
                     "--batch-size", "2", "--memory-limit", "3MiB",
                     "--calibration", str(root / "calibration/cpu-2core-gloo.json"), "-o", str(out)]) == 0
        plan = json.loads((out / "plan.json").read_text())
        kinds = {d["decomposition"]["kind"] for d in plan["layers"]}
        assert kinds & {"edges", "nodes"}, kinds
        assert main(["execute", str(out / "plan.json"), "--steps", "1", "--out", str(tmp_path / "run")]) == 0
        assert json.loads((tmp_path / "run" / "run.json").read_text())["validation"]["passed"]


@pytest.mark.dist
@pytest.mark.parametrize("world", [2])
def test_cli_plan_and_execute_non_replicated(root, tmp_path, world):
    """``autopar plan`` (committed CPU profile) + ``autopar execute`` on the padded example:
    a plan that splits something, validated against one process (world 4 through the CLI:
    ``test_small_batch_under_a_memory_limit_splits_edges``)."""
    import json
    from autopar.cli import main
    out = tmp_path / "plan"
    assert main(["plan", str(root / f"strategies/examples/{MODEL}.py"), "--world-size", str(world),
                 "--batch-size", "4", "--calibration", str(root / "calibration/cpu-2core-gloo.json"),
                 "-o", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    kinds = {d["decomposition"]["kind"] for d in plan["layers"]}
    assert kinds - {"replicate"}, kinds
    assert main(["execute", str(out / "plan.json"), "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "run.json").read_text())["validation"]["passed"]


@pytest.mark.parametrize("world", [2, 4])
def test_padded_example_plans_pure_sample_that_runs_natively(root, world):
    """LBANN's PCQM4M sizes, batch 8 (committed CPU profile): every layer is sample(world) but
    the constant scatter buffer (``torch.zeros``), including the index ``unsqueeze`` / ``expand``
    layers (expand keeps dims it does not broadcast), so the plan runs the user's module
    natively (``runtime.native.why_not_native`` finds no reason)."""
    from autopar.artifacts import PlanOptions
    from autopar.modelfile import load_model_file
    from autopar.planner import make_plan
    from autopar.runtime.native import why_not_native
    with pytest.MonkeyPatch.context() as mp:
        for k in ("AUTOPAR_GNN_NODE_EMBED", "AUTOPAR_GNN_OUT", "AUTOPAR_GNN_NODES", "AUTOPAR_GNN_EDGES"):
            mp.delenv(k, raising=False)
        model = root / f"strategies/examples/{MODEL}.py"
        r = make_plan(model, PlanOptions(world_size=world, batch_size=8, measure_shapes=False, write=False,
                                         calibration=str(root / "calibration/cpu-2core-gloo.json")))
        graph = r.plan.graph()
        decisions = {d.layer: d.decomposition() for d in r.plan.layers}
        for lay in graph.layers:
            d = decisions[lay.index]
            if str(d) != f"sample({world})":
                assert d.kind == "replicate" and all(op.attrs.get("constant") for op in lay.ops), (lay.name, d)
        assert [lay.name for lay in graph.layers if lay.ops[0].kind == "expand"]
        mf = load_model_file(model)
        assert why_not_native(graph, decisions, world, r.plan.bn_stats(), mf.build_model(), 8) is None


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_sample_through_the_index_expand_op_by_op(root, tmp_path, profile, monkeypatch, world):
    """``src.unsqueeze(-1).expand(b, e, f)`` (literal global sizes) under sample(world) on the
    traced path (``AUTOPAR_NATIVE=0``): the runtime rewrites the sizes to the block's; equal to
    one process in float64."""
    monkeypatch.setenv("AUTOPAR_NATIVE", "0")
    g = trace(root, MODEL)
    force = forced(g, profile, world, "graphs", f"({world})")
    exp = [lay.index for lay in g.layers if lay.ops[0].kind == "expand"]
    assert exp and all(force.get(i) == f"sample({world})" for i in exp), (exp, force)
    r, run = plan_and_validate(root, tmp_path, profile, MODEL, world, force)
    assert all(str(d.decomposition()) == f"sample({world})" for d in r.plan.layers if d.layer in exp)
    assert_validated(run, _params(g))
    assert run.extra["native_runtime"] is False
