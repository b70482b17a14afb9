"""Padding of graphs: the --graph-sizes file, the planner's choice between one global maximum
and size buckets (on synthetic distributions whose answer is known), the plan record, the
run-time collate (exact against the unpadded computation in float64, and its errors)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from autopar.cost import padding as pad
from autopar.cost.graph_sizes import GraphSizes, GraphSizesError, load_graph_sizes, parse_graph_sizes
from autopar.runtime.graphs import (EdgeIndexOutOfRange, GraphTooLarge, MalformedGraph, PaddedCollate,
                                    PaddedShape, check_graphs, pad_graphs)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "strategies" / "examples" / "gnn_pcqm4m.py"
PROFILE = ROOT / "calibration" / "cpu-2core-gloo.json"
SIZES = ROOT / "strategies" / "graphs" / "pcqm4m_sizes.csv"


# ---- the graph-size file ---------------------------------------------------------------------

def test_parse_rows_histograms_header_and_comments():
    s = parse_graph_sizes("# a comment\nnodes,edges,count\n3,4\n\n3 4\n10\t20\t5  # five graphs\n", "f.csv")
    assert s.graphs == 7 and s.max_nodes == 10 and s.max_edges == 20
    assert dict(zip(zip(s.nodes, s.edges), s.counts)) == {(3, 4): 2, (10, 20): 5}
    assert s.mean_nodes() == pytest.approx((2 * 3 + 5 * 10) / 7)


@pytest.mark.parametrize("text, line, what", [
    ("nodes,edges\n3,4\n3,4,5,6\n", 3, "4 columns"),
    ("3,4\nx,4\n", 2, "not an integer"),
    ("3,4\n0,4\n", 2, "0 nodes"),
    ("3,-1\n", 1, "-1 edges"),
    ("3,4,0\n", 1, "count 0"),
    ("3\n", 1, "1 columns"),
])
def test_malformed_file_names_the_line(text, line, what):
    with pytest.raises(GraphSizesError) as ei:
        parse_graph_sizes(text, "sizes.csv")
    assert f"sizes.csv, line {line}" in str(ei.value) and what in str(ei.value)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(GraphSizesError, match="no graph sizes"):
        parse_graph_sizes("# nothing\n\n", "e.csv")
    with pytest.raises(GraphSizesError, match="not found"):
        load_graph_sizes(tmp_path / "absent.csv")


def test_cli_malformed_graph_sizes_is_a_named_error(tmp_path, capsys):
    from autopar.cli import main
    bad = tmp_path / "bad.csv"
    bad.write_text("nodes,edges\n10,20\n12,twenty\n")
    rc = main(["plan", str(MODEL), "--world-size", "2", "--batch-size", "8", "--calibration", str(PROFILE),
               "-o", str(tmp_path / "p"), "--graph-sizes", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and "line 3" in err and "not an integer" in err


def test_cli_plan_with_graph_sizes_prints_and_records_the_choice(tmp_path, capsys):
    from autopar.artifacts import load_plan
    from autopar.cli import main
    sizes = tmp_path / "sizes.csv"
    sizes.write_text("# two sizes\nnodes,edges,count\n6,10,900\n51,118,100\n")
    rc = main(["plan", str(MODEL), "--world-size", "2", "--batch-size", "8", "--calibration", str(PROFILE),
               "--placement", "block", "-o", str(tmp_path / "p"), "--graph-sizes", str(sizes),
               "--bucket-sampling", "grouped", "--train-steps", "100000", "--max-buckets", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "chosen: 2_buckets" in out and "N6/E10: 90.0 % of graphs" in out
    p = load_plan(tmp_path / "p" / "plan.json").padding
    assert p.policy == "2_buckets" and p.extra["steps"] == 100_000 and len(p.extra["candidates"]) == 2
    assert (tmp_path / "p" / "bucket-N6-E10" / "plan.json").is_file()


def test_cli_graph_sizes_does_not_combine_with_trainers(tmp_path, capsys):
    from autopar.cli import main
    rc = main(["plan", str(MODEL), "--world-size", "2", "--graph-sizes", str(SIZES), "--trainers", "2",
               "-o", str(tmp_path / "p")])
    assert rc == 2 and "does not combine with --trainers" in capsys.readouterr().err


def test_shipped_pcqm4m_like_file_matches_its_stated_statistics():
    s = load_graph_sizes(SIZES)
    assert s.graphs == 3_746_620 and s.max_nodes == 51 and s.max_edges == 118
    assert abs(s.mean_nodes() - 14.1) < 0.2 and abs(s.mean_edges() / 2 - 14.6) < 0.3
    assert "SYNTHETIC" in SIZES.read_text().splitlines()[0]


# ---- the decision on distributions whose answer is known -------------------------------------

def _linear_price(b: pad.Bucket) -> pad.ShapePrice:
    """A synthetic cost: 1 ms fixed + 10 us per padded edge + 5 us per padded node."""
    edge, node = 1e-5 * b.edges, 5e-6 * b.nodes
    return pad.ShapePrice(1e-3 + edge + node, edge, node, 0.0)


def _bimodal(small=99, large=1):
    return GraphSizes((5, 50), (8, 100), (small, large), "bimodal")


def test_one_size_means_one_shape():
    s = GraphSizes((7,), (12,), (100,), "uniform")
    d = pad.decide(s, _linear_price, batch_size=4, world_size=2)
    assert d.chosen.policy == "global_max" and len(d.candidates) == 1
    assert d.chosen.padded_work_fraction == 0.0 and d.chosen.rows[0]["step_fraction"] == 1.0


def test_grouped_buckets_win_on_a_bimodal_distribution():
    s = _bimodal()
    d = pad.decide(s, _linear_price, batch_size=4, world_size=2, sampling="grouped", steps=10_000)
    c = d.chosen
    assert [(b.nodes, b.edges) for b in c.buckets] == [(5, 8), (50, 100)]
    t_small, t_big = _linear_price(c.buckets[0]).step_time_s, _linear_price(c.buckets[1]).step_time_s
    assert c.expected_step_time_s == pytest.approx(0.99 * t_small + 0.01 * t_big)
    assert c.total_s == pytest.approx(10_000 * c.expected_step_time_s
                                      + 2 * pad.DEFAULT_SHAPE_SETUP_S + 2 * (t_small + t_big))
    assert c.rank_imbalance == 0.0
    assert [r["padded_work_fraction"] for r in c.rows] == [0.0, 0.0]
    gmax = d.candidates[0]
    assert gmax.policy == "global_max" and gmax.expected_step_time_s == pytest.approx(t_big)
    # padded work of the global max: edges 1 - mean/100, nodes 1 - mean/50, weighted by priced work
    me, mn = 0.99 * 8 + 0.01 * 100, 0.99 * 5 + 0.01 * 50
    p = _linear_price(pad.Bucket(50, 100))
    assert gmax.padded_work_fraction == pytest.approx(
        (p.edge_work_s * (1 - me / 100) + p.node_work_s * (1 - mn / 50)) / p.work_s)


def test_random_large_batches_hit_the_top_bucket_so_the_global_max_wins():
    s = _bimodal()
    d = pad.decide(s, _linear_price, batch_size=1024, world_size=8, steps=10_000)
    assert d.chosen.policy == "global_max"
    two = d.candidates[1]
    assert two.rows[1]["step_fraction"] == pytest.approx(1 - 0.99 ** 1024)
    assert sum(r["step_fraction"] for r in two.rows) == pytest.approx(1.0)
    # per-rank padding would leave ranks idle: 128 graphs per rank, P(rank small) = 0.99^128
    q_small = 0.99 ** 128
    t_s, t_b = (_linear_price(b).step_time_s for b in two.buckets)
    assert two.rank_imbalance == pytest.approx(1 - (q_small * t_s + (1 - q_small) * t_b)
                                               / two.expected_step_time_s)
    assert d.notes and "grouped" in d.notes[0]


def test_few_steps_do_not_pay_for_more_shapes():
    s = _bimodal()
    d = pad.decide(s, _linear_price, batch_size=4, world_size=2, sampling="grouped", steps=1)
    assert d.chosen.policy == "global_max"
    d = pad.decide(s, _linear_price, batch_size=4, world_size=2, sampling="grouped", steps=1,
                   shape_setup_s=0.0, warmup_steps=0)
    assert d.chosen.policy == "2_buckets"


def test_buckets_nest_and_end_at_the_global_max():
    s = load_graph_sizes(SIZES)
    for k in (1, 2, 3, 4):
        b = pad.make_buckets(s, k)
        assert b[-1] == pad.Bucket(51, 118) and len(b) <= k
        assert all(x.nodes <= y.nodes and x.edges <= y.edges for x, y in zip(b, b[1:]))
        F = pad.fit_fractions(s, b)
        assert F[-1] == 1.0 and F == sorted(F)


def test_plan_with_graph_sizes_records_the_choice(tmp_path):
    """Each bucket priced by planning the example at its padded shape (world 2)."""
    _padded_plan(tmp_path)


def _padded_plan(tmp_path) -> Path:
    """Plan with a two-size distribution, check the record; the small bucket's plan file."""
    from autopar.artifacts import PlanOptions, load_plan
    from autopar.planner import PaddingOptions, make_padded_plan
    sizes = tmp_path / "sizes.csv"
    sizes.write_text("nodes,edges,count\n6,10,900\n51,118,100\n")
    res, d = make_padded_plan(MODEL, PlanOptions(world_size=2, batch_size=8, calibration=str(PROFILE),
                                                 out_dir=str(tmp_path / "plan"), placement="block"),
                              PaddingOptions(str(sizes), sampling="grouped", steps=100_000))
    assert d.chosen.policy == "2_buckets"
    plan = load_plan(res.plan_path)
    p = plan.padding
    assert p.policy == "2_buckets" and p.sampling == "grouped" and p.distinct_shapes == 2
    assert [(b["nodes"], b["edges"]) for b in p.buckets] == [(6, 10), (51, 118)]
    small, big = p.buckets
    assert small["graph_fraction"] == pytest.approx(0.9) and small["step_time_s"] < big["step_time_s"]
    assert big["padded_work_fraction"] == 0.0 and p.padded_work_fraction == 0.0   # both exact
    gmax = p.extra["candidates"][0]
    assert gmax["policy"] == "global_max" and 0.5 < gmax["padded_work_fraction"] < 1
    assert big["plan"] == "plan.json" and (res.plan_path.parent / small["plan"]).is_file()
    assert big["step_time_s"] == pytest.approx(plan.predicted.step_time_s)
    # the big plan is traced at the bucket's shape; the small bucket's plan at its own
    assert any(d.out_shape[1:2] == (118,) for d in plan.layers)
    small_plan = load_plan(res.plan_path.parent / small["plan"])
    assert any(d.out_shape[1:2] == (10,) for d in small_plan.layers)
    # round trip keeps the record; each plan knows the sizes its model is imported with
    assert json.loads(res.plan_path.read_text())["padding"]["env"] == {"AUTOPAR_GNN_NODES": "51",
                                                                       "AUTOPAR_GNN_EDGES": "118"}
    assert plan.model_env() == {"AUTOPAR_GNN_NODES": "51", "AUTOPAR_GNN_EDGES": "118"}
    assert small_plan.model_env() == {"AUTOPAR_GNN_NODES": "6", "AUTOPAR_GNN_EDGES": "10"}
    assert small_plan.padding.extra["this_bucket"] == {"nodes": 6, "edges": 10, "plan": "plan.json"}
    assert [b["plan"] for b in small_plan.padding.buckets] == ["../" + small["plan"], "../plan.json"]
    import os
    from autopar.runtime.entry import build_user_model
    before = os.environ.get("AUTOPAR_GNN_NODES")
    mf, _ = build_user_model(small_plan, res.plan_path.parent / small["plan"], 0)
    x, e, src, dst, mask = mf.example_inputs(3)
    assert x.shape == (3, 6, 9) and e.shape == (3, 10, 3) and os.environ.get("AUTOPAR_GNN_NODES") == before
    return res.plan_path.parent / small["plan"]


