"""benchmarks/cross_reprice.py's what-ifs restate copies of profiles; the runs' files stay as
they were. Only the pure restating is tested here (crossing prices kept runs, minutes)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import cross_reprice  # noqa: E402


def _samples(lat2: float, sigma2: float) -> dict:
    return {"straggler_kappa": {"2": 0.05, "4": 0.3}, "straggler_sigma": {"2": sigma2, "4": 0.06},
            "comm_interference": {"2": 0.8, "4": 1.0},
            "insitu_latency_by_world_s": {"2": {"2": lat2}, "4": {"2": 0.0027, "4": 0.0070}},
            "insitu_latency_s": {"2": lat2, "4": 0.0070},
            "insitu_latency_by_kind_s": {"all_to_all": {"2": {"2": lat2 / 4}, "4": {"4": 0.0025}},
                                         "p2p": {"2": {"2": lat2 / 2}, "4": {"2": 0.003}}}}


def test_insitu_swap_replaces_one_world_only(tmp_path):
    mine = {"kernels": {}, "compute_slowdown": {"1": 1.0, "2": 1.0, "4": 2.0}, "samples": _samples(0.0015, 0.003)}
    theirs = {"samples": _samples(0.0030, 0.009)}
    src = tmp_path / "theirs.json"
    src.write_text(json.dumps(theirs))
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(mine))
    out = cross_reprice.restated_profile(path, [], tmp_path / "out.json",
                                         insitu=cross_reprice.load_insitu_swaps([f"2={src}"]))
    s = json.loads(out.read_text())["samples"]
    assert s["insitu_latency_by_world_s"]["2"] == {"2": 0.0030}
    assert s["insitu_latency_s"]["2"] == 0.0030
    assert s["straggler_sigma"] == {"2": 0.009, "4": 0.06}
    assert s["insitu_latency_by_kind_s"]["p2p"]["2"] == {"2": 0.0015}
    assert s["insitu_latency_by_kind_s"]["all_to_all"]["4"] == {"4": 0.0025}   # world 4 untouched
    assert s["insitu_latency_by_world_s"]["4"] == mine["samples"]["insitu_latency_by_world_s"]["4"]
    assert json.loads(path.read_text()) == mine                                # the original untouched


def test_insitu_swap_bad_arguments_are_named(tmp_path):
    src = tmp_path / "p.json"
    src.write_text(json.dumps({"samples": _samples(0.002, 0.005)}))
    with pytest.raises(SystemExit, match="takes W=PROFILE"):
        cross_reprice.load_insitu_swaps([str(src)])
    with pytest.raises(SystemExit, match="no in-step costs with 3 ranks"):
        cross_reprice.load_insitu_swaps([f"3={src}"])


def test_by_world_lines_with_fewer_profiles_than_runs():
    """Rows (sets of measured steps) and columns (profiles) may differ: three runs' steps
    priced by two runs' profiles; each world's line covers every pairing and ranges over the
    two profiles' medians only."""
    runs, profs = ["a", "b", "c"], ["b", "c"]
    cells = {f"{m}|{p}": {"in-sample w2": [-0.2 if p == "b" else 0.1, -0.1 if p == "b" else 0.3]}
             for m in runs for p in profs}
    (line,) = cross_reprice.by_world_lines(cells, runs, profs)
    assert line.startswith("in-sample w2: 12 plan-pairings")
    assert "ranges -15 .. +20 %" in line      # b's median -0.15, c's +0.20


def test_collectives_refitted_from_the_mean(tmp_path):
    """--collective-stat mean: the intra models fitted from the rows' mean time (here twice the
    median at every size), "inter" following as a copy; the original file untouched."""
    rows = [{"nbytes": n, "median_s": 1e-4 + 1e-9 * n, "mean_s": 2 * (1e-4 + 1e-9 * n)}
            for n in (4, 1024, 65536, 1 << 20, 4 << 20)]
    entry = {"alpha_s": 1.0, "beta_s_per_byte": 1.0, "measured": True}
    prof = {"kernels": {}, "compute_slowdown": {"1": 1.0},
            "collectives": {"allreduce": {"intra": {"2": dict(entry)}, "inter": {"2": dict(entry)}}},
            "samples": {"collectives": {"allreduce": {"2": rows}}}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    out = json.loads(cross_reprice.restated_profile(path, [], tmp_path / "o.json",
                                                    collective_stat="mean_s").read_text())
    median = json.loads(json.dumps(prof))
    cross_reprice.refit_collectives(median, "median_s")
    m, md = out["collectives"]["allreduce"]["intra"]["2"], median["collectives"]["allreduce"]["intra"]["2"]
    assert m["alpha_s"] == pytest.approx(2 * md["alpha_s"], rel=1e-3)
    assert m["beta_s_per_byte"] == pytest.approx(2 * md["beta_s_per_byte"], rel=1e-3)
    assert out["collectives"]["allreduce"]["inter"]["2"]["alpha_s"] == m["alpha_s"]
    assert m["measured"] is True
    assert json.loads(path.read_text())["collectives"]["allreduce"]["intra"]["2"]["alpha_s"] == 1.0


def test_insitu_stat_reads_the_stored_rounds_and_names_old_profiles(tmp_path):
    """--insitu-stat mean / median: the in-step costs of each world read again from the
    profile's stored probe rounds; a profile without them is named, not silently left as it
    was."""
    from test_straggler import _rounds
    prof = {"kernels": {}, "compute_slowdown": {"1": 1.0}, "samples": {**_samples(0.001, 0.0),
                                                                        "insitu_raw": {"2": _rounds(2, 0.01)}}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    s = json.loads(cross_reprice.restated_profile(path, [], tmp_path / "o.json", insitu_stat="mean").read_text())["samples"]
    assert s["insitu_latency_by_world_s"]["2"]["2"] > 0.0014 and s["insitu_latency_s"]["2"] > 0.0014
    assert s["straggler_sigma"]["2"] > 0.0
    assert s["insitu_latency_by_world_s"]["4"] == prof["samples"]["insitu_latency_by_world_s"]["4"]   # not measured: kept
    assert s["insitu_stat"] == "mean"
    back = json.loads(cross_reprice.restated_profile(path, [], tmp_path / "m.json", insitu_stat="median").read_text())
    assert back["samples"]["insitu_stat"] == "median"
    assert back["samples"]["insitu_latency_by_world_s"]["2"]["2"] == pytest.approx(1e-3)   # the stall not counted
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"kernels": {}, "compute_slowdown": {"1": 1.0}, "samples": _samples(0.001, 0.0)}))
    with pytest.raises(SystemExit, match="no stored in-situ probe rounds"):
        cross_reprice.restated_profile(old, [], tmp_path / "o2.json", insitu_stat="mean")
