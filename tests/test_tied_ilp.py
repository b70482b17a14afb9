"""The ILP's tied-parameter constraint (``solve.ilp._add_tied``) against brute force: on small
random tables where some layers share one parameter and each choice holds it one of a few ways
(whole, or one of two splits), the optimum is the best plan in which every layer sharing the
parameter holds it the same way; a pinned mismatch is a named error."""

import random

import pytest

from autopar.cost.table import tied_choice_sets
from autopar.decomp.ir import OpSpec
from autopar.errors import InfeasiblePlan
from autopar.solve.brute import brute_force
from autopar.solve.ilp import solve, tied_ok

from test_solver import random_table


class _Holds:
    """A stand-in decomposition holding the tied parameter as ``shard`` (a hashable token)."""

    def __init__(self, i, shard):
        self.kind, self.shard = f"c{i}{shard}", shard

    def layer_param_shard(self, layer, op, role):
        return self.shard

    def __str__(self):
        return self.kind


def _tie(table, layers, rng, ways=("whole", "vocab2", "vocab4")):
    """Make ``layers`` of ``table`` use one tied parameter, each choice holding it some way."""
    for l in layers:
        o = table.layers[l]
        op = o.layer.ops[0]
        o.layer.ops[0] = OpSpec(name=op.name, kind=op.kind, target=op.target, args=[], kwargs={},
                                out_shape=op.out_shape, dtype=op.dtype, inputs=[], in_shapes=[],
                                params={"weight": [4, 4]}, param_names={"weight": "tok.weight"},
                                attrs={"tied": ["weight"]})
        o.choices = [_Holds(i, ways[0] if i == 0 else rng.choice(ways)) for i in range(len(o.choices))]


@pytest.mark.parametrize("seed", range(10))
def test_ilp_with_tied_layers_equals_brute_force(seed):
    rng = random.Random(500 + seed)
    table = random_table(rng.randint(3, 6), 3, rng, dag=seed % 2 == 1)
    n = len(table.layers)
    tied = sorted(rng.sample(range(n), rng.choice([2, 3]) if n > 3 else 2))
    _tie(table, tied, rng)
    sets = tied_choice_sets(table)
    assert [q for q, _ in sets] == ["tok.weight"]
    best, best_t = brute_force(table)
    sol = solve(table)
    assert tied_ok(table, sol.choice)
    assert sol.objective_s == pytest.approx(best_t, rel=1e-6, abs=1e-9)


def test_tied_constraint_changes_the_answer_where_the_cheapest_mix_is_illegal():
    """Two layers share the parameter; each is cheapest holding it a different way. Without the
    constraint the solver would mix them; with it, it picks the best consistent pair."""
    from dataclasses import replace

    from autopar.cost.table import EdgeOptions
    rng = random.Random(7)
    table = random_table(2, 2, rng)
    _tie(table, [0, 1], rng)
    table.edges = [EdgeOptions(0, 1, "l0", [[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]])]
    a, b = table.layers
    a.choices = [_Holds(0, "whole"), _Holds(1, "vocab2")]
    b.choices = [_Holds(0, "whole"), _Holds(1, "vocab2")]
    a.costs = [replace(a.costs[0], fwd_compute_s=1.0), replace(a.costs[0], fwd_compute_s=0.1)]
    b.costs = [replace(b.costs[0], fwd_compute_s=0.1), replace(b.costs[0], fwd_compute_s=0.5)]
    sol = solve(table)
    assert sol.choice == [1, 1]                         # 0.1 + 0.5 beats 1.0 + 0.1; (1, 0) mixes
    assert not tied_ok(table, [1, 0])


def test_pinned_mismatch_is_a_named_error():
    rng = random.Random(3)
    table = random_table(3, 2, rng)
    _tie(table, [0, 2], rng)
    table.layers[0].choices = [_Holds(0, "vocab2")]
    table.layers[0].costs = table.layers[0].costs[:1]
    table.layers[2].choices = [_Holds(0, "whole"), _Holds(1, "vocab4")][:len(table.layers[2].costs)]
    with pytest.raises(InfeasiblePlan, match=r"tok.weight is tied: l0 would hold it"):
        solve(table)


@pytest.mark.parametrize("seed", range(6))
def test_the_dynamic_program_path_keeps_tied_parameters_whole_or_alike(seed, monkeypatch):
    """Above ``ILP_MAX_PAIRS`` the DP runs first; it knows no tied constraint, so a plan of it
    that holds the parameter two ways must go to the ILP: the result equals brute force."""
    import autopar.solve.ilp as ilp
    monkeypatch.setattr(ilp, "ILP_MAX_PAIRS", 0)
    rng = random.Random(900 + seed)
    table = random_table(rng.randint(3, 6), 3, rng, dag=seed % 2 == 1)
    n = len(table.layers)
    _tie(table, sorted(rng.sample(range(n), 2)), rng)
    best, best_t = brute_force(table)
    sol = ilp.solve(table)
    assert tied_ok(table, sol.choice)
    assert sol.objective_s == pytest.approx(best_t, rel=1e-6, abs=1e-9)
