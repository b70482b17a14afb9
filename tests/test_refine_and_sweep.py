"""Learning from runs (refit of kernel coefficients) and the strong-scaling sweep."""

import copy

import pytest

from autopar.calibrate.refine import apply_corrections, fit_corrections


def _plan_and_run(scale_conv, overhead, n=6):
    layers, measured = [], []
    for i in range(n):
        kinds = ["conv", "batch_norm", "unary"] if i % 2 == 0 else ["linear"]
        comp = 0.001 * (i + 1)
        comm = 0.0002
        layers.append({"layer": i, "kinds": kinds, "predicted": {
            "fwd_compute_s": comp / 3, "bwd_compute_s": 2 * comp / 3, "fwd_comm_s": comm, "bwd_comm_s": 0.0}})
        a = scale_conv if kinds[0] == "conv" else 1.0
        measured.append({"layer": i, "measured_s": a * comp + overhead * len(kinds) + comm})
    return {"layers": layers, "transitions": []}, {"measured": {"per_layer": measured}}


def test_fit_recovers_scale_and_overhead():
    plan, run = _plan_and_run(scale_conv=1.7, overhead=2e-4)
    c = fit_corrections([run], [plan])
    assert c["a_conv"] == pytest.approx(1.7, rel=1e-6)
    assert c["a_matmul"] == pytest.approx(1.0, rel=1e-6)
    assert c["per_op_overhead_s"] == pytest.approx(2e-4, rel=1e-6)


def test_apply_scales_classes_and_adds_overhead(profile):
    corr = {"a_conv": 2.0, "a_matmul": 1.0, "a_other": 0.5, "per_op_overhead_s": 3e-4}
    new = apply_corrections(profile, corr)
    f = 1e9
    assert new.kernel_time_s("conv_fwd", f, 0) == pytest.approx(2 * profile.kernel_time_s("conv_fwd", f, 0) + 1e-4)
    assert new.kernel_time_s("norm", f, 0) == pytest.approx(0.5 * profile.kernel_time_s("norm", f, 0) + 1e-4)
    assert profile.kernel_time_s("conv_fwd", f, 0) != new.kernel_time_s("conv_fwd", f, 0)  # a copy


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
