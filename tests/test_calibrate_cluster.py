"""Multi-node calibration (``autopar.calibrate.cluster``): layout and groups (pure), then a
simulated 2-node x 2-rank run under torchrun, merging into a single-node profile, and a run
interrupted mid-way (forked gloo ranks).

Pure tests first: no torch compute in this process before the forked ranks of the last tests.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopar.calibrate import cluster
from autopar.profile import COLLECTIVES, SIMULATED, load_profile, save_profile
from autopar.calibrate.run import TINY
from autopar.errors import CalibrationError, RankFailure

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "calibration" / "cpu-2core-gloo.json"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _infos(hosts, group_ranks=None, lws=None):
    group_ranks = group_ranks or [None] * len(hosts)
    return [{"host": h, "group_rank": g, "local_world_size": lws or 0}
            for h, g in zip(hosts, group_ranks)]


# ---- layout and groups (pure) --------------------------------------------------------------

def test_layout_from_hostnames():
    lay = cluster.derive_node_map(_infos(["a", "a", "b", "b"], ["0", "0", "1", "1"], lws=2))
    assert lay.node_ranks == ((0, 1), (2, 3)) and lay.hosts == ("a", "b")
    assert (lay.nodes, lay.ranks_per_node, lay.world) == (2, 2, 4)
    assert not lay.simulated and lay.contiguous
    # ranks numbered across nodes: nodes still follow the hosts
    lay = cluster.derive_node_map(_infos(["a", "b", "a", "b"]))
    assert lay.node_ranks == ((0, 2), (1, 3)) and not lay.contiguous and not lay.simulated


def test_layout_on_one_host_is_simulated():
    # two torchrun agents on one host: two nodes, but loopback between them
    lay = cluster.derive_node_map(_infos(["a"] * 4, ["0", "0", "1", "1"]))
    assert lay.node_ranks == ((0, 1), (2, 3)) and lay.simulated
    lay = cluster.derive_node_map(_infos(["a"] * 4), ranks_per_node=2, simulate_nodes=2)
    assert lay.node_ranks == ((0, 1), (2, 3)) and lay.simulated
    lay = cluster.derive_node_map(_infos(["a"] * 6), simulate_nodes=3)
    assert (lay.nodes, lay.ranks_per_node) == (3, 2) and lay.simulated
    lay = cluster.derive_node_map(_infos(["a"] * 4), ranks_per_node=2)  # override, one host
    assert lay.simulated
    lay = cluster.derive_node_map(_infos(["a"] * 4))  # one plain node
    assert lay.node_ranks == ((0, 1, 2, 3),) and not lay.simulated


def test_layout_errors_are_named():
    with pytest.raises(CalibrationError, match="!= world size 4"):
        cluster.derive_node_map(_infos(["a"] * 4), ranks_per_node=2, simulate_nodes=3)
    with pytest.raises(CalibrationError, match="does not divide"):
        cluster.derive_node_map(_infos(["a"] * 4), ranks_per_node=3)
    with pytest.raises(CalibrationError, match="different numbers of ranks"):
        cluster.derive_node_map(_infos(["a", "a", "a", "b"]))
    with pytest.raises(CalibrationError, match="on one node"):
        cluster.derive_node_map(_infos(["a", "b", "a", "b"]), ranks_per_node=2)
    with pytest.raises(CalibrationError, match="LOCAL_WORLD_SIZE"):
        cluster.derive_node_map(_infos(["a", "a", "b", "b"], lws=4))


def test_ladder_and_groups():
    assert cluster.ladder(1) == [] and cluster.ladder(4) == [2, 3, 4]
    assert cluster.ladder(8) == list(range(2, 9)) and cluster.ladder(12) == [2, 4, 8, 12]
    lay = cluster.derive_node_map(_infos(["a"] * 4), ranks_per_node=2, simulate_nodes=2)
    got = [(g.level, g.ranks, g.nodes_spanned) for g in cluster.plan_groups(lay)]
    assert got == [("intra", (0, 1), 1), ("inter", (0, 2), 2), ("inter", (0, 1, 2, 3), 2)]
    one_node = cluster.derive_node_map(_infos(["a"] * 3))
    assert [(g.level, g.size) for g in cluster.plan_groups(one_node)] == [("intra", 2), ("intra", 3)]
    one_per_node = cluster.derive_node_map(_infos(["a", "b", "c"]))
    assert [(g.level, g.ranks) for g in cluster.plan_groups(one_per_node)] == [
        ("inter", (0, 1)), ("inter", (0, 1, 2))]  # no duplicate "whole world" group
    big = cluster.derive_node_map(_infos([f"h{i // 16}" for i in range(64)]))
    groups = cluster.plan_groups(big)
    assert [g.size for g in groups if g.level == "intra"] == [2, 4, 8, 16]
    assert [g.ranks for g in groups if g.level == "inter"][:3] == [(0, 16), (0, 16, 32),
                                                                  (0, 16, 32, 48)]
    assert groups[-1].size == 64
    # every group contains rank 0 (it gathers the results)
    assert all(0 in g.ranks for g in groups)


def test_simulated_entries_load_with_a_warning_and_price(tmp_path):
    from fakes import synthetic_profile

    prof = synthetic_profile(ranks_per_node=2, nodes=2)
    for kind in COLLECTIVES:
        for e in prof.collectives[kind]["inter"].values():
            e["measured"] = SIMULATED
    save_profile(prof, tmp_path / "sim.json")
    with pytest.warns(UserWarning, match="SIMULATED"):
        loaded = load_profile(tmp_path / "sim.json", check_machine=False)
    assert loaded.collective_time_s("allreduce", 4, 1 << 20, "inter") > \
        loaded.collective_time_s("allreduce", 4, 1 << 20, "intra") > 0
    assert loaded.collective_time_s("p2p", 2, 1 << 10, "inter") > 0
    prof.collectives["allreduce"]["inter"]["2"]["measured"] = "loopback"
    with pytest.raises(CalibrationError, match="measured is 'loopback'"):
        save_profile(prof, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_cli_prints_the_torchrun_command(capsys, monkeypatch):
    from autopar.cli import main

    assert main(["calibrate", "--nodes", "4", "--ranks-per-node", "8", "--quick",
                 "-o", "c.json"]) == 0
    out = capsys.readouterr().out
    assert ("torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "
            "HOST:29500 -m autopar.calibrate.cluster --out c.json --quick") in out
    assert main(["calibrate", "--nodes", "4"]) == 2
    monkeypatch.delenv("RANK", raising=False)
    assert cluster.main(["--out", "x.json"]) == 2  # not under torchrun: a named error
    assert "torchrun" in capsys.readouterr().err


# ---- a simulated 2-node x 2-rank run under torchrun ---------------------------------------

@pytest.fixture(scope="module")
def simulated_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cluster") / "sim-2x2.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    r = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "4",
                        "-m", "autopar.calibrate.cluster", "--simulate-nodes", "2",
                        "--ranks-per-node", "2", "--sweep", "tiny", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r.stdout, time.perf_counter() - t0


@pytest.mark.dist
def test_simulated_two_nodes_under_torchrun(simulated_run):
    out, stdout, elapsed = simulated_run
    assert "SIMULATED" in stdout and "wrote" in stdout
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp file left
    with pytest.warns(UserWarning, match="SIMULATED"):
        prof = load_profile(out)  # measured here: no fingerprint warning, the simulation one
    assert prof.topology == {"ranks_per_node": 2, "nodes": 2}
    pv = prof.provenance
    assert pv["kind"] == "measured" and pv["multi_node"] is True and pv["simulated"] is True
    assert pv["nodes"] == 2 and len(pv["hostnames"]) == 2 and "ONE host" in pv["notes"]
    assert prof.kernels == {}
    assert set(prof.collectives) == set(COLLECTIVES)
    for kind in COLLECTIVES:
        intra, inter = prof.collectives[kind]["intra"], prof.collectives[kind]["inter"]
        assert list(intra) == ["2"]
        assert list(inter) == (["2"] if kind == "p2p" else ["2", "4"])
        for p, e in intra.items():
            assert e["measured"] is True and "intra" in e["source"]
        for p, e in inter.items():
            assert e["measured"] == SIMULATED and "ONE host" in e["source"]
        for e in [*intra.values(), *inter.values()]:
            # fits as in the single-node profile: held-out error on unseen sizes
            assert e["heldout_median_rel_err"] is not None and e["n_test"] >= 1
            assert e["alpha_s"] >= 0 and e["beta_s_per_byte"] >= 0
        for level in ("intra", "inter"):
            assert prof.collective_time_s(kind, 2, 65536, level) > 0
    assert prof.collective_time_s("allreduce", 4, 1 << 20, "inter") > 0
    assert prof.samples["collectives"]["allreduce"]["2"][0]["times_s"]
    assert set(prof.samples["collectives_inter"]["allreduce"]) == {"2", "4"}


@pytest.mark.dist
def test_merge_keeps_kernels_and_replaces_collectives(simulated_run, tmp_path):
    measured_path = simulated_run[0]
    base_path = tmp_path / "base.json"
    shutil.copy(BASE, base_path)
    before = base_path.read_bytes()
    out = tmp_path / "merged.json"
    with pytest.warns(UserWarning, match="SIMULATED"):
        assert cluster.main(["--from", str(measured_path), "--merge-into", str(base_path),
                             "--out", str(out)]) == 0
    assert base_path.read_bytes() == before  # the input is never rewritten
    base = load_profile(base_path, check_machine=False)
    with pytest.warns(UserWarning, match="SIMULATED"):
        measured = load_profile(measured_path, check_machine=False)
        merged = load_profile(out, check_machine=False)
    assert merged.kernels == base.kernels and merged.exact == base.exact
    assert merged.compute_slowdown == base.compute_slowdown
    assert merged.samples["insitu_latency_s"] == base.samples["insitu_latency_s"]
    assert merged.samples["kernels"] == base.samples["kernels"]
    assert merged.collectives == measured.collectives
    assert merged.samples["collectives"] == measured.samples["collectives"]
    assert merged.samples["collectives_inter"] == measured.samples["collectives_inter"]
    assert merged.topology == {"ranks_per_node": 2, "nodes": 2}
    assert merged.fingerprint == base.fingerprint
    assert merged.provenance["multi_node"]["simulated"] is True
    assert merged.provenance["merged"]["base"] == str(base_path)
    assert "NOT measured" not in merged.provenance["notes"]
    assert merged.kernel_time_s("conv_fwd", 1e8, 1e6) == base.kernel_time_s("conv_fwd", 1e8, 1e6)
    assert merged.collective_time_s("allreduce", 2, 1 << 20, "inter") == \
        measured.collective_time_s("allreduce", 2, 1 << 20, "inter")
    # a datasheet profile's kernels were not measured here: refused
    with pytest.raises(CalibrationError, match="datasheet"), pytest.warns(UserWarning):
        cluster.merge_files(measured_path, REPO / "calibration" / "datasheet-a100-cluster.json",
                            tmp_path / "x.json", progress=lambda s: None)
    assert not (tmp_path / "x.json").exists()


# ---- forked gloo ranks: merge during the run; interrupted run ------------------------------

SMALL = dataclasses.replace(TINY, kinds=("allreduce", "p2p"))


def _cluster_rank(rank, world, opts):
    return cluster.run_cluster(opts, progress=lambda s: None)


@pytest.mark.dist
def test_run_with_merge_into(tmp_path):
    from autopar.runtime.launch import run_ranks

    base_path = tmp_path / "base.json"
    shutil.copy(BASE, base_path)
    out = tmp_path / "merged.json"
    opts = cluster.Options(out=out, ranks_per_node=2, simulate_nodes=2, merge_into=base_path,
                           sweep=SMALL, command="pytest")
    assert run_ranks(_cluster_rank, 4, (opts,), timeout_s=120) == [out, None, None, None]
    with pytest.warns(UserWarning, match="SIMULATED"):
        merged = load_profile(out, check_machine=False)
    assert set(merged.collectives) == {"allreduce", "p2p"}
    assert merged.collectives["allreduce"]["inter"]["4"]["measured"] == SIMULATED
    assert merged.kernels == load_profile(base_path, check_machine=False).kernels
    assert merged.provenance["merged"]["command"] == "pytest"


def _fail_in_the_world_group(real):
    def measure(rank, world, *a, **k):
        if world == 4 and rank == 1:  # the last group, after two measured ones
            raise RuntimeError("injected failure mid-way")
        return real(rank, world, *a, **k)
    return measure


@pytest.mark.dist
def test_interrupted_run_leaves_no_profile(tmp_path, monkeypatch):
    from autopar.runtime.launch import run_ranks

    out = tmp_path / "prof.json"
    out.write_text('{"old": true}\n')
    monkeypatch.setattr(cluster.coll, "measure_rank",
                        _fail_in_the_world_group(cluster.coll.measure_rank))
    opts = cluster.Options(out=out, ranks_per_node=2, simulate_nodes=2, sweep=SMALL)
    with pytest.raises(RankFailure, match="injected failure"):
        run_ranks(_cluster_rank, 4, (opts,), timeout_s=120)
    assert out.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["prof.json"]
    # a bad merge base is found before anything is measured, on every rank
    opts = dataclasses.replace(opts, merge_into=tmp_path / "missing.json")
    with pytest.raises(RankFailure, match="not found"):
        run_ranks(_cluster_rank, 4, (opts,), timeout_s=60)
    assert [p.name for p in tmp_path.iterdir()] == ["prof.json"]
