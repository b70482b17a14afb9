"""The placement search settled without pricing (``solve.placement.levels_price_alike``): when
the profile prices collectives alike within and across nodes, no placement prices any plan
below block, and the search keeps block's plan without building the other tables. Checked
against the full search and against every placement solved on its own."""

import copy
from dataclasses import replace

import pytest
from fakes import synthetic_profile

from autopar.cost.table import build_cost_table, evaluate, pricing_profile
from autopar.decomp.base import CostContext
from autopar.decomp.rankmap import RankMap, candidate_strides
from autopar.solve.ilp import solve
from autopar.solve.placement import ALIKE_NOTE, levels_price_alike, search_placement

CNN_KINDS = ["replicate", "sample", "spatial", "channel", "filter", "channel_filter"]


def test_levels_price_alike_reads_every_constant():
    alike = synthetic_profile(ranks_per_node=2, nodes=4, inter_factor=1.0)
    assert levels_price_alike(alike)
    assert levels_price_alike(pricing_profile(alike))            # behind the pricing memo
    assert not levels_price_alike(synthetic_profile(ranks_per_node=2, nodes=4, inter_factor=10.0))
    one = copy.deepcopy(alike)                                  # one constant of one size differs
    one.collectives["p2p"]["inter"]["4"]["beta_s_per_byte"] *= 1.5
    assert not levels_price_alike(one)
    sizes = copy.deepcopy(alike)                                # a size only one level has
    sizes.collectives["allgather"]["inter"]["16"] = dict(sizes.collectives["allgather"]["inter"]["8"])
    assert not levels_price_alike(sizes)
    missing = copy.deepcopy(alike)
    del missing.collectives["allreduce"]["inter"]
    assert not levels_price_alike(missing)

    class Other(type(alike)):                                   # a collective model of its own
        def collective_time_s(self, kind, group_size, nbytes, level="intra"):
            return super().collective_time_s(kind, group_size, nbytes, level)
    other = Other(**{k: getattr(alike, k) for k in alike.__dataclass_fields__})
    assert not levels_price_alike(other)
    assert not levels_price_alike(None)


@pytest.fixture(scope="module")
def resnet2d_graph():
    from pathlib import Path

    from autopar.modelfile import load_model_file
    from autopar.trace.cache import trace_cached
    root = Path(__file__).resolve().parent.parent
    graph, _ = trace_cached(load_model_file(root / "strategies/examples/resnet2d.py"), 8)
    return graph


@pytest.mark.parametrize("world,rpn,alpha_s", [(8, 2, 1e-4), (8, 4, 3e-3), (16, 2, 1e-3)])
def test_settled_search_equals_the_full_search_and_every_placement(resnet2d_graph, world, rpn, alpha_s):
    prof = pricing_profile(synthetic_profile(ranks_per_node=rpn, nodes=world // rpn, inter_factor=1.0,
                                             alpha_s=alpha_s))
    ctx = CostContext(profile=prof, world=world, ranks_per_node=rpn, batch_size=8)

    def build(c):
        return build_cost_table(resnet2d_graph, c, kinds=CNN_KINDS, edges=False)

    def solve_table(tab):
        return solve(tab.ensure_edges())

    settled = search_placement(ctx, "search", build, solve_table, evaluate)
    full = search_placement(ctx, "search", build, solve_table, evaluate, settle_alike=False)
    strides = candidate_strides(world, rpn)
    assert strides, "the case needs placements to settle"
    assert str(settled.placement) == str(full.placement) == "block"
    assert settled.solution.choice == full.solution.choice
    assert settled.prediction.step_time_s == full.prediction.step_time_s
    assert [str(t.placement) for t in settled.trials] == [str(t.placement) for t in full.trials]
    assert [t.note for t in settled.trials[1:]] == [ALIKE_NOTE] * len(strides)
    assert "not priced" in settled.summary()
    # the reason itself: each placement solved on its own prices no plan below block's
    t_block = settled.prediction.step_time_s
    for s in strides:
        tab = build(replace(ctx, placement=RankMap(world, s)))
        sol = solve_table(tab)
        assert evaluate(tab, sol.choice).step_time_s >= t_block * (1 - 1e-12), s


def test_other_link_prices_keep_the_full_search(resnet2d_graph):
    prof = pricing_profile(synthetic_profile(ranks_per_node=2, nodes=4, inter_factor=20.0))
    ctx = CostContext(profile=prof, world=8, ranks_per_node=2, batch_size=8)
    built = []

    def build(c):
        built.append(c.placement)
        return build_cost_table(resnet2d_graph, c, kinds=CNN_KINDS, edges=False)

    res = search_placement(ctx, "search", build, lambda t: solve(t.ensure_edges()), evaluate)
    assert len(built) == 1 + len(candidate_strides(8, 2))
    assert all(t.note != ALIKE_NOTE for t in res.trials)