@pytest.mark.dist
def test_a_bucket_plan_executes_and_validates(tmp_path):
    """The small bucket's plan runs at world 2 (its model imported at the bucket's sizes from
    the plan) and equals one process in float64."""
    from autopar.execute.runner import ExecuteOptions, execute
    small = _padded_plan(tmp_path)
    run, _ = execute(small, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, ddp=False, timeout_s=180,
                                           validate_dtype="float64"), out_dir=tmp_path / "run")
    assert run.validation.passed and run.validation.checked > 0


# ---- run time: exact padding and its errors --------------------------------------------------

def _graphs(sizes, seed=0, f=9, fe=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, e in sizes:
        x = torch.randn(n, f, generator=g, dtype=torch.float64)
        ei = torch.randint(0, n, (2, e), generator=g)
        ea = torch.randn(e, fe, generator=g, dtype=torch.float64)
        out.append((x, ei, ea, torch.randn((), generator=g, dtype=torch.float64)))
    return out


def _model(monkeypatch):
    from autopar.modelfile import load_model_file
    monkeypatch.setenv("AUTOPAR_GNN_NODE_EMBED", "12")
    monkeypatch.setenv("AUTOPAR_GNN_OUT", "6")
    monkeypatch.setenv("AUTOPAR_GNN_LAYERS", "2")
    torch.manual_seed(0)
    m = load_model_file(MODEL).build_model().double()
    return m


def _unpadded(model, graphs):
    """NNConv by hand, one graph at a time, no padding: x'_i = root(x_i) + sum_{j->i} x_j W(e_ji)."""
    outs = []
    for x, ei, ea, _ in graphs:
        h = torch.relu(model.node_embed(x))
        ee = torch.relu(model.edge_embed(ea))
        for conv in model.convs:
            w = conv.edge_mlp(ee).view(-1, conv.f_in, conv.f_out)
            msg = torch.bmm(h[ei[0]].unsqueeze(1), w).squeeze(1)
            agg = torch.zeros(h.shape[0], conv.f_out, dtype=h.dtype).index_add(0, ei[1], msg)
            h = torch.relu(conv.root(h) + agg)
        outs.append(model.head(h.sum(0)).squeeze(-1))
    return torch.stack(outs)


def _pyg(model, graphs):
    """The same with PyTorch Geometric's NNConv on the concatenated PyG batch, same weights."""
    pyg = pytest.importorskip("torch_geometric")
    from torch_geometric.nn import NNConv, global_add_pool
    batch = pyg.data.Batch.from_data_list([pyg.data.Data(x=x, edge_index=ei, edge_attr=ea) for x, ei, ea, _ in graphs])
    h = torch.relu(model.node_embed(batch.x))
    ee = torch.relu(model.edge_embed(batch.edge_attr))
    for conv in model.convs:
        c = NNConv(conv.f_in, conv.f_out, conv.edge_mlp, aggr="add").double()
        with torch.no_grad():
            c.lin.weight.copy_(conv.root.weight)
            c.bias.copy_(conv.root.bias)
        h = torch.relu(c(h, batch.edge_index, ee))
    return model.head(global_add_pool(h, batch.batch, size=len(graphs))).squeeze(-1)


def _grads(model, out, y):
    model.zero_grad()
    loss = torch.nn.functional.l1_loss(out, y)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("shape", [(51, 118), (14, 31)])
def test_padding_is_exact_in_float64(monkeypatch, shape):
    model = _model(monkeypatch)
    graphs = _graphs([(5, 9), (14, 31), (1, 0), (9, 12), (13, 30)])
    for x, _, ea, _ in graphs:
        x.requires_grad_(True)
        ea.requires_grad_(True)
    y = torch.stack([g[3] for g in graphs])
    ref = _unpadded(model, graphs)
    ref_loss, ref_g = _grads(model, ref, y)
    ref_dx = [g[0].grad.clone() for g in graphs]
    ref_de = [g[2].grad.clone() for g in graphs]

    b = pad_graphs([(x.detach(), ei, ea.detach(), yy) for x, ei, ea, yy in graphs], *shape)
    assert b.x.dtype == torch.float64 and b.src.shape == (5, shape[1]) and b.x.shape == (5, shape[0], 9)
    assert torch.equal(b.y, y)
    x_p, e_p = b.x.clone().requires_grad_(True), b.e.clone().requires_grad_(True)
    out = model(x_p, e_p, b.src, b.dst, b.node_mask)
    loss, g = _grads(model, out, b.y)
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert g.keys() == ref_g.keys()
    for k in g:
        torch.testing.assert_close(g[k], ref_g[k], **tol, msg=f"gradient of {k}")
    for i, (n, m) in enumerate([(5, 9), (14, 31), (1, 0), (9, 12), (13, 30)]):
        torch.testing.assert_close(x_p.grad[i, :n], ref_dx[i], **tol)
        torch.testing.assert_close(e_p.grad[i, :m], ref_de[i], **tol)
        # the padding's own gradients: padded edge features are read only by the edge MLP of
        # edges that scatter into the dropped node, so nothing flows back into the real graph
        assert torch.all(x_p.grad[i, n:] == 0) or n == shape[0]


def test_padded_model_equals_pyg_nnconv_in_float64(monkeypatch):
    model = _model(monkeypatch)
    graphs = _graphs([(7, 12), (3, 4), (11, 20)], seed=3)
    ref = _pyg(model, graphs)
    b = pad_graphs(graphs, 51, 118)
    torch.testing.assert_close(model(*b.inputs()), ref, rtol=1e-12, atol=1e-12)


def test_graph_larger_than_the_padded_size_stops_with_its_index():
    graphs = _graphs([(5, 9), (20, 40), (3, 2)])
    with pytest.raises(GraphTooLarge) as ei:
        pad_graphs(graphs, 16, 118, indices=[100, 101, 102])
    assert "graph 101 has 20 nodes and 40 edges" in str(ei.value) and "16 nodes / 118 edges" in str(ei.value)
    with pytest.raises(GraphTooLarge, match="graph 1 has 20 nodes"):
        check_graphs(graphs, [PaddedShape(8, 20), PaddedShape(16, 50)])
    with pytest.raises(GraphTooLarge, match="graph 1 has 20 nodes and 40 edges"):
        PaddedCollate([PaddedShape(16, 50)])(graphs)


def test_edge_index_out_of_range_is_caught_before_training():
    graphs = _graphs([(5, 9), (6, 8)])
    x, ei, ea, y = graphs[1]
    ei = ei.clone()
    ei[1, 3] = 6                      # node 6 of a 6-node graph
    graphs[1] = (x, ei, ea, y)
    with pytest.raises(EdgeIndexOutOfRange) as e:
        check_graphs(graphs)
    assert "graph 1: edge 3 has destination 6, outside its 6 nodes" in str(e.value)
    ei[1, 3], ei[0, 0] = 0, -1
    with pytest.raises(EdgeIndexOutOfRange, match="edge 0 has source -1"):
        pad_graphs(graphs, 51, 118)


def test_malformed_graphs():
    x, ei, ea, y = _graphs([(4, 5)])[0]
    with pytest.raises(MalformedGraph, match="edge_attr has shape"):
        pad_graphs([(x, ei, ea[:3], y)], 51, 118)
    with pytest.raises(MalformedGraph, match="edge_index"):
        pad_graphs([(x, ei.double(), ea, y)], 51, 118)
    with pytest.raises(MalformedGraph, match="lacks"):
        pad_graphs([{"x": x, "edge_index": ei}], 51, 118)


def test_collate_picks_the_smallest_bucket_holding_the_batch():
    col = PaddedCollate.from_plan_padding({"buckets": [{"nodes": 51, "edges": 118}, {"nodes": 12, "edges": 24}]})
    assert col.shapes[0] == PaddedShape(12, 24)
    assert col(_graphs([(5, 9), (12, 20)])).shape == PaddedShape(12, 24)
    assert col(_graphs([(5, 9), (12, 30)])).shape == PaddedShape(51, 118)
    dense = col(_graphs([(5, 9)]))
    assert torch.all(dense.src[0, 9:] == 12) and torch.all(dense.node_mask[0, 5:] == 0)
    assert math.isclose(float(dense.node_mask.sum()), 5.0)
