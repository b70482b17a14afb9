"""Calibration: fits, the profile artifact, and a tiny real calibration (2 gloo ranks).

Cheapest first: pure fits and profile logic (no torch compute in this process, so that the
forked ranks of the `dist` tests start safely), then real multi-process runs, then GPU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import warnings
from pathlib import Path

import numpy as np
import pytest

from autopar.profile import fit
from autopar.profile.features import conv_features, spec_features
from autopar.profile.keys import normalize_spec, shape_key
from autopar.profile import (COLLECTIVES, OP_CLASSES, PROFILE_SCHEMA, Profile,
                                       collective_terms, current_fingerprint, default_profile_path,
                                       load_profile, save_profile)
from autopar.errors import CalibrationError

REPO = Path(__file__).resolve().parents[1]
SIZES = [4 ** i for i in range(1, 13)]


def _entry(alpha, beta, measured=True):
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "heldout_median_rel_err": 0.01,
            "heldout_max_rel_err": 0.02, "measured": measured, "source": "synthetic"}


def make_profile(fingerprint=None) -> Profile:
    """Synthetic profile: alpha 10 us, beta 1 ns/B intra (p = 2 and 4), 10x slower inter."""
    colls = {}
    for kind in COLLECTIVES:
        sizes = ["2"] if kind == "p2p" else ["2", "4"]
        colls[kind] = {"intra": {p: _entry(10e-6 * int(p) / 2, 1e-9) for p in sizes},
                       "inter": {p: _entry(100e-6, 1e-8) for p in sizes}}
    kernels = {op: {"t0_s": 5e-6, "s_per_flop": 1e-11, "s_per_byte": 1e-10, "flops_per_s": 1e11,
                    "bytes_per_s": 1e10, "heldout_median_rel_err": 0.1, "heldout_max_rel_err": 0.2,
                    "measured": True} for op in OP_CLASSES}
    return Profile(
        schema=PROFILE_SCHEMA,
        fingerprint=fingerprint or current_fingerprint("gloo"),
        provenance={"kind": "measured", "date": "2026-11-30", "command": "test", "notes": ""},
        topology={"ranks_per_node": 4, "nodes": 2},
        kernels=kernels,
        collectives=colls,
        exact={"conv2d x=1x3x8x8 w=4x3x3x3 s=1,1 p=1,1 d=1,1 g=1":
               {"fwd": 1e-4, "bwd_data": 2e-4, "bwd_filter": 3e-4}},
        compute_slowdown={"1": 1.0, "2": 1.05, "4": 2.0},
        samples={"kernels": {"matmul": [{"config": {}, "flops": 1e6, "bytes": 1e4,
                                         "median_s": 2e-5, "times_s": [2e-5]}]}},
    )


# ---- fits ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", COLLECTIVES)
def test_fit_recovers_alpha_beta(kind):
    alpha, beta, p = 40e-6, 2e-9, 4
    a, b = collective_terms(kind, p)
    rng = np.random.default_rng(1)
    t = [(a * alpha + b * n * beta) * (1 + 0.01 * rng.standard_normal()) for n in SIZES]
    r = fit.fit_collective(kind, p, SIZES, t)
    assert r["alpha_s"] == pytest.approx(alpha, rel=0.05)
    assert r["beta_s_per_byte"] == pytest.approx(beta, rel=0.05)
    assert r["n_test"] >= 3 and r["n_train"] + r["n_test"] == len(SIZES)
    assert 0 <= r["heldout_median_rel_err"] <= r["heldout_max_rel_err"] < 0.05


def test_fit_kernel_recovers_constants_and_is_non_negative():
    rng = np.random.default_rng(2)
    flops = 10 ** rng.uniform(4, 9, 40)
    nbytes = 10 ** rng.uniform(3, 8, 40)
    t = 3e-6 + flops / 5e10 + nbytes / 2e10
    r = fit.fit_kernel(flops, nbytes, t)
    assert r["t0_s"] == pytest.approx(3e-6, rel=1e-3)
    assert r["flops_per_s"] == pytest.approx(5e10, rel=1e-3)
    assert r["bytes_per_s"] == pytest.approx(2e10, rel=1e-3)
    assert r["heldout_max_rel_err"] < 1e-6
    # data that a negative coefficient would fit better still yields non-negative constants
    r = fit.fit_kernel(flops, nbytes, 1e-3 - flops / 1e13)
    assert min(r["t0_s"], r["s_per_flop"], r["s_per_byte"]) >= 0


def test_heldout_error_is_measured_on_unseen_sizes():
    train, test = fit.split_indices(12, 2)
    assert len(train) == 9 and len(test) == 3 and not set(train) & set(test)
    assert (train == fit.split_indices(12, 2)[0]).all()  # fixed seed
    # one wild point among the held-out sizes shows up in the held-out error only there
    t = [10e-6 + n * 1e-9 for n in SIZES]
    t[int(test[0])] *= 3
    r = fit.fit_collective("p2p", 2, SIZES, t)
    assert r["heldout_max_rel_err"] > 0.5
    # too few samples: no held-out error, but a fit
    r = fit.fit_collective("p2p", 2, SIZES[:2], t[:2])
    assert r["heldout_median_rel_err"] is None and r["n_test"] == 0


# ---- profile -------------------------------------------------------------------------------

def test_profile_round_trips_through_json(tmp_path):
    prof = make_profile()
    again = Profile.from_json(json.loads(json.dumps(prof.to_json())))
    assert again == prof
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert load_profile(path, check_machine=False) == prof


def test_load_profile_errors(tmp_path):
    path = tmp_path / "p.json"
    with pytest.raises(CalibrationError, match="not found"):
        load_profile(path)
    save_profile(make_profile(), path)
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(CalibrationError, match="corrupt or truncated"):
        load_profile(path)
    obj = json.loads(text)
    path.write_text(json.dumps({**obj, "schema": "autopar.profile/0"}))
    with pytest.raises(CalibrationError, match="schema"):
        load_profile(path)
    path.write_text(json.dumps({k: v for k, v in obj.items() if k not in ("kernels", "topology")}))
    with pytest.raises(CalibrationError, match="kernels, .*topology|topology, .*kernels|lacks"):
        load_profile(path)
    bad = json.loads(text)
    del bad["collectives"]["allreduce"]["intra"]["2"]["beta_s_per_byte"]
    path.write_text(json.dumps(bad))
    with pytest.raises(CalibrationError, match="allreduce.intra.2 lacks numeric beta_s_per_byte"):
        load_profile(path)
    assert "autopar calibrate" in CalibrationError("x", "rerun `autopar calibrate`").hint


def test_fingerprint_mismatch_warns_naming_fields(tmp_path):
    here = current_fingerprint("gloo")
    path = tmp_path / "p.json"
    save_profile(make_profile({**here, "host": "elsewhere", "torch_version": "1.0.0"}), path)
    with pytest.warns(UserWarning, match="host") as rec:
        load_profile(path)
    msg = str(rec[0].message)
    assert "torch_version" in msg and "'1.0.0'" in msg and repr(here["torch_version"]) in msg
    assert "'elsewhere'" in msg and "cpu_model" not in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_profile(path, check_machine=False)
        save_profile(make_profile(here), path)
        load_profile(path)  # same machine: silent


def test_collective_time_monotone_and_zero_for_one_rank():
    prof = make_profile()
    for kind in COLLECTIVES:
        for level in ("intra", "inter"):
            for p in (2, 3, 4, 8):
                t = [prof.collective_time_s(kind, p, n, level) for n in [0] + SIZES]
                assert all(b > a for a, b in zip(t[1:], t[2:])), (kind, level, p)
                assert t[0] >= 0
            if kind != "p2p":
                assert prof.collective_time_s(kind, 1, 1e6, level) == 0.0
    assert prof.collective_time_s("p2p", 1, 1e6) == pytest.approx(10e-6 + 1e-3)
    assert prof.collective_time_s("allreduce", 4, 1e6, "inter") > prof.collective_time_s("allreduce", 4, 1e6)
    with pytest.raises(CalibrationError):
        prof.collective_time_s("allreduce_coalesced", 2, 1)


def test_unmeasured_group_size_uses_nearest_constants():
    prof = make_profile()  # measured at 2 (alpha 10 us) and 4 (alpha 20 us)
    alpha4, beta = 20e-6, 1e-9
    n = 1e6
    # p = 16: constants of p = 4 plugged into the allreduce formula with p = 16
    want = 2 * 4 * alpha4 + 2 * 15 / 16 * n * beta
    assert prof.collective_time_s("allreduce", 16, n) == pytest.approx(want)
    # p = 3 is as near to 2 as to 4: the larger measured size wins
    assert prof.collective_time_s("all_to_all", 3, n) == pytest.approx(2 * alpha4 + 2 / 3 * n * beta)
    assert prof.collective_time_s("broadcast", 64, n) == pytest.approx(6 * (alpha4 + n * beta))


def test_kernel_exact_slowdown_topology():
    prof = make_profile()
    assert prof.kernel_time_s("matmul", 1e9, 1e6) == pytest.approx(5e-6 + 1e-2 + 1e-4)
    with pytest.raises(CalibrationError, match="no kernel model"):
        prof.kernel_time_s("fft", 1, 1)
    key = shape_key({"op": "conv", "x": [1, 3, 8, 8], "w": [4, 3, 3, 3], "padding": 1})
    assert prof.exact_time_s(key, "bwd_filter") == 3e-4
    assert prof.exact_time_s(key.replace("x=1", "x=2"), "fwd") is None
    assert prof.slowdown(1) == 1.0 and prof.slowdown(2) == 1.05 and prof.slowdown(4) == 2.0
    assert prof.slowdown(3) == pytest.approx(1.525)  # linear between 2 and 4
    assert prof.slowdown(8) == pytest.approx(4.0)    # 2 effective cores: max(1, 8/2)
    # a factor measured below 1 (the machine sped up between the windows) is read as 1
    prof.compute_slowdown = {"1": 1.0, "2": 0.87, "4": 1.8}
    assert prof.slowdown(2) == 1.0 and prof.slowdown(3) == pytest.approx(1.4)
    assert prof.level_of([0, 1, 3]) == "intra" and prof.level_of([3, 4]) == "inter"
    big = prof.with_topology(8, 128)
    assert big.level_of([3, 4]) == "intra" and big.topology == {"ranks_per_node": 8, "nodes": 128}
    assert prof.topology["ranks_per_node"] == 4  # the original is unchanged


def test_shape_key_is_canonical():
    a = {"op": "conv", "x": [8, 3, 32, 32], "w": [16, 3, 3, 3], "padding": 1}
    b = {"groups": 1, "dilation": [1, 1], "stride": 1, "padding": [1, 1], "w": (16, 3, 3, 3),
         "x": (8, 3, 32, 32), "op": "conv"}
    assert shape_key(a) == shape_key(b) == "conv2d x=8x3x32x32 w=16x3x3x3 s=1,1 p=1,1 d=1,1 g=1"
    assert shape_key({**a, "stride": 2}) != shape_key(a)
    assert shape_key({"op": "linear", "x": [64, 512], "w": [10, 512]}) == "linear x=64x512 w=10x512"
    with pytest.raises(ValueError):
        normalize_spec({"op": "conv", "x": [8, 3, 32, 32], "w": [16, 4, 3, 3]})
    # FLOPs: 2 * N * F * out_positions * C * k*k
    flops, nbytes = conv_features([8, 3, 32, 32], [16, 3, 3, 3], [1, 1], [1, 1], [1, 1])
    assert flops == 2 * 8 * 16 * 32 * 32 * 3 * 9
    assert nbytes == 4 * (8 * 3 * 32 * 32 + 16 * 27 + 8 * 16 * 32 * 32)
    assert spec_features({"op": "linear", "x": [4, 6, 8], "w": [2, 8]})[:2] == ("matmul", 2 * 24 * 8 * 2)


def test_interrupted_write_keeps_old_profile(tmp_path, monkeypatch):
    import autopar.io

    path = tmp_path / "p.json"
    save_profile(make_profile(), path)
    old = path.read_bytes()

    def boom(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(autopar.io.os, "fsync", boom)
    prof = make_profile()
    prof.compute_slowdown = {"1": 1.0, "2": 9.0}
    with pytest.raises(KeyboardInterrupt):
        save_profile(prof, path)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temp file left


def test_committed_profiles_load():
    # profiles only: a PROFILE-shapes.json beside one is its cache of shapes measured on demand
    paths = sorted(p for p in (REPO / "calibration").glob("*.json") if not p.name.endswith("-shapes.json"))
    assert {p.name for p in paths} >= {"cpu-2core-gloo.json", "datasheet-a100-cluster.json"}
    for path in paths:
        prof = load_profile(path, check_machine=False)
        assert set(prof.kernels) >= set(OP_CLASSES)  # (+ the runtime's per-op pseudo class)
        assert set(prof.collectives) == set(COLLECTIVES)
        assert prof.kernel_time_s("conv_fwd", 1e9, 1e7) > 0
        assert prof.collective_time_s("allreduce", 2, 1 << 20, "inter") > 0
        assert prof.provenance["kind"] in ("measured", "datasheet")
        if prof.provenance["kind"] == "measured" and prof.topology["nodes"] == 1:
            # single node: "inter" cannot have been measured (multi-node profiles: see
            # tests/test_calibrate_cluster.py)
            assert all(not e["measured"] for e in prof.collectives["allreduce"]["inter"].values())
    try:
        assert default_profile_path().is_file()
    except CalibrationError:
        pass


def test_plots(tmp_path):
    from autopar.calibrate.plots import plot_fits

    paths = plot_fits(make_profile(), tmp_path)
    assert tmp_path / "kernel_matmul.png" in paths
    assert tmp_path / "collective_allreduce.png" in paths
    assert all(p.stat().st_size > 1000 for p in paths)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is available here")
def test_nccl_without_cuda_is_a_named_error(tmp_path):
    from autopar.calibrate.run import calibrate

    with pytest.raises(CalibrationError, match="nccl needs CUDA"):
        calibrate(True, 2, "nccl", tmp_path / "p.json", progress=lambda s: None)
    assert not (tmp_path / "p.json").exists()


# ---- real runs -----------------------------------------------------------------------------

@pytest.mark.dist
def test_tiny_calibration_end_to_end(tmp_path):
    from autopar.calibrate.run import TINY, calibrate

    out = tmp_path / "prof.json"
    lines: list[str] = []
    specs = [{"op": "conv", "x": [2, 3, 8, 8], "w": [4, 3, 3, 3], "padding": 1},
             {"op": "linear", "x": [16, 32], "w": [8, 32]}]
    assert calibrate(True, 2, "gloo", out, progress=lines.append, exact_specs=specs,
                     sweep=TINY, command="pytest") == out
    assert any("wrote" in s for s in lines) and any("collectives" in s for s in lines)
    assert [p.name for p in tmp_path.iterdir()] == ["prof.json"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prof = load_profile(out)  # this machine: no fingerprint warning
    assert prof.provenance["kind"] == "measured" and prof.provenance["command"] == "pytest"
    assert set(prof.kernels) == set(OP_CLASSES) | {"runtime_op", "optimizer_step"}
    assert prof.kernels["runtime_op"]["t0_s"] >= 0   # measured, not fitted
    from autopar.calibrate.overhead import PROBES
    assert set(prof.kernels["runtime_op"]["by_family"]) == set(PROBES)     # per op family too
    assert set(prof.kernels["runtime_op"]["native_by_family"]) == set(PROBES)
    for op, k in prof.kernels.items():
        if op == "runtime_op":
            continue
        assert k["heldout_median_rel_err"] is not None, op
        assert prof.kernel_time_s(op, 1e6, 1e6) > 0
    assert set(prof.collectives) == set(COLLECTIVES)
    for kind in COLLECTIVES:
        assert list(prof.collectives[kind]["intra"]) == ["2"]
        assert prof.collectives[kind]["intra"]["2"]["measured"] is True
        assert prof.collectives[kind]["inter"]["2"]["measured"] is False
        assert prof.collective_time_s(kind, 2, 65536) > 0
    assert set(prof.compute_slowdown) == {"1", "2"}
    # the readings are kept; at 2 ranks on this machine (>= 2 cores) they are what is priced
    assert set(prof.samples["compute_slowdown_measured"]) == {"1", "2"}
    assert prof.samples["cores"] >= 1
    if prof.samples["cores"] >= 2:
        assert prof.compute_slowdown == prof.samples["compute_slowdown_measured"]
    for spec in specs:
        t = prof.exact_time_s(shape_key(spec), "bwd_data")
        assert t is not None and 0 < t < 1
    assert prof.samples["collectives"]["allreduce"]["2"][0]["times_s"]
    # the in-step probes' rounds are kept, and read by the statistic the profile names they are
    # what is stored
    from autopar.calibrate.insitu import STORED_STAT, estimate_in_situ
    assert prof.samples["insitu_stat"] == STORED_STAT
    st, lat, by_kind = estimate_in_situ(prof.samples["insitu_raw"]["2"], 2, prof.samples["insitu_stat"])
    assert (st.kappa, st.sigma) == (prof.samples["straggler_kappa"]["2"], prof.samples["straggler_sigma"]["2"])
    assert lat == prof.samples["insitu_latency_by_world_s"]["2"]
    assert by_kind["p2p"] == prof.samples["insitu_latency_by_kind_s"]["p2p"]["2"]
    # every kernel time is stated at the calibration's nominal machine speed (calibrate.speed):
    # the median probe reading; each row keeps its raw time and the probe reading around it
    probe = prof.samples["speed_probe"]
    assert probe["nominal_s"] == pytest.approx(statistics.median(probe["readings_s"]))
    for op, rows in prof.samples["kernels"].items():
        for r in rows:
            assert r["probe_s"] > 0, op
            assert r["median_s"] == pytest.approx(r["raw_median_s"] * probe["nominal_s"] / r["probe_s"], rel=1e-5)
    for spec in specs:
        raw = prof.samples["exact"][shape_key(spec)]
        assert prof.exact[shape_key(spec)]["fwd"] == pytest.approx(
            statistics.median(raw["fwd"]) * probe["nominal_s"] / raw["probe_s"], rel=1e-4)

    # exact shapes added later: new ones measured, known ones skipped, file replaced atomically
    from autopar.calibrate.run import add_exact_shapes

    new = {"op": "conv", "x": [1, 4, 6, 6, 6], "w": [2, 4, 3, 3, 3]}
    add_exact_shapes(out, specs + [new], progress=lines.append, repeats=2)
    prof2 = load_profile(out)
    assert set(prof2.exact) == set(prof.exact) | {shape_key(new)}
    assert prof2.exact[shape_key(specs[0])] == prof.exact[shape_key(specs[0])]
    # ... stated at the profile's nominal speed, not at the speed of their own minute
    raw = prof2.samples["exact"][shape_key(new)]
    assert prof2.exact[shape_key(new)]["bwd_filter"] == pytest.approx(
        statistics.median(raw["bwd_filter"]) * probe["nominal_s"] / raw["probe_s"], rel=1e-4)
    assert prof2.provenance["exact_added"][-1]["stated_at_nominal_s"] == probe["nominal_s"]
    assert [p.name for p in tmp_path.iterdir()] == ["prof.json"]


def test_runtime_overhead_probes_trace_run_and_price_each_family():
    """Each probe is a chain of one op family run through a real DistModel at world 1: it
    traces to ops of that family, and its overhead beyond the kernel model is measured."""
    import types

    import torch
    from autopar.calibrate import overhead
    from autopar.modelfile import ModelFile
    from autopar.trace.tracer import trace_model
    from fakes import synthetic_profile          # tests/ is on sys.path (conftest)
    probes = overhead._probe_modules()
    want = {"view": {"view", "permute"}, "embedding": {"embedding", "binary"}}
    for fam in overhead.PROBES:
        build, example, n_ops, _ = probes[fam]
        xs = example(2)
        g = trace_model(ModelFile(Path(f"p_{fam}.py"), types.SimpleNamespace(build_model=build, example_inputs=example)),
                        int(xs[0].shape[0]))
        kinds = {op.kind for lay in g.layers for op in lay.ops}
        assert kinds == want.get(fam, {fam}), (fam, kinds)
    torch.set_num_threads(1)
    traced, native = overhead.measure_runtime_overhead_by_family(synthetic_profile(), repeats=3)
    assert set(traced) == set(native) == set(overhead.PROBES)
    assert all(v >= 0 for v in [*traced.values(), *native.values()])
    # the traced path does more per op than the module itself (substitution, a decomposition call)
    assert sum(traced.values()) > sum(native.values())


def test_add_exact_shapes_refuses_a_datasheet_profile(tmp_path):
    from autopar.calibrate.run import add_exact_shapes

    prof = make_profile()
    prof.provenance["kind"] = "datasheet"
    save_profile(prof, tmp_path / "d.json")
    with pytest.raises(CalibrationError, match="datasheet"):
        add_exact_shapes(tmp_path / "d.json", [{"op": "linear", "x": [2, 2], "w": [2, 2]}])


@pytest.mark.dist
def test_interrupted_calibration_keeps_old_profile(tmp_path, monkeypatch):
    from autopar.calibrate import run

    out = tmp_path / "prof.json"
    out.write_text('{"old": true}\n')

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run.fit, "fit_collective", interrupted)
    tiny = dataclasses.replace(run.TINY, op_classes=("matmul",), kinds=("allreduce",))
    with pytest.raises(KeyboardInterrupt):
        run.calibrate(True, 2, "gloo", out, progress=lambda s: None, sweep=tiny)
    assert out.read_text() == '{"old": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["prof.json"]


# ---- GPU (last: CUDA in this process must not precede the forked CPU ranks) -----------------

@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_event_timing():
    from autopar.calibrate import kernels

    samples = kernels.benchmark_op_class("matmul", kernels.sweep_configs("matmul", 3, 1e8, 1 << 20),
                                         device="cuda", repeats=3)
    assert all(math.isfinite(s["median_s"]) and s["median_s"] > 0 for s in samples)
    exact = kernels.measure_exact([{"op": "conv", "x": [2, 3, 16, 16], "w": [8, 3, 3, 3]}], "cuda", 3)
    assert all(v > 0 for e in exact.values() for v in e.values())


def test_slowdown_factors_pair_each_count_with_its_rounds_one_rank_window():
    from autopar.calibrate.run import slowdown_factors
    # 2 ranks, 3 rounds; the machine runs 2x slower in round 1 for every count alike
    base = [[0.010, 0.010], [0.020, 0.020], [0.010, 0.010]]          # k = 1, rank 0, per round
    two = [[0.011, 0.011], [0.022, 0.022], [0.011, 0.011]]           # k = 2, each rank
    per_rank = [{1: base, 2: two}, {2: [[0.012], [0.024], [0.012]]}]
    slowdown, ratios, times = slowdown_factors(per_rank, 2, 3, 0.05)
    assert slowdown["1"] == 1.0
    # per round: the median over the 2 ranks of their mean (0.0115, 0.023, 0.0115) over t(1)
    assert ratios[2] == pytest.approx([1.15, 1.15, 1.15])
    assert slowdown["2"] == pytest.approx(1.15)
    assert times["2"][1] == [0.012, 0.024, 0.012]
    with pytest.raises(CalibrationError, match="no kernel-set run finished"):
        slowdown_factors([{1: [[0.01], [], [0.01]], 2: two}, {2: [[0.01], [0.01], [0.01]]}], 1, 3, 0.05)


def test_time_shared_slowdown_prices_ranks_beyond_the_cores_as_time_sharing():
    from autopar.calibrate.run import time_shared_slowdown
    measured = {"1": 1.0, "2": 1.05, "3": 1.83, "4": 2.96}
    # 2 cores: up to 2 ranks as measured, then 1.05 * k / 2 (each rank gets 2/k of a core)
    assert time_shared_slowdown(measured, 2) == {"1": 1.0, "2": 1.05, "3": pytest.approx(1.575),
                                                 "4": pytest.approx(2.1)}
    # a reading under 1 at one rank per core is the machine speeding up between windows: 1
    assert time_shared_slowdown({"1": 1.0, "2": 0.96, "4": 2.5}, 2)["4"] == pytest.approx(2.0)
    # as many cores as ranks (or more): nothing is restated
    assert time_shared_slowdown(measured, 4) == measured
    assert time_shared_slowdown(measured, 16) == measured
    # one core: k ranks take k times as long
    assert time_shared_slowdown(measured, 1) == {"1": 1.0, "2": 2.0, "3": 3.0, "4": 4.0}
    # the input is not changed
    assert measured["4"] == 2.96


def test_quick_calibration_measures_collectives_at_the_group_sizes_a_mesh_can_have():
    """Quick mode launches one collectives run per divisor of the world (a plan's groups are
    the dims of its mesh); full mode every size. An unmeasured size is priced with the nearest
    measured size's constants (``test_unmeasured_group_size_uses_nearest_constants``)."""
    from autopar.calibrate.run import FULL, QUICK, collective_group_sizes
    assert QUICK.coll_groups == "divisors" and FULL.coll_groups == "all"
    assert collective_group_sizes(4, "divisors") == [2, 4]
    assert collective_group_sizes(6, "divisors") == [2, 3, 6]
    assert collective_group_sizes(8, "divisors") == [2, 4, 8]
    assert collective_group_sizes(2, "divisors") == [2]
    assert collective_group_sizes(4) == [2, 3, 4]
    with pytest.raises(ValueError, match="divisors"):
        collective_group_sizes(4, "powers")


