"""Rank placement: the arithmetic, link levels under a placement, the planner's search (a golden
case where the heaviest traffic decides the placement, one node skipping it, the shared pricing
memo against fresh pricing), plan files, and a plan executed on gloo with ranks relabeled."""

import json
import textwrap
from dataclasses import replace

import pytest
from fakes import synthetic_profile

from autopar.cost.table import build_cost_table
from autopar.decomp.base import CostContext
from autopar.decomp.rankmap import RankMap, candidate_strides
from autopar.errors import PlacementError, PlanFileError
from autopar.artifacts import PlanHooks, PlanOptions
from autopar.planner import make_plan as _make_plan


# The scenarios below were written for the CNN methods' plan space; with Megatron's
# row-parallel linear also available the wide MLP's best plan is pure model parallelism (no
# gradient all-reduce to place at all), so the placement search is tested on the space it was
# written for.
CNN_KINDS = ("replicate", "sample", "spatial", "channel", "filter", "channel_filter")


def make_plan(model, world, profile, out_dir=None, write=True, placement="search"):
    return _make_plan(model, PlanOptions(world_size=world, out_dir=out_dir, write=write, placement=placement,
                                         kinds=CNN_KINDS),
                      PlanHooks(profile=profile))

# ---- arithmetic ----------------------------------------------------------------------------


@pytest.mark.parametrize("world,stride", [(1, 1), (4, 1), (4, 2), (4, 4), (16, 2), (16, 4), (24, 3),
                                          (24, 6), (1024, 8), (1024, 128)])
def test_placement_is_a_bijection_with_its_inverse(world, stride):
    p = RankMap(world, stride)
    phys = [p.physical(l) for l in range(world)]
    assert sorted(phys) == list(range(world))
    assert all(p.logical(p.physical(l)) == l for l in range(world))
    assert all(p.physical(p.logical(q)) == q for q in range(world))
    assert p.physical(0) == 0 and p.logical(0) == 0      # logical rank 0 stays in slot 0


def test_identity_and_the_formula():
    assert all(RankMap(8, 1).physical(l) == l for l in range(8))
    assert all(RankMap(8, 8).physical(l) == l for l in range(8))  # stride W is the identity too
    assert RankMap(8, 1).is_identity and RankMap(8, 8).is_identity
    p = RankMap(8, 2)                # l = a*2 + b  ->  b*4 + a
    assert [p.physical(l) for l in range(8)] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert not p.is_identity and str(p) == "stride(2)" and str(RankMap(8, 1)) == "block"


