"""The straggler wait (``cost.primitives``): a synchronisation waits for the slowest rank
``min(kappa t, sigma sqrt(t))`` after t seconds of compute since the last one. A layer choice
pays it in each phase whose blocking collective it issues; the compute of phases that
synchronise nothing runs on to the step's closing synchronisation, priced by the tangent of the
wait at the data-parallel plan's unsynchronised compute; a profile measured before sigma
charges all compute 1 + kappa as before."""

import dataclasses
import math

import pytest

from autopar.calibrate.insitu import apply_straggler, straggler_point
from autopar.profile.straggler import Straggler, fit_straggler
from autopar.cost import primitives as prim
from autopar.decomp.base import CostContext, LayerCost


def _ctx(profile, world=4):
    from autopar.decomp.bn import BatchNormStats
    return CostContext(profile=profile, world=world, ranks_per_node=world, batch_size=8,
                       batch_norm=BatchNormStats("local", 8 // world))


def test_wait_is_linear_then_square_root():
    st = Straggler(kappa=0.2, sigma=0.05)
    assert st.wait_s(0.01) == pytest.approx(0.002)                 # 0.2 t < 0.05 sqrt(t)
    assert st.wait_s(0.5) == pytest.approx(0.05 * math.sqrt(0.5))  # beyond t* = (sigma / kappa)^2
    assert st.wait_s(0.0) == 0.0


def test_charge_per_phase(profile):
    apply_straggler(profile, {"4": Straggler(kappa=0.2, sigma=0.05)})
    ctx = _ctx(profile)
    ch = prim.straggler_charge(ctx, reference_s=0.5)
    # tangent of 0.05 sqrt(U) at U0 = 0.5: exact there, half of it at U = 0
    assert ch.rate == pytest.approx(0.05 / (2 * math.sqrt(0.5)))
    assert ch.closing_s == pytest.approx(0.05 * math.sqrt(0.5) / 2)
    assert ch.closing_s + ch.rate * 0.5 == pytest.approx(ch.wait_s(0.5))
    c = LayerCost(fwd_compute_s=0.01, bwd_compute_s=0.4, fwd_comm_s=0.001, bwd_comm_s=0.0)
    p = ch.apply(c)
    assert p.fwd_compute_s == c.fwd_compute_s                                  # forward synchronises:
    assert p.fwd_comm_s == pytest.approx(0.001 + 0.2 * 0.01)                   # its own wait
    assert p.bwd_comm_s == 0.0 and p.bwd_compute_s == pytest.approx(0.4 * (1 + ch.rate))  # runs on
    # a plan short enough to stay linear: the rate is kappa and nothing closes
    short = prim.straggler_charge(ctx, reference_s=0.01)
    assert short.rate == pytest.approx(0.2) and short.closing_s == 0.0
    # compute itself is no longer multiplied by 1 + kappa; one rank waits for nobody
    assert prim._compute_slowdown(ctx) == pytest.approx(profile.slowdown(4))
    assert prim.straggler_charge(_ctx(profile, world=1), 0.5) is None


def test_profile_without_sigma_keeps_the_linear_factor(profile):
    profile.samples["straggler_kappa"] = {"4": 0.5}
    profile.samples.pop("straggler_sigma", None)
    ctx = _ctx(profile)
    assert prim.straggler_charge(ctx, 0.5) is None
    assert prim._compute_slowdown(ctx) == pytest.approx(profile.slowdown(4) * 1.5)


def test_data_parallel_plan_pays_the_wait_of_its_whole_step_once(root, profile):
    """The tangent is exact at the data-parallel plan: its forward + backward grow by exactly
    wait(U0) (U0 its unsynchronised compute, every layer of it here); the closing part sits in
    the first layer's backward under all its choices; the solver still minimises evaluate."""
    from autopar.cost.native import native_choice
    from autopar.cost.primitives import unsynced_compute_s
    from autopar.cost.table import build_cost_table, evaluate
    from autopar.modelfile import load_model_file
    from autopar.solve.ilp import solve
    from autopar.trace.tracer import trace_model
    g = trace_model(load_model_file(root / "strategies/examples/resnet2d.py"), 8)
    profile.samples["straggler_kappa"] = {"4": 0.0}
    profile.samples.pop("straggler_sigma", None)
    bare = build_cost_table(g, _ctx(profile))
    apply_straggler(profile, {"4": Straggler(kappa=1.0, sigma=0.01)})
    charged = build_cost_table(g, _ctx(profile))
    dp = native_choice(bare)
    u0 = sum(unsynced_compute_s(o.costs[i]) for o, i in zip(bare.layers, dp))
    assert charged.straggle.reference_s == pytest.approx(u0)
    assert evaluate(charged, dp).step_time_s >= evaluate(bare, dp).step_time_s
    assert evaluate(charged, dp).fwd_s + evaluate(charged, dp).bwd_s == pytest.approx(
        evaluate(bare, dp).fwd_s + evaluate(bare, dp).bwd_s + 0.01 * math.sqrt(u0))
    for c, c0 in zip(charged.layers[0].costs, bare.layers[0].costs):
        assert c.bwd_comm_s >= c0.bwd_comm_s + charged.straggle.closing_s - 1e-15
    sol = solve(charged)
    assert sol.objective_s == pytest.approx(evaluate(charged, sol.choice).step_time_s)
    assert sol.objective_s <= evaluate(charged, dp).step_time_s + 1e-12


def test_fit_from_rounds():
    """``straggler_point`` reads the wait within the same rounds; ``fit_straggler`` takes kappa
    from the short segments and sigma from the long one (the waits measured on the 2-core
    machine with 4 ranks: 2.1, 7.1, 18.3 ms after 7.1, 34.7, 126.6 ms of compute)."""
    # two ranks, three rounds: the slower one sets each round
    t, d = straggler_point([[1.0, 2.0, 3.0], [1.5, 2.0, 2.0]], "median")
    assert t == pytest.approx(2.0) and d == pytest.approx(0.25)
    t, d = straggler_point([[1.0, 2.0, 3.0], [1.5, 2.0, 2.0]])        # the mean, as calibration reads it
    assert t == pytest.approx((1.25 + 2.0 + 2.5) / 3) and d == pytest.approx(0.25)
    st = fit_straggler([(7.1e-3, 2.14e-3), (34.7e-3, 7.13e-3), (126.6e-3, 18.32e-3)])
    assert st.kappa == pytest.approx((2.14 / 7.1 + 7.13 / 34.7) / 2)
    assert st.sigma == pytest.approx(18.32e-3 / math.sqrt(126.6e-3))
    assert st.wait_s(126.6e-3) == pytest.approx(18.32e-3)
    # waits that never grew: nothing to charge
    flat = fit_straggler([(1e-3, -1e-4), (4e-3, 0.0), (16e-3, -1e-3)])
    assert flat.kappa == 0.0 and flat.sigma == 0.0


def test_comm_interference_from_the_overlap_times():
    """``comm_interference``: the share of an all-reduce that compute beside it does not hide,
    per rank ``(both - max) / min``, the median over ranks, clipped to [0, 1]."""
    from autopar.calibrate.insitu import comm_interference
    hidden = {"compute": 10.0, "comm": 4.0, "both": 10.0}          # fully behind compute
    half = {"compute": 10.0, "comm": 4.0, "both": 12.0}
    serial = {"compute": 10.0, "comm": 4.0, "both": 15.0}         # worse than one after the other
    assert comm_interference([hidden, hidden]) == 0.0
    assert comm_interference([half, half, serial]) == pytest.approx(0.5)
    assert comm_interference([serial]) == 1.0
    assert comm_interference([]) == 0.0


def test_gradient_all_reduce_takes_compute_where_measured(root, profile):
    """With ``samples["comm_interference"]`` measured, every choice that synchronises
    gradients adds phi x its all-reduce's transfer time (latency terms excluded) to its backward
    compute; the solver and ``evaluate`` read it alike; one rank, or no measurement, prices as
    before."""
    from autopar.calibrate.insitu import apply_comm_interference
    from autopar.cost.table import build_cost_table, evaluate
    from autopar.modelfile import load_model_file
    from autopar.solve.ilp import solve
    from autopar.trace.tracer import trace_model
    g = trace_model(load_model_file(root / "strategies/examples/resnet2d.py"), 8)
    profile.samples.pop("comm_interference", None)
    bare = build_cost_table(g, _ctx(profile))
    apply_comm_interference(profile, {"4": 0.5})
    assert prim.comm_interference(profile, 4) == 0.5 and prim.comm_interference(profile, 1) == 0.0
    charged = build_cost_table(g, _ctx(profile))
    synced = 0
    for o, o0 in zip(charged.layers, bare.layers):
        for c, c0 in zip(o.costs, o0.costs):
            transfer = c0.grad_sync_s - sum(t for _, t, _ in c0.grad_sync_latency)
            assert c.fwd_compute_s == pytest.approx(c0.fwd_compute_s)
            if c0.grad_sync_s > 0 and transfer > 0:
                synced += 1
                assert c.bwd_compute_s > c0.bwd_compute_s
            else:
                assert c.bwd_compute_s == pytest.approx(c0.bwd_compute_s)
    assert synced > 0
    sol = solve(charged)
    assert sol.objective_s == pytest.approx(evaluate(charged, sol.choice).step_time_s)
    one = build_cost_table(g, _ctx(profile, world=1))
    profile.samples.pop("comm_interference")
    one_bare = build_cost_table(g, _ctx(profile, world=1))
    assert [c.bwd_compute_s for o in one.layers for c in o.costs] == \
        [c.bwd_compute_s for o in one_bare.layers for c in o.costs]


def _rounds(w: int, stall_s: float) -> dict:
    """Synthetic probe rounds of w ranks (``insitu.raw_rounds``' layout): every probe's sync
    rounds take 3 ms against 1 ms local, one sync round in ten stalls ``stall_s`` more; rank
    1's long straggler segments run 2 ms over rank 0's in a fifth of the rounds."""
    from autopar.calibrate.insitu import KIND_GROUPS, VARIANTS
    probe = {name: ([3e-3] * 9 + [3e-3 + stall_s]) if sync else [1e-3] * 10 for name, sync in VARIANTS}
    raw = {"straggler": {str(L): [[L * 1e-3] * 10, [L * 1e-3 + (2e-3 if i % 5 == 0 else 0.0) for i in range(10)]]
                         + [[L * 1e-3] * 10] * (w - 2) for L in (2, 8, 32)}}
    for p in range(2, w + 1):
        raw[f"allreduce:{p}"] = [probe] * w
    for kind, groups in KIND_GROUPS.items():
        for p in groups(w):
            raw[f"{kind}:{p}"] = [probe] * w
    return raw


def test_in_situ_estimates_from_stored_rounds():
    """The median reading ignores a stall one round in ten meets and the occasional straggler;
    the mean counts both (``estimate_in_situ``; calibration stores ``STORED_STAT``'s)."""
    from autopar.calibrate.insitu import STORED_STAT, estimate_in_situ, latency_s
    raw = _rounds(2, stall_s=0.01)
    st, lat, by_kind = estimate_in_situ(raw, 2, "median")
    assert st.kappa == 0.0 and st.sigma == 0.0                   # the median round waits nothing
    assert lat == {"2": pytest.approx(1e-3)}                     # (3 ms - 1 ms) / 2
    assert by_kind["p2p"] == {"2": pytest.approx(1e-3)}
    st_m, lat_m, _ = estimate_in_situ(raw, 2, "mean")
    assert estimate_in_situ(raw, 2) == estimate_in_situ(raw, 2, STORED_STAT)
    assert st_m.sigma == pytest.approx(0.2e-3 / math.sqrt(32e-3 + 0.2e-3))   # max - mean: 1 ms in 2 rounds of 10
    assert lat_m["2"] > lat["2"] + 4e-4                           # the stall's 1 ms per sync, less the mean straggler wait
    assert latency_s(raw["allreduce:2"], None, "mean") == pytest.approx((4e-3 - 1e-3) / 2)
    with pytest.raises(ValueError, match="one of median, mean"):
        estimate_in_situ(raw, 2, "p90")
