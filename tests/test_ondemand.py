"""Exact shapes on demand (``calibrate.ondemand``): a model never measured gets the local shapes
of its competitive candidates measured by ``autopar plan`` into a cache beside the profile;
the time bound stops measuring and names what stays generic; a corrupt cache is rebuilt with
a warning; another machine's profile or a simulated cluster is never measured."""

import json
import textwrap

import pytest

from autopar.artifacts import PlanOptions
from autopar.calibrate.ondemand import CACHE_SCHEMA, cache_path, can_measure, load_cache
from autopar.pipeline import make_plan

pytestmark = pytest.mark.dist

MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    def build_model():
        return nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), nn.ReLU(), nn.Conv2d(12, 20, 3, padding=1),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(20, 5))

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 3, 12, 12),)
""")


@pytest.fixture(scope="module")
def here_profile(tmp_path_factory):
    """A tiny profile measured on this machine at world 2, without exact shapes."""
    import dataclasses

    from autopar.calibrate.run import TINY, calibrate
    d = tmp_path_factory.mktemp("prof")
    out = d / "here.json"
    calibrate(quick=True, world_size=2, backend="gloo", out=out, progress=lambda s: None,
              sweep=dataclasses.replace(TINY, slowdown_window_s=1.0), command="pytest")
    return out


def _plan(model, prof, tmp_path, **kw):
    lines = []
    from autopar.artifacts import PlanHooks
    r = make_plan(model, PlanOptions(world_size=2, batch_size=4, calibration=str(prof),
                                     out_dir=str(tmp_path / "plan"), measure_shapes=True, **kw),
                  PlanHooks(progress=lines.append))
    return r, lines


def test_new_model_measured_once_and_cached(here_profile, tmp_path):
    model = tmp_path / "tinycnn.py"
    model.write_text(MODEL)
    cache = cache_path(here_profile)
    cache.unlink(missing_ok=True)
    assert can_measure(__import__("autopar.profile", fromlist=["x"]).load_profile(here_profile), 2) is None
    r, lines = _plan(model, here_profile, tmp_path)
    info = r.plan.calibration["shapes_on_demand"]
    assert info["measured"] > 0 and not info["left_out"], lines
    assert any("re-planning" in l for l in lines)
    assert any(l.source in ("exact", "mixed") for l in r.plan.layers if "conv" in l.kinds)
    exact, why = load_cache(cache, json.loads(here_profile.read_text())["fingerprint"])
    assert why is None and len(exact) == info["measured"]
    # re-planning: nothing new to measure
    r2, lines2 = _plan(model, here_profile, tmp_path)
    assert r2.plan.calibration["shapes_on_demand"]["measured"] == 0
    assert not any("re-planning" in l for l in lines2)
    assert r2.plan.predicted.step_time_s == pytest.approx(r.plan.predicted.step_time_s, rel=1e-9)


def test_time_bound_names_shapes_left_generic(here_profile, tmp_path):
    model = tmp_path / "tinycnn2.py"
    model.write_text(MODEL.replace("12, 12", "10, 10"))
    cache_path(here_profile).unlink(missing_ok=True)
    r, lines = _plan(model, here_profile, tmp_path, measure_budget_s=1e-6)
    info = r.plan.calibration["shapes_on_demand"]
    assert info["measured"] == 0 and info["left_out"]
    assert any("stay priced by the generic model" in l for l in lines), lines


def test_corrupt_cache_is_rebuilt_with_a_warning(here_profile, tmp_path):
    model = tmp_path / "tinycnn3.py"
    model.write_text(MODEL.replace("12, 12", "9, 9"))
    cache = cache_path(here_profile)
    cache.write_text('{"schema": "' + CACHE_SCHEMA + '", "fingerprint": {}, "exact": {"k": {"fwd": -1}}')
    with pytest.warns(UserWarning, match="not trusted"):
        r, _ = _plan(model, here_profile, tmp_path)
    assert r.plan.calibration["shapes_on_demand"]["measured"] > 0
    exact, why = load_cache(cache, json.loads(here_profile.read_text())["fingerprint"])
    assert why is None and exact
    cache.write_text(json.dumps({"schema": CACHE_SCHEMA, "fingerprint": json.loads(here_profile.read_text())["fingerprint"],
                                 "exact": {"conv2d x=1": {"fwd": "fast"}}}))
    assert load_cache(cache, json.loads(here_profile.read_text())["fingerprint"])[1] == "corrupt entries"


def test_other_machine_or_simulated_cluster_not_measured(here_profile, root):
    from autopar.profile import load_profile
    shipped = load_profile(root / "calibration/datasheet-a100-cluster.json", check_machine=False)
    assert can_measure(shipped, 8) is not None
    mine = load_profile(here_profile)
    assert "simulated" in can_measure(mine, 1024)