@pytest.mark.dist
def test_ddps_reducer_is_measured_on_one_rank_and_fitted_non_negative():
    """``measure_grad_reducer`` in a process group of one rank: every probe's plain and DDP
    medians kept, the fit non-negative; copying 4 MiB of gradients into DDP's bucket and back
    costs the largest probe something beyond the plain step. Outside a group: None."""
    from autopar.calibrate import overhead
    from autopar.runtime.launch import run_ranks
    assert overhead.measure_grad_reducer(repeats=1) is None
    red = run_ranks(_reducer_rank, 1, timeout_s=240)[0]
    assert {"fixed_s", "per_tensor_s", "per_byte_s", "rows"} <= set(red)
    assert all(red[k] >= 0.0 and math.isfinite(red[k]) for k in ("fixed_s", "per_tensor_s", "per_byte_s"))
    assert [(r["tensors"], r["elements"]) for r in red["rows"]] == list(overhead.REDUCER_PROBES)
    for r in red["rows"]:
        assert r["plain_s"] > 0 and r["ddp_s"] > 0 and r["reducer_s"] == max(0.0, r["ddp_s"] - r["plain_s"])
    big = max(red["rows"], key=lambda r: r["bytes"])
    assert big["bytes"] == 16 * 65536 * 4 and big["reducer_s"] > 0.0
    assert red["fixed_s"] + red["per_tensor_s"] + red["per_byte_s"] > 0.0


