"""Learning from runs (refit of kernel coefficients) and the strong-scaling sweep."""

import copy

import pytest

from autopar.calibrate.refine import apply_corrections, fit_corrections


def _plan_and_run(world, scale, comm_scale, overhead, n=8):
    layers, measured = [], []
    for i in range(n):
        kinds = ["conv", "batch_norm", "unary"] if i % 2 == 0 else ["linear"]
        comp = 0.001 * (i + 1)
        comm = 0.0002 * (i % 3)
        layers.append({"layer": i, "kinds": kinds, "predicted": {
            "fwd_compute_s": comp / 3, "bwd_compute_s": 2 * comp / 3, "fwd_comm_s": comm, "bwd_comm_s": 0.0}})
        measured.append({"layer": i, "measured_s": scale * comp + comm_scale * comm + overhead * len(kinds)})
    # one communication-dominated layer
    layers.append({"layer": n, "kinds": ["binary"], "predicted": {
        "fwd_compute_s": 1e-5, "bwd_compute_s": 0.0, "fwd_comm_s": 0.004, "bwd_comm_s": 0.0}})
    measured.append({"layer": n, "measured_s": scale * 1e-5 + comm_scale * 0.004})
    return {"world_size": world, "layers": layers, "transitions": []}, {"measured": {"per_layer": measured}}


def test_fit_recovers_factors_per_world():
    p2, r2 = _plan_and_run(2, 1.4, 3.0, 0.0)
    p4, r4 = _plan_and_run(4, 1.9, 3.0, 0.0)
    c = fit_corrections([r2, r4], [p2, p4])
    assert c["compute_scale_by_world"]["2"] == pytest.approx(1.4, rel=1e-6)
    assert c["compute_scale_by_world"]["4"] == pytest.approx(1.9, rel=1e-6)
    assert c["comm_scale"] == pytest.approx(3.0, rel=1e-3)


def test_apply_scales_slowdown_collectives_and_overhead(profile):
    corr = {"compute_scale_by_world": {"2": 1.5}, "comm_scale": 2.0, "per_op_overhead_s": 3e-5,
            "apply_world_scale": True}
    new = apply_corrections(profile, corr)
    assert new.slowdown(2) == pytest.approx(1.5 * profile.slowdown(2))
    assert new.collective_time_s("allreduce", 2, 1e6) == pytest.approx(2 * profile.collective_time_s("allreduce", 2, 1e6))
    assert new.kernels["runtime_op"]["t0_s"] == pytest.approx(3e-5)
    assert "runtime_op" not in profile.kernels  # the original is untouched


def test_scaling_sweep_has_three_series(tmp_path, root, profile):
    from autopar.calibrate.profile import save_profile
    from autopar.report.scaling import plot, sweep
    pf = tmp_path / "p.json"
    save_profile(profile, pf)
    res = sweep(root / "strategies/examples/cnn3d_large.py", [1, 2, 4, 8], 2, str(pf))
    assert set(res["series"]) == {"sample-only", "spatial-only", "hybrid (ILP, all kinds)"}
    hyb = {p["world"]: p["step_time_s"] for p in res["series"]["hybrid (ILP, all kinds)"]}
    samp = {p["world"]: p["step_time_s"] for p in res["series"]["sample-only"]}
    # the ILP's hybrid is never predicted slower than sample-only (it can choose it)
    assert all(hyb[w] <= samp[w] * (1 + 1e-9) for w in samp if w in hyb)
    assert plot(res, tmp_path / "s.png").is_file()