@pytest.mark.parametrize("world,rpn,stride", [(16, 4, 2), (16, 4, 4), (64, 8, 8), (32, 4, 2)])
def test_the_axis_of_stride_s_is_node_local(world, rpn, stride):
    """Under stride s the ranks {b + s*a} with rpn consecutive a share a node."""
    p = RankMap(world, stride)
    for b in range(stride):
        for a0 in range(0, world // stride, rpn):
            group = [b + stride * a for a in range(a0, a0 + rpn)]
            assert len({p.node_of(l, rpn) for l in group}) == 1, group
    # and under block placement the same groups cross nodes
    blk = RankMap.identity(world)
    assert len({blk.node_of(l, rpn) for l in range(0, stride * rpn, stride)}) > 1


def test_json_round_trip_and_named_errors():
    p = RankMap(16, 4)
    assert p.to_json() == {"kind": "stride", "local_stride": 4}
    assert RankMap.from_json(p.to_json(), 16) == p
    assert RankMap.from_json(None, 16) == RankMap.identity(16)   # plans before placements
    with pytest.raises(PlacementError, match="does not divide world size 12"):
        RankMap(12, 5)
    with pytest.raises(PlacementError, match="unknown placement"):
        RankMap.from_json({"kind": "hilbert"}, 16)


def test_candidate_strides():
    assert candidate_strides(1024, 8) == [2, 4, 8, 16, 32, 64, 128]
    assert candidate_strides(64, 8) == [2, 4, 8]
    assert candidate_strides(4, 2) == [2]
    assert candidate_strides(8, 8) == [] and candidate_strides(4, 8) == []   # one node
    assert candidate_strides(96, 8) == [2, 4, 8]                          # ladder, s <= 12
    assert all(96 % s == 0 for s in candidate_strides(96, 4))


# ---- link levels -----------------------------------------------------------------------------


def test_cost_context_level_under_a_placement():
    ident = CostContext(profile=None, world=8, ranks_per_node=4)
    strided = CostContext(profile=None, world=8, ranks_per_node=4, placement=RankMap(8, 2))
    assert ident.level([0, 1, 2, 3]) == "intra" and strided.level([0, 1, 2, 3]) == "inter"
    assert ident.level([0, 2, 4, 6]) == "inter" and strided.level([0, 2, 4, 6]) == "intra"
    assert strided.level((1, 3, 5, 7)) == "intra" and strided.level(range(1, 8, 2)) == "intra"
    assert strided.level(range(8)) == "inter" and strided.level([5]) == "intra"
    assert strided.level([]) == "intra" and strided.level(iter([0, 1])) == "inter"
    with pytest.raises(ValueError):
        CostContext(profile=None, world=8, ranks_per_node=4, placement=RankMap(4, 2))


# ---- the search -----------------------------------------------------------------------------

MLP = """
import torch
from torch import nn
DEFAULT_BATCH_SIZE = 16
def build_model():
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 64))
def example_inputs(b):
    return (torch.randn(b, 256),)
"""


@pytest.fixture
def mlp(tmp_path):
    f = tmp_path / "wide_mlp.py"
    f.write_text(textwrap.dedent(MLP))
    return f


@pytest.fixture
def two_nodes():
    """2 nodes x 2 ranks, links between nodes 50x slower than within one."""
    return synthetic_profile(ranks_per_node=2, nodes=2, inter_factor=50.0)


def test_search_keeps_the_heavy_gradient_allreduce_within_a_node(mlp, two_nodes):
    """Wide layers, small batch, world 4 on 2 nodes: weight-split layers with a sample axis
    (Channel(2, 2): its 2 ranks per shard all-reduce W/2 of gradients, its channel group
    reduce-scatters a small activation). Block placement puts the channel group (ranks 0, 1) in
    a node and the gradient group (ranks 0, 2) across nodes; local stride 2 does the opposite,
    which is what the heavy traffic wants."""
    r = make_plan(mlp, 4, profile=two_nodes, write=False)
    plan = r.plan
    assert plan.mesh.placement_json == {"kind": "stride", "local_stride": 2}
    tried = {t.name: t for t in plan.placement_search.tried}
    assert set(tried) == {"block", "stride(2)"} and all(t.solved for t in tried.values())
    assert tried["stride(2)"].step_time_s < 0.9 * tried["block"].step_time_s
    assert plan.predicted.step_time_s == tried["stride(2)"].step_time_s
    choices = [l.choice for l in plan.layers]
    assert any(c.startswith(("channel(2,", "filter(2,", "channel_filter(2,")) for c in choices), choices
    # the same plan under block placement is slower: its gradient groups cross nodes
    blk = make_plan(mlp, 4, profile=two_nodes, write=False, placement="block").plan
    assert blk.mesh.local_stride == 1
    assert blk.predicted.step_time_s == tried["block"].step_time_s
    # a forced stride gives the searched plan
    forced = make_plan(mlp, 4, profile=two_nodes, write=False, placement=2).plan
    assert forced.predicted.step_time_s == plan.predicted.step_time_s


def test_search_is_skipped_on_one_node(mlp):
    r = make_plan(mlp, 4, profile=synthetic_profile(ranks_per_node=4, nodes=1, inter_factor=50.0),
                  write=False)
    ps = r.plan.placement_search
    assert r.plan.mesh.local_stride == 1
    assert len(ps.tried) == 1 and "one node" in ps.tried[0].note


def test_bad_placement_option_is_a_named_error(mlp, two_nodes):
    with pytest.raises(PlacementError, match="does not divide world size 4"):
        make_plan(mlp, 4, profile=two_nodes, write=False, placement=3)
    with pytest.raises(PlacementError, match="unknown placement"):
        make_plan(mlp, 4, profile=two_nodes, write=False, placement="hilbert")


def test_cli_placement_option(mlp, two_nodes, tmp_path, capsys):
    from autopar.profile import save_profile
    from autopar.cli import main
    prof = tmp_path / "prof.json"
    save_profile(two_nodes, prof)
    base = ["plan", str(mlp), "--world-size", "4", "--calibration", str(prof), "--kinds", ",".join(CNN_KINDS)]
    assert main(base + ["-o", str(tmp_path / "bad"), "--placement", "3"]) == 2
    err = capsys.readouterr().err
    assert "PlacementError" in err and "does not divide world size 4" in err and "Traceback" not in err
    assert main(base + ["-o", str(tmp_path / "blk"), "--placement", "block"]) == 0
    assert "placement: block (given)" in capsys.readouterr().out
    assert main(base + ["-o", str(tmp_path / "s")]) == 0
    assert "placement: stride(2)" in capsys.readouterr().out
    plan = json.loads((tmp_path / "s" / "plan.json").read_text())
    assert plan["mesh"]["placement"] == {"kind": "stride", "local_stride": 2}


def test_shared_pricing_memo_gives_the_tables_fresh_pricing_gives(root):
    """price_once reuses a price only when every group it asked about keeps its link level:
    each placement's table must equal one priced from scratch."""
    from autopar.modelfile import load_model_file
    from autopar.trace.tracer import trace_model
    graph = trace_model(load_model_file(root / "strategies/examples/resnet2d.py"), 8)
    prof = synthetic_profile(ranks_per_node=2, nodes=4, inter_factor=20.0)
    base = CostContext(profile=prof, world=8, ranks_per_node=2, batch_size=8, cost_memo={})
    for s in [1] + candidate_strides(8, 2):
        shared = build_cost_table(graph, replace(base, placement=RankMap(8, s)))
        fresh = build_cost_table(graph, replace(base, placement=RankMap(8, s), cost_memo=None))
        for a, b in zip(shared.layers, fresh.layers):
            assert [str(d) for d in a.choices] == [str(d) for d in b.choices], s
            assert a.costs == b.costs and a.illegal == b.illegal and a.exact_keys == b.exact_keys
        assert [(e.fwd_s, e.bwd_s) for e in shared.edges] == [(e.fwd_s, e.bwd_s) for e in fresh.edges]


# ---- plan files and the runtime -------------------------------------------------------------


def test_plan_without_placement_means_block_and_bad_ones_are_named(mlp, two_nodes, tmp_path):
    from autopar.artifacts import load_plan
    from autopar.runtime.entry import plan_placement
    r = make_plan(mlp, 4, profile=two_nodes, out_dir=tmp_path / "p")
    plan = load_plan(r.plan_path)
    assert plan_placement(plan) == RankMap(4, 2)
    assert "placement stride(2)" in r.module_path.read_text()
    d = plan.to_json()
    del d["mesh"]["placement"]
    nop = tmp_path / "noplacement.json"
    nop.write_text(json.dumps(d))
    assert plan_placement(load_plan(nop)) == RankMap.identity(4)
    d["mesh"]["placement"] = {"kind": "stride", "local_stride": 3}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanFileError, match="mesh.placement: local stride 3 does not divide"):
        load_plan(bad)