def _reducer_rank(rank, world):
    import torch
    from autopar.calibrate.overhead import measure_grad_reducer
    torch.set_num_threads(1)
    return measure_grad_reducer(repeats=8)


def test_the_optimizer_step_is_timed_cold_and_fitted_with_a_fixed_share(monkeypatch):
    """``measure_optimizer_step`` times every set after writing twice the last-level cache
    (what backward leaves the update to) and hot, keeps both medians, and fits a non-negative
    fixed share, per-tensor and per-byte cost to the cold ones; ``optimizer_step_s`` prices
    the update without the fixed share, ``optimizer_fixed_s`` the share (0 for an older fit)."""
    from types import SimpleNamespace

    from autopar.calibrate import optimizer
    from autopar.profile import optimizer as model
    assert optimizer.cold_flush_bytes() >= 2 * 1024 * 1024
    monkeypatch.setattr(optimizer, "cold_flush_bytes", lambda: 8 << 20)     # keep the test quick
    m = optimizer.measure_optimizer_step(repeats=3)
    assert m["cache"].startswith("cold") and "8 MiB" in m["cache"]
    assert all(m[k] >= 0.0 and math.isfinite(m[k]) for k in ("fixed_s", "t0_s", "s_per_byte"))
    assert [(r["tensors"], r["elements"]) for r in m["samples"]] == list(optimizer.SETS)
    assert all(r["median_s"] > 0 and r["hot_median_s"] > 0 for r in m["samples"])
    assert math.isfinite(m["heldout_median_rel_err"])
    prof = SimpleNamespace(kernels={"optimizer_step": m})
    assert model.optimizer_step_s(prof, 10, 4096) == pytest.approx(10 * m["t0_s"] + 4096 * m["s_per_byte"])
    assert model.optimizer_fixed_s(prof) == m["fixed_s"]
    old = {k: v for k, v in m.items() if k != "fixed_s"}
    assert model.optimizer_fixed_s(SimpleNamespace(kernels={"optimizer_step": old})) == 0.0
    assert model.optimizer_fixed_s(SimpleNamespace(kernels={})) == 0.0
