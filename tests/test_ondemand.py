"""Missing shapes are measured in an explicit step before planning, never by planning itself.

``make_plan`` names the competitive local shapes a profile made on this machine lacks
(``PlanResult.missing_shapes``) and starts no process; ``calibrate.shapes_step`` (``autopar plan
--measure-shapes``) measures them into ``PROFILE-shapes.json`` and the plan made with that file
records it (path, sha256, entries). The time bound stops measuring and names what stays generic;
a corrupt shape file is rebuilt by the step with a warning and refused by planning by name;
another machine's profile or a simulated cluster is never measured."""

import json
import textwrap

import pytest

from autopar.artifacts import PlanHooks, PlanOptions
from autopar.calibrate.shapes_step import measure_missing_shapes
from autopar.errors import AutoparError
from autopar.io import sha256_file
from autopar.planner import make_plan
from autopar.profile.shapes import CACHE_SCHEMA, cache_path, can_measure, load_cache

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


def _options(prof, tmp_path, **kw):
    return PlanOptions(world_size=2, batch_size=4, calibration=str(prof), out_dir=str(tmp_path / "plan"), **kw)


def _plan(model, prof, tmp_path, **kw):
    lines = []
    return make_plan(model, _options(prof, tmp_path, **kw), PlanHooks(progress=lines.append)), lines


def test_planning_names_missing_shapes_and_starts_nothing(here_profile, tmp_path, monkeypatch):
    import autopar.runtime.launch as launch
    model = tmp_path / "tinycnn.py"
    model.write_text(MODEL)
    cache = cache_path(here_profile)
    cache.unlink(missing_ok=True)

    def no_ranks(*a, **k):
        raise AssertionError("planning started ranks")
    monkeypatch.setattr(launch, "run_ranks", no_ranks)
    r, lines = _plan(model, here_profile, tmp_path)
    assert r.missing_shapes and not cache.exists()
    assert any("--measure-shapes" in l and str(len(r.missing_shapes)) in l for l in lines), lines
    assert r.plan.calibration.shapes is None
    with pytest.raises(AutoparError, match="starts no process"):
        _plan(model, here_profile, tmp_path, measure_shapes=True)


def test_measure_step_then_plan_records_the_shape_file(here_profile, tmp_path):
    model = tmp_path / "tinycnn.py"
    model.write_text(MODEL)
    cache = cache_path(here_profile)
    cache.unlink(missing_ok=True)
    assert can_measure(__import__("autopar.profile.profile", fromlist=["x"]).load_profile(here_profile), 2) is None
    lines = []
    r0, _ = _plan(model, here_profile, tmp_path)
    assert r0.missing_shapes
    m = measure_missing_shapes(model, _options(here_profile, tmp_path), progress=lines.append)
    assert m.measured > 0 and not m.left_out and m.shapes_path == cache, (m, lines)
    exact, why = load_cache(cache, json.loads(here_profile.read_text())["fingerprint"])
    assert why is None and len(exact) == m.measured
    r, _ = _plan(model, here_profile, tmp_path, shapes=str(cache))
    rec = r.plan.calibration.shapes
    assert rec["path"] == str(cache) and rec["sha256"] == sha256_file(cache) and rec["entries"] == m.measured
    # what the first plan lacked is measured now (a measured shape may move the plan to other
    # candidates whose shapes the step's rounds left: timing-dependent, so not asserted)
    assert not set(r.missing_shapes) & set(r0.missing_shapes)
    assert any(l.source in ("exact", "mixed") for l in r.plan.layers if "conv" in l.kinds)
    # the step again: nothing new to measure; the same plan
    m2 = measure_missing_shapes(model, _options(here_profile, tmp_path), progress=lambda s: None)
    assert m2.measured == 0 and m2.shapes_path == cache
    r2, _ = _plan(model, here_profile, tmp_path, shapes=str(cache))
    assert r2.plan.predicted.step_time_s == pytest.approx(r.plan.predicted.step_time_s, rel=1e-9)
    # the default plan reads the profile alone, whatever lies beside it
    r3, _ = _plan(model, here_profile, tmp_path)
    assert r3.plan.calibration.shapes is None and r3.missing_shapes


def test_time_bound_names_shapes_left_generic(here_profile, tmp_path):
    model = tmp_path / "tinycnn2.py"
    model.write_text(MODEL.replace("12, 12", "10, 10"))
    cache_path(here_profile).unlink(missing_ok=True)
    lines = []
    m = measure_missing_shapes(model, _options(here_profile, tmp_path, measure_budget_s=1e-6), progress=lines.append)
    assert m.measured == 0 and m.left_out
    assert any("stay priced by the generic model" in l for l in lines), lines


def test_corrupt_shape_file_is_rebuilt_by_the_step_and_refused_by_planning(here_profile, tmp_path):
    model = tmp_path / "tinycnn3.py"
    model.write_text(MODEL.replace("12, 12", "9, 9"))
    cache = cache_path(here_profile)
    cache.write_text('{"schema": "' + CACHE_SCHEMA + '", "fingerprint": {}, "exact": {"k": {"fwd": -1}}')
    with pytest.raises(AutoparError, match="shape file .* is unreadable"):
        _plan(model, here_profile, tmp_path, shapes=str(cache))
    with pytest.warns(UserWarning, match="not trusted"):
        m = measure_missing_shapes(model, _options(here_profile, tmp_path), progress=lambda s: None)
    assert m.measured > 0
    exact, why = load_cache(cache, json.loads(here_profile.read_text())["fingerprint"])
    assert why is None and exact
    cache.write_text(json.dumps({"schema": CACHE_SCHEMA, "fingerprint": json.loads(here_profile.read_text())["fingerprint"],
                                 "exact": {"conv2d x=1": {"fwd": "fast"}}}))
    assert load_cache(cache, json.loads(here_profile.read_text())["fingerprint"])[1] == "corrupt entries"


def test_other_machine_or_simulated_cluster_not_measured(here_profile, root, tmp_path):
    from autopar.profile.profile import load_profile
    shipped = load_profile(root / "calibration/datasheet-a100-cluster.json", check_machine=False)
    assert can_measure(shipped, 8) is not None
    mine = load_profile(here_profile)
    assert "simulated" in can_measure(mine, 1024)
    m = measure_missing_shapes(root / "strategies/examples/resnet2d.py",
                               PlanOptions(world_size=8, calibration=str(root / "calibration/datasheet-a100-cluster.json"),
                                           write=False), progress=lambda s: None)
    assert m.shapes_path is None and m.measured == 0 and "datasheet" in m.not_measured_because


def test_cli_measures_shapes_first_only_when_asked(here_profile, tmp_path, capsys):
    from autopar.cli import main
    from autopar.artifacts import load_plan
    model = tmp_path / "tinycnn4.py"
    model.write_text(MODEL.replace("12, 12", "11, 11"))
    cache = cache_path(here_profile)
    cache.unlink(missing_ok=True)
    argv = ["plan", str(model), "--world-size", "2", "--batch-size", "4", "--calibration", str(here_profile)]
    assert main(argv + ["-o", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "nothing was measured" in out and "--measure-shapes" in out and not cache.exists()
    assert load_plan(tmp_path / "a/plan.json").calibration.shapes is None
    assert main(argv + ["-o", str(tmp_path / "b"), "--measure-shapes"]) == 0
    out = capsys.readouterr().out
    assert out.index("measuring missing shapes first (--measure-shapes)") < out.index("plan written to")
    rec = load_plan(tmp_path / "b/plan.json").calibration.shapes
    assert rec["path"] == str(cache) and rec["sha256"] == sha256_file(cache)
    assert "nothing was measured" not in out
