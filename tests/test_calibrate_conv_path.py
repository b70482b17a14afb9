"""The shape-aware convolution model tells torch's two CPU convolution paths apart
(``profile.features.conv_cpu_path``, ``conv_shape/2``) and still prices ``conv_shape/1``
profiles as before."""

from __future__ import annotations

import numpy as np
import pytest

from autopar.profile.fit import MIN_NATIVE_ROWS, fit_conv_shape
from autopar.calibrate.kernels import sweep_configs
from autopar.profile.features import CONV_SHAPE_FORM, conv_cpu_path, conv_native_features, conv_shape_features


def _conv(n, c, f, k, sp, dim=2, stride=1, groups=1):
    return {"op": "conv", "x": [n, c] + [sp] * dim, "w": [f, c // groups] + [k] * dim,
            "stride": [stride] * dim, "padding": [k // 2] * dim, "dilation": [1] * dim, "groups": groups}


CASES = [
    (_conv(1, 1, 6, 3, 32), "native"),            # one small sample
    (_conv(1, 24, 24, 3, 32), "mkldnn"),          # one sample, N*C*H*W > 20480
    (_conv(2, 1, 6, 3, 32), "mkldnn"),            # two samples
    (_conv(8, 16, 32, 1, 16), "native"),          # 1x1 below 16 samples, one thread
    (_conv(16, 16, 32, 1, 16), "mkldnn"),         # 1x1 at 16 samples
    (_conv(4, 16, 32, 1, 16, stride=2), "mkldnn"),  # strided 1x1
    (_conv(1, 8, 8, 5, 16), "mkldnn"),            # 5x5 kernel
    (_conv(1, 8, 8, 3, 16, groups=2), "mkldnn"),  # grouped
    (_conv(1, 6, 12, 3, 20, dim=3), "native"),    # 3-D, one sample (held-out 3-D CNN at 4 ranks)
    (_conv(1, 64, 64, 3, 20, dim=3), "mkldnn"),   # 1 * 64 * 20 * 20 > 20480
    (_conv(2, 6, 12, 3, 20, dim=3), "mkldnn"),
]


@pytest.mark.parametrize("spec,path", CASES)
def test_conv_cpu_path_rule(spec, path):
    assert conv_cpu_path(spec) == path


def test_conv_cpu_path_matches_what_torch_runs():
    """The rule against the kernel torch's profiler sees, one thread (the runtime's setting)."""
    torch = pytest.importorskip("torch")
    from torch.profiler import profile
    if "mkldnn" not in torch.backends.__dict__ or not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for spec, path in CASES:
            x = torch.randn(*spec["x"])
            w = torch.randn(*spec["w"])
            conv = torch.nn.functional.conv3d if len(spec["x"]) == 5 else torch.nn.functional.conv2d
            with profile() as p:
                conv(x, w, stride=spec["stride"], padding=spec["padding"], groups=spec["groups"])
            names = {e.key for e in p.key_averages()}
            ran = "mkldnn" if "aten::mkldnn_convolution" in names else "native"
            assert ran == path, (spec, names)
    finally:
        torch.set_num_threads(threads)


def test_conv_shape_2_fits_the_two_paths_apart_and_conv_shape_1_still_prices():
    from fakes import synthetic_profile
    specs = sweep_configs("conv_fwd", 120, 5e8, 1 << 22)
    nat = [conv_cpu_path(s) == "native" for s in specs]
    assert sum(nat) >= MIN_NATIVE_ROWS and sum(not v for v in nat) >= MIN_NATIVE_ROWS
    true_main = np.array([1e-5, 1e-10, 1e-10, 3e-9, 0, 1e-9, 0, 0, 0])
    true_nat = np.array([2e-5, 5e-10, 4e-9, 0, 1e-9])      # several times slower per FLOP
    t = [float(np.dot(true_nat, conv_native_features(s))) if n else float(np.dot(true_main, conv_shape_features(s)))
         for s, n in zip(specs, nat)]
    m = fit_conv_shape(specs, t)
    assert m["form"] == CONV_SHAPE_FORM and m["native"] is not None
    assert m["heldout_median_rel_err"] < 1e-3
    one = fit_conv_shape(specs, t, split_paths=False)          # one model: cannot fit both
    assert one["native"] is None and one["heldout_median_rel_err"] > 10 * m["heldout_median_rel_err"]
    prof = synthetic_profile()
    prof.kernels["conv_fwd"]["shape_model"] = m
    for s, tt in list(zip(specs, t))[:20]:
        assert prof.kernel_time_s("conv_fwd", 0.0, 0.0, spec=s) == pytest.approx(tt, rel=1e-3)
    # a profile of the first form: its nine coefficients over conv_shape_features, every path
    old = {"form": "conv_shape/1", "coef": list(true_main)}
    prof.kernels["conv_fwd"]["shape_model"] = old
    for s in specs[:20]:
        assert prof.kernel_time_s("conv_fwd", 0.0, 0.0, spec=s) == pytest.approx(
            float(np.dot(true_main, conv_shape_features(s))))


def test_report_names_the_form_and_the_native_path_sub_model():
    from autopar.calibrate.report import report_markdown
    from fakes import synthetic_profile
    prof = synthetic_profile()
    prof.kernels["conv_fwd"]["shape_model"] = {
        "form": CONV_SHAPE_FORM, "coef": [0.0] * 9, "heldout_median_rel_err": 0.12,
        "heldout_max_rel_err": 0.5, "n_samples": 160, "flat_heldout_median_rel_err": 0.21,
        "native": {"coef": [0.0] * 5, "n_samples": 40, "heldout_median_rel_err": 0.2}}
    prof.kernels["conv_bwd_data"]["shape_model"] = {
        "form": "conv_shape/1", "coef": [0.0] * 9, "heldout_median_rel_err": 0.2, "n_samples": 64}
    md = report_markdown(prof, "p", [])
    assert f"| conv_fwd | 12% | 50% | 21% | 160 | {CONV_SHAPE_FORM} | 20% of 40 |" in md
    assert "| conv_shape/1 | one model |" in md


def test_conv_shape_3_adds_layout_terms_and_earlier_forms_price_as_before():
    """``conv_shape/3`` (``profile.features.conv_layout_features``): channel counts off the vector block,
    strides and tensors past the caches each add a term; a profile of ``conv_shape/2`` keeps
    its nine coefficients over ``conv_shape_features``."""
    from autopar.profile.features import (CONV_CHANNEL_BLOCK, conv_layout_features, conv_model_features,
                                          conv_model_time_s)
    aligned = {"op": "conv", "x": [8, 32, 16, 16], "w": [64, 32, 3, 3], "padding": [1, 1]}
    odd = {"op": "conv", "x": [8, 20, 16, 16], "w": [40, 20, 3, 3], "padding": [1, 1]}
    strided = dict(aligned, stride=[2, 2])
    big = {"op": "conv", "x": [16, 64, 64, 64], "w": [64, 64, 1, 1]}
    assert 32 % CONV_CHANNEL_BLOCK == 0 and 20 % CONV_CHANNEL_BLOCK != 0
    assert conv_layout_features(aligned) == [0.0] * 5
    lay = conv_layout_features(odd)
    assert lay[0] > 0 and lay[1] > 0 and lay[2:] == [0.0] * 3
    assert conv_layout_features(strided)[2] > 0
    assert conv_layout_features(big)[3] == 16 * 64 * 64 * 64 and conv_layout_features(big)[4] == 16 * 64 * 64 * 64
    assert len(conv_model_features(odd)) == len(conv_shape_features(odd)) + 5 == 14
    assert conv_model_features(odd, "conv_shape/2") == conv_shape_features(odd)
    coef = [1e-5, 1e-10, 0, 0, 0, 0, 0, 0, 0]
    two = {"form": "conv_shape/2", "coef": coef, "native": None}
    three = {"form": CONV_SHAPE_FORM, "coef": coef + [1e-10, 0, 0, 0, 0], "native": None}
    assert conv_model_time_s(two, odd) == pytest.approx(float(np.dot(coef, conv_shape_features(odd))))
    assert conv_model_time_s(three, odd) > conv_model_time_s(two, odd)          # C/g = 20: off the block
    assert conv_model_time_s(three, aligned) == pytest.approx(conv_model_time_s(two, aligned))
