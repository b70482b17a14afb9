"""The dynamic program over the layer order (``solve.elimination``) against brute force on random
tables and against the ILP (``--solver ilp``) on shipped models: the same optimum, a lower bound
that never exceeds it, and None (the ILP decides) outside its assumptions."""

import dataclasses
import random

import pytest

from autopar.cost.table import evaluate
from autopar.runtime.gradsync import layer_buckets
from autopar.solve.brute import brute_force
from autopar.solve.elimination import _Structure, solve_by_elimination
from autopar.solve.ilp import solve

from test_solver import random_table


def _constant_sync(table, rng):
    """Each layer synchronises gradients under all of its choices or under none (as real
    layers do: with parameters, every choice with a replicated share syncs)."""
    for o in table.layers:
        syn = rng.random() < 0.7
        o.costs = [dataclasses.replace(c, grad_sync_s=(c.grad_sync_s or rng.uniform(0.1, 3)) if syn else 0.0,
                                       grad_sync_latency=c.grad_sync_latency if syn else ())
                   for c in o.costs]


def _table(seed):
    rng = random.Random(seed)
    table = random_table(rng.randint(2, 7), 3, rng, dag=seed % 2 == 1, latency=seed % 4 == 0)
    _constant_sync(table, rng)
    if seed % 4 == 0 or seed % 3 == 0:
        table.buckets = layer_buckets([(l, rng.uniform(1, 3)) for l in range(len(table.layers))], cap_bytes=4)
    return table


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed):
    table = _table(seed)
    r = solve_by_elimination(table)
    best, best_t = brute_force(table)
    assert r is not None
    assert r.objective_s == pytest.approx(best_t, rel=1e-9, abs=1e-12)
    assert evaluate(table, r.choice).step_time_s == pytest.approx(r.objective_s, rel=1e-12)
    assert r.lower_bound_s <= best_t * (1 + 1e-9) + 1e-12
    assert r.gap <= 1e-9                       # proven, not only found


