"""SUPER sub-graph (branch) parallelism (``autopar.decomp.branch``): the branches found in a
traced unit, the grid-translation boundary ops' adjoints, plans that run the branches of a
parallel GPT block and of a multi-tower model on disjoint rank groups with data parallelism,
equal to one process in float64 (output, loss, every gradient and every parameter after a
step: ``execute``'s validation, rtol 1e-9 / atol 1e-12), and the interleaved placement chosen on
a simulated cluster whose inter-node links are slow."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.decomp.branch import PARTIAL, SHARED, SPLIT, Branch, BranchParamShard, analysis
from autopar.decomp.sharding import Sharding, Shard

ROOT = Path(__file__).resolve().parents[1]
PGPT = ROOT / "strategies" / "examples" / "parallel_gpt.py"
TOWERS = ROOT / "strategies" / "examples" / "towers.py"


def _units(model, batch=4):
    from autopar.modelfile import load_model_file
    from autopar.trace.cache import trace_cached
    from autopar.trace.units import merge_units
    mf = load_model_file(model)
    g, _ = trace_cached(mf, batch, use_cache=False)
    g = merge_units(g, mf.planning_units())
    return g, [lay for lay in g.layers if analysis(lay).count >= 2]


# ---- pure: branches, roles, layouts, legality ------------------------------------------------

def test_parallel_block_has_attention_and_mlp_branches():
    g, units = _units(PGPT)
    assert [u.module for u in units] == ["blocks.0", "blocks.1"]
    a = analysis(units[0])
    mods = [{next(op.module for op in units[0].ops if op.name == h) for h in hs} for hs in a.branches]
    assert mods == [{"blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v", "blocks.0.attn",
                     "blocks.0.attn.proj"},
                    {"blocks.0.mlp.fc", "blocks.0.mlp.out"}]
    ln = next(op.name for op in units[0].ops if op.kind == "layer_norm")
    assert a.role[ln] == "shared"                       # the norm before the fork
    last = units[0].output
    assert a.role[last] == "join" and a.join_mode[last] == "local" and a.state[last] == PARTIAL
    # the unit leaves as a partial sum over the branch axis: the transition after it all-reduces
    assert Branch(2, 2).out_placement(units[0]).partial_parts == 2
    assert Branch(2, 2).in_placement(units[0], units[0].inputs[0]).partial_parts == 1


@pytest.mark.parametrize("join", ["sum", "cat"])
def test_towers_branches_and_join(join, monkeypatch):
    monkeypatch.setenv("AUTOPAR_TOWERS_JOIN", join)
    g, units = _units(TOWERS)
    (u,) = units
    a = analysis(u)
    assert a.count == 4
    relu = u.output
    if join == "sum":                                    # relu after the sum: not linear
        assert a.role[relu] == "join" and a.join_mode[relu] == "reduce" and a.state[relu] == SHARED
    else:                                                # cat of every tower, then relu: stays
        cat = next(op.name for op in u.ops if op.kind == "cat")     # split along the features
        assert a.join_mode[cat] == "gather" and a.join_mode[relu] == "split"
        assert a.state[relu] == SPLIT and a.split_dim[relu] == 1
        assert Branch(2, 2).out_placement(u) == Sharding.of((Shard(0), 2), (Shard(1), 2))
    from fakes import synthetic_profile
    from autopar.decomp.base import CostContext
    ctx = CostContext(profile=synthetic_profile(), world=4, ranks_per_node=4)
    assert [str(d) for d in Branch.candidates(u, ctx)] == ["branch(2,2,1)", "branch(1,4,1)"]
    assert Branch(2, 2).check(u, ctx) is None
    assert "do not divide" in Branch(1, 3, 1).check(u, CostContext(profile=synthetic_profile(), world=3,
                                                                   ranks_per_node=4))
    # the batch limits the data degree: the rest are replicas
    ctx8 = CostContext(profile=synthetic_profile(), world=16, ranks_per_node=4)
    assert "branch(4,2,2)" in [str(d) for d in Branch.candidates(u, ctx8)]
    # weights of tower 3 live on branch group 1 of 2 only (empty blocks elsewhere)
    op = next(op for op in u.ops if op.module == "towers.towers.3.fc1")
    sh = Branch(2, 2).layer_param_shard(u, op, "weight")
    assert isinstance(sh, BranchParamShard)
    assert [sh.local_shape((32, 16), r, 4) for r in range(4)] == [(0, 16), (32, 16), (0, 16), (32, 16)]
    assert sh.grad_group(1, 4) == [1, 3] and sh.grad_group(0, 4) == [0]
    # cost: compute of the slowest group, the reduce join's all-reduce, both branch groups' weights
    c = Branch(2, 2).cost(u, ctx)
    assert (c.fwd_comm_s > 0) == (join == "sum") and c.param_bytes < u.param_numel * u.itemsize


def test_chain_unit_has_no_branches():
    g, _ = _units(ROOT / "strategies" / "examples" / "gpt.py")
    from fakes import synthetic_profile
    from autopar.decomp.base import CostContext
    ctx = CostContext(profile=synthetic_profile(), world=2, ranks_per_node=4)
    assert all(Branch.candidates(lay, ctx) == [] for lay in g.layers)
    assert "no parallel branches" in Branch(1, 2).check(g.layers[-1], ctx)


# ---- boundary ops: exact adjoints (dot-product test over the ranks) --------------------------

def _adjoint_cases(rank, world):
    from autopar.runtime.layers.boundary import branch_slice, branch_split, branch_sum
    from autopar.runtime.comm import Comm
    comm = Comm.from_env()
    groups = [list(range(world))] + ([[0, 1], [2, 3]] if world == 4 else [])
    comm.ensure_partitions([groups[1:]] if len(groups) > 1 else [])
    out = []
    for k, (name, fn) in enumerate([("split", lambda x, g: branch_split(x, comm, g)),
                                    ("sum", lambda x, g: branch_sum(x, comm, g)),
                                    ("slice", lambda x, g: branch_slice(x, comm, g, dim=1))]):
        for j, g in enumerate(groups):
            if rank not in g:
                continue
            gen = torch.Generator().manual_seed(1000 * k + 10 * j + rank)
            x = torch.randn(3, 4, dtype=torch.float64, generator=gen).requires_grad_()
            y = fn(x, g)
            dy = torch.randn(y.shape, dtype=torch.float64, generator=gen)
            (y * dy).sum().backward()
            out.append((name, j, float((y.detach() * dy).sum()), float((x.grad * x.detach()).sum()),
                        y.detach().numpy(), x.detach().numpy()))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_boundary_ops_are_exact_adjoints(world):
    from autopar.runtime.launch import run_ranks
    res = run_ranks(_adjoint_cases, world, timeout_s=120)
    keys = {(n, j) for r in range(world) for n, j, *_ in res[r]}
    assert {n for n, _ in keys} == {"split", "sum", "slice"}
    for key in keys:
        rows = {r: e for r in range(world) for e in res[r] if (e[0], e[1]) == key}
        lhs = sum(e[2] for e in rows.values())          # <A x, dy> summed over the ranks
        rhs = sum(e[3] for e in rows.values())          # <x, A^T dy>
        assert abs(lhs - rhs) <= 1e-9 * max(1.0, abs(lhs)), (key, lhs, rhs)
        ranks = sorted(rows)
        xs = [torch.from_numpy(rows[r][5]) for r in ranks]
        ys = [torch.from_numpy(rows[r][4]) for r in ranks]
        if key[0] == "split":
            assert all(torch.equal(y, xs[0]) for y in ys)
        elif key[0] == "sum":
            assert all(torch.allclose(y, sum(xs)) for y in ys)
        else:
            assert torch.equal(torch.cat(ys, 1), xs[0])


# ---- plans that run: equal to one process -----------------------------------------------------

CASES = [
    (PGPT, {}, 2, "branch(1,2,1)"),
    (PGPT, {}, 4, "branch(2,2,1)"),
    (TOWERS, {"AUTOPAR_TOWERS_JOIN": "sum"}, 4, "branch(1,4,1)"),
    (TOWERS, {"AUTOPAR_TOWERS_JOIN": "cat"}, 4, "branch(2,2,1)"),   # stays split, all-gathered
    (TOWERS, {"AUTOPAR_TOWERS_JOIN": "cat"}, 2, "branch(1,2,1)"),
    (TOWERS, {"AUTOPAR_TOWERS_JOIN": "sum"}, 4, "branch(1,2,2)"),   # batch 1: replicas
    (PGPT, {}, 2, "head_groups(1,2,1,1)"),                          # all sub-graph
    (PGPT, {}, 4, "head_groups(2,2,1,1)"),
    (PGPT, {}, 4, "head_groups(1,4,1,0)"),                          # heads only, MLP whole
    (PGPT, {}, 4, "head_groups(1,2,2,1)"),                          # batch 1: replicas
]


@pytest.mark.dist
@pytest.mark.parametrize("model,env,world,want", CASES,
                         ids=[f"{m.stem}-{e.get('AUTOPAR_TOWERS_JOIN', '')}-w{w}-{d}" for m, e, w, d in CASES])
def test_branch_plan_equals_one_process(model, env, world, want, tmp_path, monkeypatch, profile):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    batch = 1 if want in ("branch(1,2,2)", "head_groups(1,2,2,1)") else 4   # replicas
    _, units = _units(model, batch)
    force = {u.index: want for u in units}
    r = make_plan(model, PlanOptions(world_size=world, batch_size=batch, trace_cache=False,
                                     out_dir=str(tmp_path / "plan")),
                  PlanHooks(profile=profile, force=force))
    assert [str(r.plan.layer(li).decomposition()) for li in force] == [want] * len(force)
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1,
                                                 timeout_s=180, ddp=False),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures


# ---- topology-aware placement -----------------------------------------------------------------

def test_interleaved_placement_is_priced_and_chosen_when_inter_node_is_slow(monkeypatch):
    """Branch units at world 16 on 2 simulated nodes of 8: block placement keeps each sample
    block's branch groups on one node (SUPER's interleaved placement), stride 2 puts each
    branch's ranks together (branch-contiguous). With slow inter-node links the search prices
    both and keeps the interleaved one; the branch units' join (a partial output resolved after
    the unit) is then intra-node."""
    from fakes import synthetic_profile
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.decomp.base import CostContext
    from autopar.decomp.rankmap import branch_contiguous
    from autopar.planner import make_plan
    monkeypatch.setenv("AUTOPAR_PGPT_SEQ", "256")       # activations large enough to matter
    prof = synthetic_profile(ranks_per_node=8, nodes=2, inter_factor=50.0)
    _, units = _units(PGPT, 16)
    force = {u.index: "branch(8,2,1)" for u in units}
    r = make_plan(PGPT, PlanOptions(world_size=16, batch_size=16, ranks_per_node=8, nodes=2,
                                    write=False, placement="search", trace_cache=False),
                  PlanHooks(profile=prof, force=force))
    assert str(r.table.ctx.placement) == "block"
    tried = r.plan.placement_search.tried
    assert {t.name for t in tried} >= {"block", "stride(2)"}
    # priced: the branch-contiguous placement puts the join's all-reduce group across nodes
    dec = Branch(8, 2, 1)
    inter = CostContext(profile=prof, world=16, ranks_per_node=8, placement=branch_contiguous(16, 2))
    intra = CostContext(profile=prof, world=16, ranks_per_node=8)
    assert inter.level(dec.branch_group(0)) == "inter" and intra.level(dec.branch_group(0)) == "intra"
    assert intra.level(dec.owner_group(0, 16)) == "inter"
    t = {x.name: x for x in tried}
    if t["stride(2)"].solved:
        assert t["stride(2)"].step_time_s > t["block"].step_time_s


# ---- memory: a limit that data parallelism does not fit -----------------------------------------

def _plan_mem(tmp_path, limit, kinds=None, write=False):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from fakes import synthetic_profile
    r = make_plan(PGPT, PlanOptions(world_size=4, batch_size=4, write=write, trace_cache=False,
                                    memory_limit_bytes=limit, kinds=kinds,
                                    out_dir=str(tmp_path / "plan") if write else None),
                  PlanHooks(profile=synthetic_profile()))
    mem = sum(r.table.layers[li].costs[i].memory_bytes for li, i in enumerate(r.solution.choice))
    return r, mem


@pytest.mark.dist
def test_memory_limit_forces_a_branch_plan_that_runs(tmp_path, monkeypatch):
    """Wide blocks (embed 128, 8 tokens): weights, their gradients and momentum dominate. Data
    parallelism needs every block's weights on every rank; under 60 % of its memory the planner
    must split the blocks' weights over branch groups, and that plan runs equal to one process."""
    from autopar.execute.runner import ExecuteOptions, execute
    monkeypatch.setenv("AUTOPAR_PGPT_EMBED", "128")
    monkeypatch.setenv("AUTOPAR_PGPT_SEQ", "8")
    _, dp_mem = _plan_mem(tmp_path, None, kinds=("sample", "replicate"))
    r, mem = _plan_mem(tmp_path, 0.6 * dp_mem, write=True)
    assert mem <= 0.6 * dp_mem
    blocks = [d.decomposition() for d in r.plan.layers if d.decomposition().kind in ("branch", "head_groups")]
    assert len(blocks) == 2, [str(d.decomposition()) for d in r.plan.layers]
    unit = next(lay for lay in r.plan.graph().layers if lay.module == "blocks.0")
    c = r.table.layers[unit.index]
    dp = min(cc.memory_bytes for d, cc in zip(c.choices, c.costs) if d.kind == "sample") if any(
        d.kind == "sample" for d in c.choices) else None
    mine = c.costs[r.solution.choice[unit.index]]
    assert dp is None or mine.param_bytes < dp           # the chosen split holds less weight
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1,
                                                 timeout_s=180, ddp=False),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures


def test_infeasible_memory_limit_names_the_unit(tmp_path):
    from autopar.errors import AutoparError
    with pytest.raises(AutoparError, match=r"blocks\.[01] \("):
        _plan_mem(tmp_path, 1024.0)


def test_head_groups_plan_and_bad_splits_named():
    from fakes import synthetic_profile
    from autopar.decomp.base import CostContext
    from autopar.decomp.branch import HeadGroups, head_plan
    g, units = _units(PGPT)
    u = units[0]
    hp = head_plan(u, 2, ffn=True)
    assert hp.problem is None
    by_mod = {op.module: hp.mode[op.name] for op in u.ops if op.params}
    assert by_mod == {"blocks.0.ln": "whole", "blocks.0.attn.q": "col", "blocks.0.attn.k": "col",
                      "blocks.0.attn.v": "col", "blocks.0.attn.proj": "row", "blocks.0.mlp.fc": "col",
                      "blocks.0.mlp.out": "row"}
    sdpa = next(op.name for op in u.ops if op.kind == "attention")
    assert hp.state[sdpa] == 1                            # heads dim split in G groups
    assert hp.state[u.output] == "P"
    heads_only = head_plan(u, 2, ffn=False)
    assert heads_only.mode[next(op.name for op in u.ops if op.module == "blocks.0.mlp.fc")] == "whole"
    # 4 heads in 8 groups: refused at plan time, naming the op and the reason
    ctx8 = CostContext(profile=synthetic_profile(), world=8, ranks_per_node=8)
    why = HeadGroups(1, 8, 1, 1).check(u, ctx8)
    assert why and "head" in why and "8" in why, why
    assert all(d.groups in (2, 4) for d in HeadGroups.candidates(u, ctx8))
    # weights: q's rows split over the group axis, gradients summed over its data ranks
    q = next(op for op in u.ops if op.module == "blocks.0.attn.q")
    sh = HeadGroups(2, 2, 1, 1).layer_param_shard(u, q, "weight")
    assert [sh.local_bounds((32, 32), r, 4)[0] for r in range(4)] == [(0, 16), (16, 16), (0, 16), (16, 16)]
    assert sh.grad_group(0, 4) == [0, 2]


