"""Cost primitives that read measured in-step behaviour: in-situ latency of blocking
collectives per (group size, ranks on the node), and the learned correction factors."""

import pytest

from autopar.cost import primitives as prim
from autopar.decomp.base import CostContext


def test_insitu_latency_depends_on_ranks_running(profile):
    profile.samples["insitu_latency_by_world_s"] = {"2": {"2": 0.001}, "4": {"2": 0.003, "3": 0.005, "4": 0.008}}
    profile.samples["insitu_latency_s"] = {"2": 0.001, "4": 0.008}
    # a pair alone on the node vs a pair while two more ranks compute
    assert prim.insitu_latency_s(profile, 2, 2) == pytest.approx(0.001)
    assert prim.insitu_latency_s(profile, 2, 4) == pytest.approx(0.003)
    assert prim.insitu_latency_s(profile, 4, 4) == pytest.approx(0.008)
    # beyond the measured worlds: the nearest one
    assert prim.insitu_latency_s(profile, 2, 64) == pytest.approx(0.003)
    # without the ranks running, the p = w diagonal (older profiles have only that)
    assert prim.insitu_latency_s(profile, 4) == pytest.approx(0.008)
    del profile.samples["insitu_latency_by_world_s"]
    assert prim.insitu_latency_s(profile, 2, 4) == pytest.approx(0.001)


def test_blocking_collective_priced_with_the_world_it_runs_in(profile):
    profile.samples["insitu_latency_by_world_s"] = {"2": {"2": 0.001}, "4": {"2": 0.003, "4": 0.008}}
    alone = CostContext(profile=profile, world=2, ranks_per_node=2)
    crowded = CostContext(profile=profile, world=4, ranks_per_node=4)
    t2 = prim.blocking_s(alone, "allreduce", 2, 64, "intra")
    t4 = prim.blocking_s(crowded, "allreduce", 2, 64, "intra")
    assert t4 - t2 == pytest.approx(0.002, rel=1e-6)


def test_grad_sync_latency_names_the_group(profile):
    ctx = CostContext(profile=profile, world=4, ranks_per_node=4)
    ((sig, lat, final),) = prim.grad_sync_latency(ctx, range(4), "world")
    assert sig == "world"
    assert lat == pytest.approx(profile.collective_time_s("allreduce", 4, 0.0))
    assert final == pytest.approx(lat)          # nothing measured in situ: the fit
    profile.samples["insitu_latency_by_world_s"] = {"4": {"4": 0.05}}
    ((_, lat2, final2),) = prim.grad_sync_latency(ctx, range(4), "world")
    assert lat2 == pytest.approx(lat) and final2 == pytest.approx(max(lat, 0.05))
    assert 0 < lat < prim.grad_sync_time_s(ctx, 1e6, range(4))
    assert prim.grad_sync_latency(ctx, [2]) == ()


def test_insitu_measurement_covers_every_group_size_of_every_world(profile):
    from autopar.calibrate.insitu import apply_insitu, measure_insitu_latency_s
    res = measure_insitu_latency_s([3], iters=2, timeout_s=120)
    assert set(res) == {"3"} and set(res["3"]) == {"2", "3"}
    assert all(t >= 0 for t in res["3"].values())
    apply_insitu(profile, res)
    assert profile.samples["insitu_latency_s"] == {"3": res["3"]["3"]}
    assert profile.samples["insitu_latency_by_world_s"] == res


def test_insitu_latency_per_kind_falls_back_to_allreduce(profile):
    profile.samples["insitu_latency_by_world_s"] = {"4": {"2": 0.003, "4": 0.008}}
    profile.samples["insitu_latency_by_kind_s"] = {"all_to_all": {"4": {"4": 0.002}},
                                                   "p2p": {"4": {"2": 0.004}}}
    assert prim.insitu_latency_s(profile, 4, 4, "all_to_all") == pytest.approx(0.002)
    assert prim.insitu_latency_s(profile, 2, 4, "p2p") == pytest.approx(0.004)
    assert prim.insitu_latency_s(profile, 4, 4, "allgather") == pytest.approx(0.008)   # no table: all-reduce's
    assert prim.insitu_latency_s(profile, 4, 4) == pytest.approx(0.008)