@pytest.mark.parametrize("seed", range(8))
def test_checkpoint_values_max_is_the_step_time(seed):
    """The unrolled all-reduce recurrence (module docstring) is evaluate's step time."""
    table = _table(100 + seed)
    st = _Structure(table)
    rng = random.Random(seed)
    for _ in range(5):
        choice = [rng.randrange(len(o.choices)) for o in table.layers]
        assert st.checkpoint_values(choice).max() == pytest.approx(evaluate(table, choice).step_time_s, rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_layers_that_sync_under_some_choices_only_keep_the_bounds(seed):
    """A layer that syncs under some choices only moves its bucket's start with the plan: the
    DP's functions then only bound evaluate's from below, the bound stays a bound, and the
    plan found is priced by evaluate (the default solve then equals brute force)."""
    rng = random.Random(200 + seed)
    table = random_table(rng.randint(2, 6), 3, rng, dag=seed % 2 == 1, latency=seed % 3 == 0)
    if seed % 2 == 0:
        table.buckets = layer_buckets([(l, rng.uniform(1, 3)) for l in range(len(table.layers))], cap_bytes=4)
    best, best_t = brute_force(table)
    r = solve_by_elimination(table)
    assert r is not None
    assert r.lower_bound_s <= best_t * (1 + 1e-9) + 1e-12 <= r.objective_s * (1 + 2e-9) + 2e-12
    assert evaluate(table, r.choice).step_time_s == pytest.approx(r.objective_s, rel=1e-12)
    assert solve(table).objective_s == pytest.approx(best_t, rel=1e-9)


def test_memory_limit_keeps_the_dp_plan_only_when_it_fits():
    """Under a memory limit the DP's (unconstrained) optimum is the answer when it fits;
    otherwise None, and the default solve's ILP finds brute force's constrained optimum."""
    table = _table(5)
    r = solve_by_elimination(table)
    mem = evaluate(table, r.choice).memory_per_rank_bytes
    assert solve_by_elimination(table, memory_limit_bytes=mem).choice == r.choice
    least = sum(min(c.memory_bytes for c in o.costs) for o in table.layers)
    assert least < mem                       # this table's optimum is not its smallest plan
    limit = (least + mem) / 2
    assert solve_by_elimination(table, memory_limit_bytes=limit) is None
    sol = solve(table, memory_limit_bytes=limit)
    assert sol.objective_s == pytest.approx(brute_force(table, limit)[1], rel=1e-6)


@pytest.mark.parametrize("model,world,env,proven", [
    ("strategies/examples/gpt.py", 8, {"AUTOPAR_GPT_LAYERS": "3"}, True),
    ("strategies/examples/parallel_gpt.py", 8, {}, True),
    ("strategies/examples/towers.py", 4, {}, True),
    # one gradient bucket holds most of this small CNN's layers: the exact stage gives up
    # (its limits) and the gap stays printed (the default path runs the ILP on such tables)
    ("strategies/examples/resnet2d.py", 8, {}, False),
])
def test_dp_and_ilp_agree_on_shipped_models(tmp_path, root, model, world, env, proven, monkeypatch):
    """The DP (forced: these small models would go to the ILP first) and the ILP alone give
    the same predicted step time (two nodes, so the placement search runs too)."""
    import autopar.solve.ilp as ilp
    from autopar.artifacts import PlanOptions
    from autopar.planner import make_plan
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(ilp, "ILP_MAX_PAIRS", 0)      # the DP first, its plan kept, gap or not
    got = {}
    for solver in ("highs", "ilp"):
        o = PlanOptions(world_size=world, ranks_per_node=world // 2, solver=solver, write=False,
                        calibration=str(root / "calibration/datasheet-a100-cluster.json"))
        r = make_plan(root / model, o)
        got[solver] = r.plan
    dp, ref = got["highs"], got["ilp"]
    assert dp.solver.solver == "dp" and ref.solver.solver == "highs"
    assert dp.predicted.step_time_s == pytest.approx(ref.predicted.step_time_s, rel=1e-6)
    assert ref.solver.sol_status == 1
    if proven:
        assert dp.solver.sol_status == 1 and dp.solver.gap <= 1e-6
    else:
        assert dp.solver.sol_status in (1, 2) and dp.solver.gap is not None


def test_dp_proves_the_ilp_optimum_of_a_gpt_at_1024_ranks(root, monkeypatch):
    """The setting the DP is for: a GPT (2 blocks, E 1024, V 50304, batch 1024) at 1024
    simulated ranks with every decomposition (head, sequence, vocabulary, row/column splits),
    where the all-reduce is exposed and the ILP's LP relaxation is fractional. The default path
    (DP first, forced here at this size) proves the ILP's optimum."""
    import autopar.solve.ilp as ilp
    from autopar.artifacts import PlanOptions
    from autopar.planner import make_plan
    for k, v in {"AUTOPAR_GPT_LAYERS": "2", "AUTOPAR_GPT_EMBED": "1024", "AUTOPAR_GPT_HEADS": "16",
                 "AUTOPAR_GPT_SEQ": "1024", "AUTOPAR_GPT_VOCAB": "50304"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(ilp, "ILP_MAX_PAIRS", 0)
    got = {}
    for solver in ("highs", "ilp"):
        o = PlanOptions(world_size=1024, batch_size=1024, placement="block", solver=solver, write=False,
                        calibration=str(root / "calibration/datasheet-a100-cluster.json"))
        got[solver] = make_plan(root / "strategies/examples/gpt.py", o).plan
    dp, ref = got["highs"], got["ilp"]
    assert dp.solver.solver == "dp" and dp.solver.sol_status == 1 and dp.solver.gap <= 1e-6
    assert ref.solver.sol_status == 1
    assert dp.predicted.step_time_s == pytest.approx(ref.predicted.step_time_s, rel=1e-9)
    assert dp.predicted.exposed_comm_s > 0          # the max in the step time matters here


def _hub_chain(n: int, k: int, seed: int):
    """A chain of ``n`` variables of ``k`` values each, every one also joined to variable 0 (a hub,
    as the rotary tables of a traced Llama are read by every block), random pairwise factors."""
    import numpy as np
    rng = np.random.default_rng(seed)
    factors = [((i,), rng.random(k)) for i in range(n)]
    factors += [((i, i + 1), rng.random((k, k))) for i in range(1, n - 1)]
    factors += [((0, i), rng.random((k, k))) for i in range(2, n)]
    return factors, [k] * n


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("wide", [3 ** 2, 10 ** 9])
def test_elimination_order_changes_tables_not_the_minimum(seed, wide, monkeypatch):
    """Eliminating in the greedy min-size order (taken when the given order builds a wide table)
    gives the same minimum and a plan of that cost as the given order; the widest table shrinks."""
    import itertools
    import math
    import autopar.solve.elimination as elim
    from autopar.solve.elimination import _assign, _eliminate, elimination_order
    monkeypatch.setattr(elim, "WIDE_TABLE_ENTRIES", wide)     # greedy order (3^2) or the given one
    factors, k = _hub_chain(7, 3, seed)
    # the given order keeps the hub (0) pending: take it last-but-chain, 1 first
    order = [1, 0, 2, 3, 4, 5, 6]
    wide = elimination_order([s for s, _ in factors], order, k, wide=3 ** 2)
    assert sorted(wide) == sorted(order) and wide != order
    kept = elimination_order([s for s, _ in factors], order, k, wide=10 ** 9)
    assert kept == order

    def cost(choice):
        return sum(float(a[tuple(choice[v] for v in s)]) for s, a in factors)
    best = min(cost(c) for c in itertools.product(range(3), repeat=7))
    const, left, trail = _eliminate([(s, a.copy()) for s, a in factors], order, k)
    assert not left and math.isclose(const, best, rel_tol=1e-12)
    choice = [0] * 7
    _assign(trail, choice)
    assert math.isclose(cost(choice), best, rel_tol=1e-12)


def test_elimination_order_keeps_a_chain_in_execution_order():
    """A chain without a hub builds tables of k^2 in reverse execution order: kept as given (the
    plans of the shipped models do not move)."""
    from autopar.solve.elimination import elimination_order
    scopes = [(i, i + 1) for i in range(9)]
    order = list(reversed(range(10)))
    assert elimination_order(scopes, order, [7] * 10, 7 ** 2) == order
