"""``benchmarks/bench_step_context.py``'s convolution timer: it must see every convolution's
forward and backward in a training step, with the exact-shape spec calibration would measure."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_step_context import ConvTimer, _calibrated_sums_s  # noqa: E402


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(4, 4, 3, stride=2, padding=1, bias=False))


def test_timer_sees_each_conv_forward_and_backward_with_its_spec():
    net = _net()
    timer = ConvTimer(net)
    x = torch.randn(2, 3, 8, 8)
    net(x).sum().backward()             # first call: specs only, nothing timed
    assert all(not v for v in timer.fwd.values()) and all(not v for v in timer.bwd.values())
    timer.on = True
    for _ in range(3):
        net.zero_grad()
        net(x).sum().backward()
    assert [len(v) for v in timer.fwd.values()] == [3, 3]
    assert [len(v) for v in timer.bwd.values()] == [3, 3]
    assert timer.specs[0] == {"op": "conv", "x": [2, 3, 8, 8], "w": [4, 3, 3, 3], "stride": [1, 1],
                              "padding": [1, 1], "dilation": [1, 1], "groups": 1}
    assert timer.specs[1]["x"] == [2, 4, 8, 8] and timer.specs[1]["stride"] == [2, 2]
    # the input needs no gradient at the first convolution, and does at the second
    assert timer.data_grad == {0: False, 1: True}
    f, b = timer.sums_s()
    assert f > 0 and b > 0
    timer.clear()
    assert all(not v for v in timer.fwd.values())


def test_calibrated_sums_skip_the_data_gradient_where_the_step_has_none(monkeypatch):
    import autopar.calibrate.kernels as kernels
    net = _net()
    timer = ConvTimer(net)
    net(torch.randn(2, 3, 8, 8))
    keys = [kernels.shape_key(timer.specs[i]) for i in (0, 1)]
    fixed = {keys[0]: {"fwd": 1.0, "bwd_data": 10.0, "bwd_filter": 100.0},
             keys[1]: {"fwd": 2.0, "bwd_data": 20.0, "bwd_filter": 200.0}}
    monkeypatch.setattr(kernels, "measure_exact", lambda specs, device, repeats: fixed)
    f, b = _calibrated_sums_s(timer)
    assert f == 3.0
    assert b == 100.0 + 20.0 + 200.0      # no data gradient at the first convolution
