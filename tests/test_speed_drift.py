"""The prediction benchmark's speed diagnostic (``bench_prediction.at_profile_speed``) and the
across-runs analysis (``benchmarks/speed_drift_across_runs.py``): pure arithmetic on recorded
figures, checked on hand-made ones."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_prediction import at_profile_speed, plan_rows  # noqa: E402
from speed_drift_across_runs import analyse, load_runs, ordinal  # noqa: E402


def test_each_round_is_divided_by_its_own_probe_ratio():
    row = {"measured_rounds_s": [0.010, 0.012, 0.020], "speed_probe_vs_profile_rounds": [1.0, 1.2, 2.0]}
    assert at_profile_speed(row) == pytest.approx(0.010)
    # one round without its reading: no figure rather than a mixed one
    assert at_profile_speed({**row, "speed_probe_vs_profile_rounds": [1.0, None, 2.0]}) is None
    assert at_profile_speed({**row, "speed_probe_vs_profile_rounds": [1.0, 2.0]}) is None
    assert at_profile_speed({"measured_rounds_s": []}) is None


def test_plan_rows_keep_what_recomputes_the_figures_and_nothing_bulky():
    row = {"label": "x", "world": 2, "predicted_s": 1.0, "measured_s": 1.1, "measured_rounds_s": [1.1],
           "speed_probe_vs_profile_rounds": [1.0], "run": {"huge": "run.json"}, "plan": "/tmp/p.json"}
    kept = plan_rows([row])[0]
    assert "run" not in kept and "plan" not in kept
    assert kept["predicted_s"] == 1.0 and kept["measured_rounds_s"] == [1.1]
    json.dumps(kept)


def test_ordinals_of_the_run_files():
    assert [ordinal(w) for w in ("third", "nineteenth", "twentieth", "twenty-eighth", "thirty-first")] == \
        [3, 19, 20, 28, 31]
    assert ordinal("twenty-twentieth") is None and ordinal("previous") is None


def _run(signed: float, probe: float, after_cal: float) -> dict:
    s = {"by_world": {"2": {"median_signed_error": signed}, "4": {"median_signed_error": signed}},
         "speed_probe_vs_profile": probe, "machine_vs_profile": 1.0}
    return {"machine_reference_ms": {"after calibration": after_cal}, "in_sample": s, "held_out": s}


def test_a_miss_that_is_only_the_machines_speed_vanishes_at_the_probe():
    # each run's prediction is exact at the calibration's speed; the machine then ran `probe`
    # times slower, so the measured time is probe x predicted and the signed error 1/probe - 1
    probes = [0.8, 0.9, 1.0, 1.1, 1.25, 1.4]
    runs = [(i + 1, str(i + 1), _run(1 / p - 1, p, 10.0)) for i, p in enumerate(probes)]
    lines, out = analyse(runs)
    assert out["sets"] == 12
    assert out["correlation"] < -0.95 and out["slope"] < 0
    assert out["median_abs_signed_at_probe"] == pytest.approx(0.0, abs=1e-12)
    assert out["median_abs_signed"] > 0.05
    # the same calibration speed every time: the history changes nothing
    assert out["median_abs_signed_history"] == pytest.approx(out["median_abs_signed_same_sets"])
    assert any("correlation" in line for line in lines)


def test_the_committed_runs_are_found_in_order():
    runs = load_runs()
    assert runs, "no prediction run JSON under reports/benchmarks"
    numbers = [n for n, _, _ in runs]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)


def test_the_profile_figures_that_move_every_prediction_are_kept(tmp_path):
    from bench_prediction import profile_figures
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"samples": {"speed_probe": {"nominal_s": 0.005},
                                         "straggler_sigma": {"2": 0.01}, "straggler_kappa": {"2": 0.1},
                                         "insitu_latency_by_world_s": {"2": {"2": 0.003}},
                                         "compute_slowdown_measured": {"2": 1.05}}}))
    f = profile_figures(str(p))
    assert f["speed_probe_nominal_s"] == 0.005 and f["straggler_sigma"] == {"2": 0.01}
    assert f["insitu_latency_2_s"] == 0.003 and f["insitu_latency_4_s"] is None
    p.write_text("{not json")
    assert profile_figures(str(p)) == {} and profile_figures(str(tmp_path / "absent.json")) == {}
