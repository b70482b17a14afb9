"""A float64 validation of a model that computes in float32 inside (Hugging Face's
``LlamaRMSNorm`` casts to float32 and back) is held to float32 tolerances, and says so."""

import torch
from torch import nn

from autopar.execute.validate import (DEFAULT_TOL, Float32Inside, compare, effective_tolerances,
                                      precision_note)


class CastingNorm(nn.Module):
    """RMS norm as LlamaRMSNorm writes it: float32 inside, the input's dtype out."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(dt)


class PlainNorm(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _net(norm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), norm, nn.Linear(16, 4)).double()


def test_detector_sees_the_float32_cast_and_names_the_module():
    m = _net(CastingNorm(16))
    with Float32Inside(m) as d:
        m(torch.randn(3, 16, dtype=torch.float64)).sum().backward()
    assert d.modules == ["CastingNorm"]
    assert precision_note(d.modules) == "the model computes in float32 inside (CastingNorm): float32 tolerances"
    assert effective_tolerances("float64", *DEFAULT_TOL["float64"], d.modules) == DEFAULT_TOL["float32"]


def test_detector_quiet_on_a_pure_float64_model_and_float_method():
    m = _net(PlainNorm())
    with Float32Inside(m) as d:
        m(torch.randn(3, 16, dtype=torch.float64))
    assert d.modules == []
    assert effective_tolerances("float64", *DEFAULT_TOL["float64"], d.modules) == DEFAULT_TOL["float64"]
    # .float() counts as well; a float32 run is left at its own tolerances
    with Float32Inside(m) as d:
        torch.randn(2, dtype=torch.float64).float()
    assert d.modules == ["the model"]
    assert effective_tolerances("float32", 1e-3, 1e-6, ["x"]) == (1e-3, 1e-6)
    # hooks removed: a later forward is not recorded
    m(torch.randn(3, 16, dtype=torch.float64).to(torch.float32).double())
    assert d.modules == ["the model"]


def test_float32_rounding_inside_fails_float64_tolerances_and_passes_the_float32_ones():
    """A float64 difference far below float32's rounding before the casting norm (a plan's
    changed summation order) comes out as float32 rounding: over float64's tolerances, within
    the float32 ones that the detector gives the validation."""
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(64, 64), CastingNorm(64), nn.Linear(64, 4)).double()
    x = torch.randn(256, 64, dtype=torch.float64)
    ref = m(x)
    h = m[0](x) * (1 + 1e-11)
    got = m[2](m[1](h))
    with Float32Inside(m) as d:
        m(x)
    rt, at = DEFAULT_TOL["float64"]
    assert not compare("output", got, ref, rt, at).passed
    assert compare("output", got, ref, *effective_tolerances("float64", rt, at, d.modules)).passed
