"""The machine-speed probe of calibration (``calibrate.speed``): which reading a measurement
gets, how times are stated at the nominal speed, and that calibration and later additions to a
profile use it."""

import json
import statistics

import pytest

from autopar.calibrate import speed


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_track_reads_every_interval_and_averages_the_readings_near_each_measurement():
    clock, reads = _Clock(), iter([1.0, 2.0, 4.0, 8.0, 16.0])
    track = speed.SpeedTrack(interval_s=0.5, smooth_s=1.0, read=lambda: next(reads), clock=clock)
    a = track.segment()              # first reading (1.0, at 0) before the first measurement
    clock.t = 0.2
    b = track.segment()              # 0.2 s later: same stretch
    clock.t = 0.7
    c = track.segment()              # 0.7 s: a new reading (2.0)
    clock.t = 3.0
    d = track.segment()              # a new reading (4.0, at 3.0)
    clock.t = 3.2
    track.close()                    # the reading after the last stretch (8.0, at 3.2)
    assert (a, b, c, d) == (0, 0, 1, 2)
    assert track.readings_s == [1.0, 2.0, 4.0, 8.0]
    assert track.at_s == [0.0, 0.7, 3.0, 3.2]
    # the readings within 1 s of the stretch's middle
    assert track.probe_s(a) == pytest.approx(1.5)            # middle 0.35: readings at 0, 0.7
    assert track.probe_s(d) == pytest.approx(6.0)            # middle 3.1: readings at 3.0, 3.2
    assert track.probe_s(c) == pytest.approx(3.0)            # middle 1.85: none within 1 s -> the two around it
    wide = speed.SpeedTrack(read=lambda: 1.0, smooth_s=10.0)
    wide.readings_s, wide.at_s = [1.0, 2.0, 4.0, 8.0], [0.0, 0.7, 3.0, 3.2]
    assert wide.probe_s(0) == pytest.approx(3.75)            # all four within 10 s


def test_rows_are_stated_at_the_nominal_speed_and_keep_their_raw_times():
    rows = [{"median_s": 2.0, "bwd_median_s": 4.0, "probe_s": 0.010},   # slow phase
            {"median_s": 1.0, "probe_s": 0.005},                        # fast phase
            {"median_s": 3.0}]                                          # no reading: as measured
    speed.normalize_rows(rows, 0.008)
    assert rows[0]["median_s"] == pytest.approx(1.6) and rows[0]["raw_median_s"] == 2.0
    assert rows[0]["bwd_median_s"] == pytest.approx(3.2) and rows[0]["raw_bwd_median_s"] == 4.0
    assert rows[1]["median_s"] == pytest.approx(1.6)
    assert rows[2] == {"median_s": 3.0}
    # a second normalisation (another nominal) starts from the raw time, not the stated one
    speed.normalize_rows(rows, 0.010)
    assert rows[0]["median_s"] == pytest.approx(2.0)
    # no nominal: nothing changes
    before = json.dumps(rows)
    speed.normalize_rows(rows, None)
    assert json.dumps(rows) == before


def test_exact_entries_are_stated_at_the_nominal_speed():
    exact = {"a": {"fwd": 1.0, "bwd_data": 2.0}, "b": {"fwd": 1.0}}
    out = speed.normalize_exact(exact, {"a": 0.02, "b": None}, 0.01)
    assert out["a"] == {"fwd": pytest.approx(0.5), "bwd_data": pytest.approx(1.0)}
    assert out["b"] == {"fwd": 1.0}
    assert speed.normalize_exact(exact, {"a": 0.02}, None) is exact


def test_speed_entry_and_profile_nominal():
    e = speed.speed_entry([0.004, 0.005, 0.006, 0.0])
    assert e["nominal_s"] == pytest.approx(0.005)
    assert e["spread"] == pytest.approx(0.5)
    assert e["readings_s"] == [0.004, 0.005, 0.006]

    class P:
        samples = {"speed_probe": e}
    assert speed.profile_nominal_s(P()) == pytest.approx(0.005)
    P.samples = {}
    assert speed.profile_nominal_s(P()) is None


def test_the_stored_nominal_is_the_median_of_the_stored_readings():
    # readings are stored to 6 significant digits; the nominal must be recomputable from them
    # exactly (CI once failed when the nominal came from the unrounded readings: 1.4e-6 apart)
    e = speed.speed_entry([0.0025771034997, 0.00301234567, 0.0020000012345])
    assert e["nominal_s"] == statistics.median(e["readings_s"])