def test_join_with_a_literal_is_summed_first():
    """``a + b + 1``: a partial sum plus a literal would count the literal once per group."""
    from autopar.decomp.branch.graph import analyse
    from autopar.decomp.ir import Layer, OpSpec

    def op(name, target, kind, args, inputs, params=None):
        return OpSpec(name=name, kind=kind, target=target, args=args, kwargs={}, out_shape=[4, 8],
                      dtype="float32", inputs=inputs, in_shapes=[[4, 8]] * len(inputs),
                      params=params or {}, param_names={})
    w = {"weight": [8, 8]}
    ops = [op("a", "aten.linear.default", "linear", [{"v": "x"}, {"p": "wa"}], ["x"], w),
           op("b", "aten.linear.default", "linear", [{"v": "x"}, {"p": "wb"}], ["x"], w),
           op("s", "aten.add.Tensor", "binary", [{"v": "a"}, {"v": "b"}], ["a", "b"]),
           op("t", "aten.add.Tensor", "binary", [{"v": "s"}, 1.0], ["s"])]
    an = analyse(Layer(index=0, name="a", ops=ops, inputs=["x"], output="t"))
    assert an.count == 2 and an.join_mode == {"s": "local", "t": "reduce"}


def test_placement_names_say_interleaved_or_branch_contiguous():
    from autopar.decomp.branch import HeadGroups
    from autopar.decomp.rankmap import RankMap, branch_contiguous, branch_role
    from autopar.decomp.sample import Sample
    plan = [Sample(16), Branch(4, 2, 2), HeadGroups(8, 2, 1, 1)]
    assert branch_role(RankMap.identity(16), plan) == "interleaved"
    assert branch_role(branch_contiguous(16, 2, 2), [Branch(4, 2, 2)]) == "branch-contiguous"
    assert branch_role(RankMap(16, 8), plan) == ""
    assert branch_role(RankMap.identity(16), [Sample(16)]) == ""