def _rank_and_world(rank, world):
    return rank, world


def _fail_on_one(rank, world):
    if rank == 1:
        raise RuntimeError("boom")
    return rank


@pytest.mark.dist
def test_run_ranks_returns_results_in_logical_order_and_names_slots():
    from autopar.errors import RankFailure
    from autopar.runtime.launch import run_ranks
    assert run_ranks(_rank_and_world, 4, timeout_s=60, placement=RankMap(4, 2)) == \
        [(r, 4) for r in range(4)]
    with pytest.raises(RankFailure, match=r"rank 1 \(slot 2, placement stride\(2\)\) failed"):
        run_ranks(_fail_on_one, 4, timeout_s=60, placement=RankMap(4, 2))


@pytest.mark.dist
def test_plan_with_a_strided_placement_validates_on_gloo(mlp, two_nodes, tmp_path):
    """World 4 = 2 nodes x 2 ranks, local stride 2 forced: every process joins as
    placement.logical(slot), and the plan still computes the single-process function."""
    from autopar.execute.runner import ExecuteOptions, execute
    r = make_plan(mlp, 4, profile=two_nodes, out_dir=tmp_path / "plan", placement=2)
    assert r.plan.mesh.placement_json == {"kind": "stride", "local_stride": 2}
    assert any(l.choice != "replicate" and not l.choice.startswith("sample") for l in r.plan.layers)
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1,
                                                 timeout_s=180, ddp=False),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures
    assert run.placement == {"kind": "stride", "local_stride": 2}


RELABEL = """
import json, os
import torch.distributed as dist
from autopar.decomp.rankmap import RankMap
from autopar.runtime.launch import init_from_env
rank, world = init_from_env(backend="gloo", placement=RankMap(4, 2))
got = [None] * world
dist.all_gather_object(got, (int(os.environ["RANK"]), rank))
if rank == 0:
    print("RESULT " + json.dumps(got), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_torchrun_processes_join_as_their_logical_rank(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / "relabel.py"
    script.write_text(textwrap.dedent(RELABEL))
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "4", str(script)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    assert out.returncode == 0 and line, out.stderr[-2000:]
    pairs = json.loads(line[0][len("RESULT "):])
    # logical rank r is run by torchrun's RANK physical(r): 0->0, 1->2, 2->1, 3->3
    assert [tuple(p) for p in pairs] == [(RankMap(4, 2).physical(r), r) for r in range(4)]


def test_report_shows_each_artifacts_placement(mlp, two_nodes, tmp_path):
    from autopar.report.report import summarize
    r = make_plan(mlp, 4, profile=two_nodes, out_dir=tmp_path / "p", placement=2)
    old = r.plan.to_json()
    old["schema"] = "autopar.plan/1"       # a plan written before placements existed
    del old["mesh"]["placement"], old["mesh"]["ranks"]
    (tmp_path / "b.json").write_text(json.dumps(old))
    with pytest.warns(UserWarning, match="migrated"):
        rows = summarize([r.plan_path, tmp_path / "b.json"]).splitlines()
    assert "| placement |" in rows[0]
    assert "| stride(2) | plan |" in rows[2] and "| block | plan |" in rows[3]