def test_a_real_reading_is_a_positive_time():
    t = speed.probe_reading_s(repeats=1)
    assert 0 < t < 5.0


def test_execute_reports_the_probe_against_the_profile_nominal():
    from autopar.artifacts import CalibrationRef
    from autopar.execute.runner import speed_note

    class Plan:
        calibration = CalibrationRef.from_json({"speed_probe_nominal_s": 0.004})
    note = speed_note(Plan(), 0.005)["speed_probe"]
    assert note == {"execute_s": 0.005, "profile_nominal_s": 0.004,
                    "slowdown_vs_calibration": pytest.approx(1.25),
                    "priced_at_s": 0.004, "slowdown_vs_pricing": pytest.approx(1.25)}
    # a plan priced at the machine's usual speed (its speed history): the ratio to that too
    Plan.calibration = CalibrationRef.from_json({"speed_probe_nominal_s": 0.004, "machine_speed": {"usual_probe_s": 0.005}})
    note = speed_note(Plan(), 0.005)["speed_probe"]
    assert note["slowdown_vs_calibration"] == pytest.approx(1.25) and note["slowdown_vs_pricing"] == pytest.approx(1.0)
    # a plan priced between the two readings (USUAL_WEIGHT): the ratio to the reading it records
    Plan.calibration = CalibrationRef.from_json({"speed_probe_nominal_s": 0.004,
                                                 "machine_speed": {"usual_probe_s": 0.005, "priced_at_s": 0.0045}})
    note = speed_note(Plan(), 0.005)["speed_probe"]
    assert note["priced_at_s"] == 0.0045 and note["slowdown_vs_pricing"] == pytest.approx(0.005 / 0.0045)
    Plan.calibration = CalibrationRef.from_json({"speed_probe_nominal_s": 0.004})
    assert speed_note(Plan(), None) == {}
    Plan.calibration = CalibrationRef.from_json({})   # a profile made before the probe: nothing to compare
    assert speed_note(Plan(), 0.005) == {}


def test_as_measured_restores_the_raw_times():
    from autopar.profile import Profile
    prof = Profile(schema=1, fingerprint={}, provenance={}, topology={}, kernels={}, collectives={},
                   exact={"conv a": {"fwd": 0.5}, "op b": {"fwd": 0.25}},
                   samples={"kernels": {"matmul": [{"median_s": 2.0, "probe_s": 0.02}]},
                            "exact": {"conv a": {"fwd": [1.0, 1.2, 0.9], "probe_s": 0.02}},
                            "exact_ops": {"op b": {"raw": {"fwd": 0.5}, "probe_s": 0.02}}})
    speed.normalize_rows(prof.samples["kernels"]["matmul"], 0.01)
    assert prof.samples["kernels"]["matmul"][0]["median_s"] == pytest.approx(1.0)
    speed.as_measured(prof)
    assert prof.samples["kernels"]["matmul"][0] == {"median_s": 2.0}
    assert prof.exact == {"conv a": {"fwd": 1.0}, "op b": {"fwd": 0.5}}


def test_marked_measurements_get_their_stretch_probe():
    clock, reads = _Clock(), iter([1.0, 3.0, 5.0])
    track = speed.SpeedTrack(interval_s=0.5, smooth_s=0.1, read=lambda: next(reads), clock=clock)
    track.mark("a")                  # reading 1.0 at 0
    clock.t = 1.0
    track.mark("b")                  # reading 3.0 at 1.0
    clock.t = 2.0
    track.close()                    # reading 5.0 at 2.0
    assert track.probes() == {"a": pytest.approx(2.0), "b": pytest.approx(4.0)}


def test_the_report_states_the_prediction_at_the_speed_the_probe_read():
    from types import SimpleNamespace

    from autopar.report.report import _at_run_speed
    run = SimpleNamespace(measured=SimpleNamespace(step_time_s=0.012), predicted=SimpleNamespace(step_time_s=0.010))
    line = _at_run_speed(run, {"slowdown_vs_calibration": 1.2})
    # 10 ms predicted at the profile's speed is 12 ms at a machine 1.2x slower: the miss was the machine
    assert "12.00 ms" in line and "error +0.0%" in line and "diagnostic" in line
    # a plan priced at the machine's usual speed is restated from that speed, not the profile's
    line = _at_run_speed(run, {"slowdown_vs_calibration": 1.5, "slowdown_vs_pricing": 1.2})
    assert "12.00 ms" in line
    run.measured.step_time_s = 0.0
    assert _at_run_speed(run, {"slowdown_vs_calibration": 1.2}) == ""