def test_attention_memory_counts_scores_only_when_not_fused():
    """SDPA saves q, k, v (the KV) and its output; with an explicit mask (the math path) also
    the B x H x L x S attention weights."""
    from autopar.decomp.ir import OpSpec
    from autopar.ops import family_of
    q = [2, 4, 16, 8]

    def sdpa(args, inputs, shapes):
        return OpSpec(name="y", kind="attention", target="aten.scaled_dot_product_attention.default",
                      args=args, kwargs={}, out_shape=q, dtype="float32", inputs=inputs,
                      in_shapes=shapes, params={}, param_names={})
    fam = family_of("attention")
    fused = sdpa([{"v": "q"}, {"v": "k"}, {"v": "v"}, None, 0.0, True], ["q", "k", "v"], [q] * 3)
    masked = sdpa([{"v": "q"}, {"v": "k"}, {"v": "v"}, {"v": "m"}], ["q", "k", "v", "m"], [q] * 3 + [[16, 16]])
    qkvy = 4 * 2 * 4 * 16 * 8
    assert fam.saved_bytes(fused, fused.in_shapes, q, 4) == qkvy * 4
    assert fam.saved_bytes(masked, masked.in_shapes, q, 4) == (qkvy + 16 * 16 + 2 * 4 * 16 * 16) * 4


@pytest.mark.dist
def test_branch_unit_with_a_side_output_equals_one_process(tmp_path, profile):
    """A CNN block of two parallel convolutions whose sum (through a ReLU) and one branch's own
    output both leave the unit (``tests/test_units.py``'s model): the side output leaves as a
    partial sum (zeros on the other group) and is resolved by its own transition."""
    from test_units import _write
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan
    model = _write(tmp_path, ["block"])
    _, units = _units(model)
    (u,) = units
    a = analysis(u)
    assert a.count == 2 and len(u.outputs) == 2
    assert {a.state[v] for v in u.outputs} == {PARTIAL, SHARED}
    r = make_plan(model, PlanOptions(world_size=2, batch_size=4, trace_cache=False,
                                     out_dir=str(tmp_path / "plan")),
                  PlanHooks(profile=profile, force={u.index: "branch(1,2,1)"}))
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1,
                                                 timeout_s=180, ddp=False),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures
