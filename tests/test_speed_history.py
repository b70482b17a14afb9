"""The machine's speed history (``autopar.profile.history``): readings kept per machine
instance, their median against a profile's nominal, and plans priced at it."""

import json
import textwrap
import warnings

import pytest
from fakes import synthetic_profile

from autopar.profile import history as H
from autopar.profile import current_fingerprint, save_profile

MODEL = textwrap.dedent("""
    import torch
    from torch import nn

    def build_model():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 5))

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 3, 8, 8),)
""")

NOMINAL_S = 0.005


def _here_profile(tmp_path, nominal_s=NOMINAL_S, fingerprint=None):
    """A synthetic profile that says it was measured on this machine (the fingerprint check of
    ``ondemand.can_measure``), with a speed-probe nominal."""
    p = synthetic_profile(ranks_per_node=2)
    p.fingerprint = fingerprint or current_fingerprint("gloo")
    p.provenance = {"kind": "measured", "notes": "test"}
    p.compute_slowdown = {"1": 1.0, "2": 1.0}
    p.samples = {"speed_probe": {"nominal_s": nominal_s, "readings_s": [nominal_s]}}
    path = tmp_path / "here.json"
    save_profile(p, path)
    return p, path


def test_usual_speed_needs_enough_readings_of_this_machine(tmp_path):
    hist = tmp_path / "h.json"
    prof, _ = _here_profile(tmp_path)
    for _ in range(H.MIN_EVENTS - 1):
        assert H.record(0.006, "execute", hist)
    got, why = H.usual_speed(prof, hist)
    assert got is None and f"fewer than {H.MIN_EVENTS}" in why
    # another machine's readings do not count
    obj = json.loads(hist.read_text())
    obj["events"] += [dict(H.event(0.5, "execute"), machine="elsewhere/boot")] * 10
    hist.write_text(json.dumps(obj))
    assert H.usual_speed(prof, hist)[0] is None
    H.record(0.008, "calibrate", hist)
    got, why = H.usual_speed(prof, hist)
    assert why == "" and got.events == H.MIN_EVENTS
    assert got.usual_probe_s == pytest.approx(0.006)          # the median of 4 x 6 ms and 8 ms
    # priced at the geometric mean of the usual reading and the profile's (USUAL_WEIGHT 0.5)
    assert H.USUAL_WEIGHT == 0.5
    assert got.factor == pytest.approx((0.006 / NOMINAL_S) ** 0.5)
    assert got.priced_at_s == pytest.approx((0.006 * NOMINAL_S) ** 0.5)
    js = got.to_json()
    assert js["speed_factor"] == pytest.approx(1.2 ** 0.5, abs=1e-4) and js["usual_weight"] == 0.5
    assert js["priced_at_s"] == pytest.approx(NOMINAL_S * 1.2 ** 0.5)


def test_window_keeps_the_last_hours(tmp_path):
    import datetime as dt
    hist = tmp_path / "h.json"
    prof, _ = _here_profile(tmp_path)
    old = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=H.WINDOW_HOURS + 1)
    events = [H.event(0.010, "execute", when=old) for _ in range(20)]
    hist.write_text(json.dumps({"schema": H.SCHEMA, "events": events}))
    assert H.usual_speed(prof, hist)[0] is None
    for _ in range(H.MIN_EVENTS):
        H.record(0.004, "execute", hist)
    got = H.usual_speed(prof, hist)[0]
    assert got.usual_probe_s == pytest.approx(0.004) and got.events == H.MIN_EVENTS


def test_profile_of_another_machine_or_without_probe_is_not_restated(tmp_path):
    hist = tmp_path / "h.json"
    for _ in range(H.MIN_EVENTS):
        H.record(0.006, "execute", hist)
    other = dict(current_fingerprint("gloo"), cpu_model="some other CPU")
    prof, _ = _here_profile(tmp_path, fingerprint=other)
    got, why = H.usual_speed(prof, hist)
    assert got is None and "another machine" in why
    prof, _ = _here_profile(tmp_path)
    prof.samples = {}
    got, why = H.usual_speed(prof, hist)
    assert got is None and "no speed-probe reading" in why


def test_off_and_corrupt_history(tmp_path, monkeypatch):
    monkeypatch.setenv(H.HISTORY_ENV, "off")
    assert H.history_path() is None and H.record(0.005, "execute") is False
    prof, _ = _here_profile(tmp_path)
    assert "off" in H.usual_speed(prof)[1]
    hist = tmp_path / "h.json"
    monkeypatch.setenv(H.HISTORY_ENV, str(hist))
    assert H.history_path() == hist
    hist.write_text("{not json")
    with pytest.warns(UserWarning, match="set aside"):
        assert H.record(0.005, "execute") is True
    assert (tmp_path / "h.json.corrupt").exists()
    assert len(json.loads(hist.read_text())["events"]) == 1       # started anew
    hist.write_text(json.dumps({"schema": H.SCHEMA, "events": [dict(H.event(0.005, "x"), probe_s=-1)]}))
    with pytest.warns(UserWarning, match="unreadable"):
        assert H.usual_speed(prof, hist)[0] is None
    assert H.record(None, "execute", hist) is False            # no reading, nothing written


def test_plan_prices_local_compute_between_the_usual_and_the_profiles_speed(tmp_path, monkeypatch):
    """A world-1 plan is all local compute: with a history reading 2.25x the profile's nominal
    its predicted step is 1.5x the one priced as measured (the geometric mean of the two
    readings, ``USUAL_WEIGHT`` 0.5), and plan.json says so."""
    from autopar.artifacts import PlanOptions
    from autopar.planner import make_plan
    model = tmp_path / "tiny.py"
    model.write_text(MODEL)
    _, prof_path = _here_profile(tmp_path)
    hist = tmp_path / "h.json"
    for _ in range(H.MIN_EVENTS):
        H.record(2.25 * NOMINAL_S, "execute", hist)
    monkeypatch.setenv(H.HISTORY_ENV, str(hist))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        on = make_plan(model, PlanOptions(world_size=1, batch_size=4, calibration=str(prof_path),
                                          out_dir=str(tmp_path / "on"), speed_history=True))
        off = make_plan(model, PlanOptions(world_size=1, batch_size=4, calibration=str(prof_path),
                                           out_dir=str(tmp_path / "off")))
    assert on.plan.predicted.step_time_s == pytest.approx(1.5 * off.plan.predicted.step_time_s, rel=1e-9)
    ms = json.loads((tmp_path / "on" / "plan.json").read_text())["calibration"]["machine_speed"]
    assert ms["speed_factor"] == pytest.approx(1.5) and ms["events"] == H.MIN_EVENTS
    assert ms["priced_at_s"] == pytest.approx(1.5 * NOMINAL_S) and ms["usual_probe_s"] == pytest.approx(2.25 * NOMINAL_S)
    ms_off = json.loads((tmp_path / "off" / "plan.json").read_text())["calibration"]["machine_speed"]
    assert ms_off["speed_factor"] == 1.0 and "--speed-history opts in" in ms_off["not_applied"]


def test_default_plan_ignores_the_history(tmp_path, monkeypatch, capsys):
    """Reproducible defaults: a history saying this machine runs 2x slower than the profile
    changes neither ``make_plan``'s default nor ``autopar plan``'s prediction against the
    history off; ``autopar plan --speed-history`` applies it, and ``--no-speed-history`` (now
    the default) is accepted with a warning."""
    from autopar.artifacts import PlanOptions
    from autopar.cli import main
    from autopar.planner import make_plan
    model = tmp_path / "tiny.py"
    model.write_text(MODEL)
    _, prof_path = _here_profile(tmp_path)
    hist = tmp_path / "slow.json"
    for _ in range(2 * H.MIN_EVENTS):
        H.record(2.0 * NOMINAL_S, "execute", hist)
    steps = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for env in (str(hist), "off"):
            monkeypatch.setenv(H.HISTORY_ENV, env)
            r = make_plan(model, PlanOptions(world_size=1, batch_size=4, calibration=str(prof_path),
                                             out_dir=str(tmp_path / f"api-{len(steps)}")))
            assert r.plan.calibration.speed_factor == 1.0
            assert main(["plan", str(model), "--world-size", "1", "--batch-size", "4",
                         "--calibration", str(prof_path), "-o", str(tmp_path / f"cli-{len(steps)}")]) == 0
            cli = json.loads((tmp_path / f"cli-{len(steps)}" / "plan.json").read_text())
            steps[env] = (r.plan.predicted.step_time_s, cli["predicted"]["step_time_s"])
        assert steps[str(hist)] == steps["off"]            # bit-identical, API and CLI
        monkeypatch.setenv(H.HISTORY_ENV, str(hist))
        assert main(["plan", str(model), "--world-size", "1", "--batch-size", "4", "--speed-history",
                     "--calibration", str(prof_path), "-o", str(tmp_path / "opt-in")]) == 0
    opt_in = json.loads((tmp_path / "opt-in" / "plan.json").read_text())
    assert opt_in["calibration"]["machine_speed"]["speed_factor"] == pytest.approx(2.0 ** H.USUAL_WEIGHT, abs=1e-4)
    assert opt_in["predicted"]["step_time_s"] == pytest.approx(2.0 ** H.USUAL_WEIGHT * steps["off"][1], rel=1e-9)
    with pytest.warns(FutureWarning, match="--no-speed-history is the default"):
        assert main(["plan", str(model), "--world-size", "1", "--batch-size", "4",
                     "--no-speed-history", "--calibration", str(prof_path), "-o", str(tmp_path / "alias")]) == 0
    alias = json.loads((tmp_path / "alias" / "plan.json").read_text())
    assert alias["predicted"]["step_time_s"] == steps["off"][1]


def test_history_location_is_not_part_of_the_trace_key(tmp_path, monkeypatch):
    from autopar.trace import cache
    model = tmp_path / "tiny.py"
    model.write_text(MODEL)
    keys = []
    for v in ("off", str(tmp_path / "h.json")):
        monkeypatch.setenv(H.HISTORY_ENV, v)
        keys.append(cache.trace_key(model, 4))
    assert keys[0] == keys[1]
