"""The ILP against brute-force enumeration on small random graphs, and its diagnostics."""

import random

import pytest

from autopar.cost.table import CostTable, EdgeOptions, LayerOptions, evaluate
from autopar.decomp.base import CostContext, LayerCost
from autopar.decomp.ir import Layer, LayerGraphData, OpSpec
from autopar.errors import InfeasiblePlan
from autopar.solve.brute import brute_force
from autopar.solve.ilp import solve


class _Choice:
    def __init__(self, i):
        self.kind = f"c{i}"
        self.i = i

    def __str__(self):
        return self.kind


def _op(name):
    return OpSpec(name=name, kind="conv", target="aten.conv2d.default", args=[], kwargs={},
                  out_shape=[2, 2], dtype="float32", inputs=[], in_shapes=[], params={}, param_names={})


def _cost(rng, latency):
    sync = rng.choice([0.0, rng.uniform(0, 3)])
    lat = ()
    if latency and sync:   # a share of the sync is a group's latency, paid once per bucket
        groups = rng.sample(["world", "g2", "g3"], rng.randint(1, 2))
        lat = tuple((g, {"world": 0.5, "g2": 0.3, "g3": 0.2}[g] * sync / 2,
                     {"world": 0.9, "g2": 0.6, "g3": 0.2}[g] * sync / 2) for g in groups)
    return LayerCost(fwd_compute_s=rng.uniform(0, 1), bwd_compute_s=rng.uniform(0, 2),
                     fwd_comm_s=rng.uniform(0, 0.3), grad_sync_s=sync, grad_sync_latency=lat,
                     activation_bytes=rng.uniform(1, 10), optim_step_s=rng.uniform(0, 0.1))


def random_table(n_layers, n_choices, rng, dag=False, latency=False):
    layers = [Layer(index=l, name=f"l{l}", ops=[_op(f"l{l}")], inputs=[], output=f"l{l}") for l in range(n_layers)]
    opts = []
    for l in range(n_layers):
        k = rng.randint(1, n_choices)
        costs = [_cost(rng, latency) for _ in range(k)]
        opts.append(LayerOptions(layers[l], [_Choice(i) for i in range(k)], costs))
    pairs = [(l - 1, l) for l in range(1, n_layers)]
    if dag:
        for l in range(2, n_layers):
            if rng.random() < 0.5:
                pairs.append((rng.randrange(0, l - 1), l))
    edges = []
    for u, v in pairs:
        nu, nv = len(opts[u].choices), len(opts[v].choices)
        f = [[0.0 if i == j else rng.uniform(0, 1) for j in range(nv)] for i in range(nu)]
        b = [[x * rng.uniform(0.5, 1.5) for x in row] for row in f]
        edges.append(EdgeOptions(u, v, f"l{u}", f, b))
    graph = LayerGraphData(layers=layers, inputs=[], output=f"l{n_layers - 1}", batch_size=2)
    ctx = CostContext(profile=None, world=2, ranks_per_node=2)
    return CostTable(graph, ctx, opts, edges, topo=list(range(n_layers)))


@pytest.mark.parametrize("seed", range(12))
def test_ilp_equals_brute_force(seed):
    rng = random.Random(seed)
    table = random_table(rng.randint(2, 6), 3, rng, dag=seed % 2 == 1, latency=seed % 4 == 0)
    if seed % 4 == 0 or seed % 3 == 0:   # gradient buckets of several layers, as the runtime forms them
        from autopar.runtime.gradsync import layer_buckets
        table.buckets = layer_buckets([(l, rng.uniform(1, 3)) for l in range(len(table.layers))], cap_bytes=4)
    sol = solve(table)
    best, best_t = brute_force(table)
    assert sol.objective_s == pytest.approx(best_t, rel=1e-6, abs=1e-9)
    assert evaluate(table, sol.choice).step_time_s == pytest.approx(best_t, rel=1e-6, abs=1e-9)
    assert sol.sol_status == 1 and sol.gap is not None


@pytest.mark.parametrize("seed", range(6))
def test_ilp_equals_brute_force_under_memory_limit(seed):
    rng = random.Random(100 + seed)
    table = random_table(5, 3, rng, dag=True)
    mems = [min(c.memory_bytes for c in o.costs) for o in table.layers]
    limit = sum(mems) * 1.3
    best, best_t = brute_force(table, limit)
    sol = solve(table, memory_limit_bytes=limit)
    assert sol.objective_s == pytest.approx(best_t, rel=1e-6)
    assert evaluate(table, sol.choice).memory_per_rank_bytes <= limit + 1e-9


def test_cbc_agrees_with_highs():
    table = random_table(5, 3, random.Random(7), dag=True)
    assert solve(table, solver="cbc").objective_s == pytest.approx(solve(table).objective_s, rel=1e-6)


def test_infeasible_memory_names_layers_and_minimum():
    table = random_table(4, 2, random.Random(3))
    need = sum(min(c.memory_bytes for c in o.costs) for o in table.layers)
    with pytest.raises(InfeasiblePlan) as e:
        solve(table, memory_limit_bytes=need * 0.5)
    msg = str(e.value)
    assert "smallest possible" in msg and "l" in msg and "--memory-limit" in msg


def test_overlap_hides_allreduce_behind_backward():
    table = random_table(3, 1, random.Random(0))
    for o in table.layers:
        o.costs = [LayerCost(fwd_compute_s=1.0, bwd_compute_s=2.0)]
    # the last layer's gradients exist 2 s into backward: its 3 s allreduce ends at 3+2+3 = 8 s,
    # inside the 9 s of compute: hidden
    table.layers[2].costs = [LayerCost(fwd_compute_s=1.0, bwd_compute_s=2.0, grad_sync_s=3.0)]
    p = evaluate(table, [0, 0, 0])
    assert p.step_time_s == pytest.approx(9.0) and p.exposed_comm_s == pytest.approx(0.0)
    # the first layer's gradients exist only at the end of backward: fully exposed
    table.layers[2].costs = [LayerCost(fwd_compute_s=1.0, bwd_compute_s=2.0)]
    table.layers[0].costs = [LayerCost(fwd_compute_s=1.0, bwd_compute_s=2.0, grad_sync_s=3.0)]
    p = evaluate(table, [0, 0, 0])
    assert p.step_time_s == pytest.approx(12.0) and p.exposed_comm_s == pytest.approx(3.0)
    assert solve(table).objective_s == pytest.approx(12.0)


def test_bucket_pays_each_group_latency_once():
    from autopar.cost.table import bucket_allreduce_s
    a = LayerCost(grad_sync_s=3.0, grad_sync_latency=(("world", 1.0, 4.0),))
    b = LayerCost(grad_sync_s=2.5, grad_sync_latency=(("world", 1.0, 4.0), ("g", 0.5, 0.5)))
    c = LayerCost(grad_sync_s=1.2, grad_sync_latency=(("g", 0.7, 2.0),))
    # bandwidth parts 2.0 + 1.0 + 0.5, then world once (1.0) and g once (its largest, 0.7)
    assert bucket_allreduce_s([a, b, c]) == pytest.approx(2.0 + 1.0 + 0.5 + 1.0 + 0.7)
    assert bucket_allreduce_s([a]) == pytest.approx(3.0)
    # the last bucket, waited for right after backward, pays the blocking latencies
    assert bucket_allreduce_s([a, b, c], final=True) == pytest.approx(2.0 + 1.0 + 0.5 + 4.0 + 2.0)
