"""The prediction benchmark's pure parts: its speed diagnostic (``bench_prediction.at_profile_speed``),
the per-plan rows it keeps, the profile figures it records, and which models each set holds
(the held-out set is only models that no other set or benchmark uses)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_prediction import at_profile_speed, plan_rows  # noqa: E402


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


def test_the_held_out_set_is_only_models_no_other_set_uses():
    import bench_prediction as bp
    held = {Path(c[1]) for c in bp.HELDOUT}
    assert held and all(p.parent == bp.MODELS / "heldout" and p.is_file() for p in held)
    others = {Path(c[1]) for c in bp.CANDIDATES + bp.DEV}
    assert not held & others
    # every model file of the held-out folder is in the set, so none is left out quietly
    assert held == set((bp.MODELS / "heldout").glob("*.py"))
    # nothing else in the repository's benchmarks imports or names them
    bench = Path(bp.__file__).parent
    for f in bench.glob("*.py"):
        if f.name != "bench_prediction.py":
            assert "models/heldout" not in f.read_text() and "heldout/" not in f.read_text(), f


def test_set_selection():
    import bench_prediction as bp
    assert bp.sets_for("both") == bp.sets_for("default") == ("in_sample", "dev")
    assert bp.sets_for("held-out") == ("held_out",)
    assert bp.sets_for("all") == ("in_sample", "dev", "held_out")
    assert bp.sets_for("dev") == ("dev",) and bp.sets_for("in-sample") == ("in_sample",)
