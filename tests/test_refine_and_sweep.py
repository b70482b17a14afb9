"""Learning from runs (factors fitted from measured runs, chosen by cross-validation) and the
strong-scaling sweep."""

import pytest

from autopar.calibrate.refine import (Corrections, RunRows, apply_corrections, cross_validate, fit,
                                      run_rows)


def _plan_and_run(world, shapes, blocking, grad, n=8, exposed=0.01, noise=None):
    """A synthetic plan and the run that measured it: layer i is priced by exact key
    shapes[i % len(shapes)], measured at that key's true factor, its communication x blocking,
    the exposed gradient all-reduce x grad."""
    layers, measured = [], []
    keys = sorted(shapes)
    for i in range(n):
        key = keys[i % len(keys)]
        comp = 0.001 * (i + 1)
        comm = 0.0002 * (i % 3)
        layers.append({"layer": i, "kinds": ["conv"], "exact_keys": [key], "predicted": {
            "fwd_compute_s": comp / 3, "bwd_compute_s": 2 * comp / 3, "fwd_comm_s": comm, "bwd_comm_s": 0.0}})
        m = shapes[key] * comp + blocking * comm
        measured.append({"layer": i, "measured_s": m * (1 + (noise[i] if noise else 0.0))})
    layers.append({"layer": n, "kinds": ["batch_norm"], "exact_keys": [], "predicted": {
        "fwd_compute_s": 1e-4, "bwd_compute_s": 0.0, "fwd_comm_s": 0.004, "bwd_comm_s": 0.0}})
    measured.append({"layer": n, "measured_s": 1e-4 + blocking * 0.004})
    compute = sum(m["measured_s"] for m in measured)
    pred_total = sum(sum(l["predicted"].values()) for l in layers) + exposed
    step = compute + grad * exposed
    plan = {"world_size": world, "layers": layers, "transitions": [],
            "predicted": {"step_time_s": pred_total, "exposed_comm_s": exposed, "optimizer_s": 0.0}}
    run = {"plan": f"w{world}", "measured": {"step_time_s": step, "per_layer": measured,
           "phases": {"fwd_s": compute / 3, "bwd_s": 2 * compute / 3, "grad_sync_wait_s": grad * exposed,
                      "optimizer_s": 0.0}}}
    return plan, run


def _typed(plan):
    """The fields of a typed plan (``autopar.artifacts.Plan``) that refinement reads."""
    from types import SimpleNamespace as NS

    from autopar.artifacts import LayerPrice
    return NS(world_size=plan["world_size"], mesh=NS(ranks_per_node=plan["world_size"]), transitions=(),
              layers=tuple(NS(layer=lay["layer"], exact_keys=tuple(lay["exact_keys"]),
                              predicted=LayerPrice.from_json(lay["predicted"])) for lay in plan["layers"]),
              predicted=NS(**plan["predicted"]))


def _result(run, plan):
    """The typed run (``autopar.artifacts.RunResult``, what refinement reads) of a synthetic run."""
    from autopar.artifacts import RunResult
    return RunResult.from_json(_run_file_json(run, plan))


def test_fit_recovers_exact_blocking_and_grad_sync_factors():
    truth = {"a": 1.3, "b": 0.8, "c": 1.1}
    rows = [run_rows(_result(r, p), _typed(p)) for p, r in (_plan_and_run(2, truth, 2.5, 0.6), _plan_and_run(4, truth, 2.5, 0.6))]
    corr = fit(rows, ("exact", "blocking", "grad_sync"))
    for k, f in truth.items():
        assert corr.exact[k] == pytest.approx(f, rel=1e-3)
    assert corr.blocking == pytest.approx(2.5, rel=1e-3)
    assert corr.grad_sync == pytest.approx(0.6, rel=1e-6)
    # the corrected model reproduces what was measured
    for r in rows:
        assert r.predict_s(corr) == pytest.approx(r.step_measured_s, rel=1e-3)
    # kinds not asked for stay 1
    only = fit(rows, ("grad_sync",))
    assert only.exact == {} and only.blocking == 1.0 and only.drift == {}


def test_drift_per_world_prices_shapes_no_run_measured():
    rows = [run_rows(_result(r, p), _typed(p)) for p, r in (_plan_and_run(2, {"a": 1.5, "b": 1.5}, 1.0, 1.0),
                                        _plan_and_run(4, {"a": 0.8, "b": 0.8}, 1.0, 1.0))]
    corr = fit(rows, ("exact", "drift"))
    assert corr.drift == pytest.approx({"2": 1.5, "4": 0.8}, rel=1e-3)
    assert corr.compute_factor(["unseen"], 2) == pytest.approx(1.5, rel=1e-3)
    assert corr.compute_factor(["a"], 4) == pytest.approx(0.8, rel=1e-3)
    assert corr.compute_factor(["a"], 8) == pytest.approx(1.0, rel=1e-3)   # no run at 8: no drift


def test_cross_validation_picks_nothing_when_the_profile_is_right_and_factors_when_wrong():
    noise = [0.03, -0.02, 0.01, -0.03, 0.02, 0.0, -0.01, 0.02]
    right = [run_rows(_result(r, p), _typed(p)) for p, r in (_plan_and_run(w, {"a": 1.0, "b": 1.0}, 1.0, 1.0, noise=noise)
                                         for w in (2, 4, 2, 4))]
    cv = cross_validate(right)
    assert len(cv["table"]) == 16
    assert cv["chosen_loo_median_abs_error"] <= cv["uncorrected_loo_median_abs_error"]
    wrong = [run_rows(_result(r, p), _typed(p)) for p, r in (_plan_and_run(w, {"a": 1.4, "b": 1.4}, 2.0, 1.0, noise=noise)
                                         for w in (2, 4, 2, 4))]
    cv = cross_validate(wrong)
    assert cv["chosen"], "a systematic error must be corrected"
    assert cv["chosen_loo_median_abs_error"] < 0.5 * cv["uncorrected_loo_median_abs_error"]


def _with_exact(profile):
    profile.exact["conv k"] = {"fwd": 1e-3, "bwd_data": 2e-3, "bwd_filter": 3e-3}
    profile.exact["conv other"] = {"fwd": 1e-3, "bwd_data": 2e-3, "bwd_filter": 3e-3}
    return "conv k"


def test_apply_scales_exact_entries_and_stores_comm_factors(profile):
    key = _with_exact(profile)
    corr = Corrections(exact={key: 2.0}, blocking=1.7, grad_sync=0.5)
    new = apply_corrections(profile, corr)
    for ph, t in profile.exact[key].items():
        assert new.exact[key][ph] == pytest.approx(2 * t)
    assert new.exact["conv other"] == profile.exact["conv other"]
    assert new.samples["corrections"] == {"blocking_comm_scale": 1.7, "grad_sync_scale": 0.5}   # no drift
    assert "corrections" not in profile.samples  # the original is untouched
    from autopar.cost import primitives as prim
    from autopar.decomp.base import CostContext
    ctx0 = CostContext(profile=profile, world=4, ranks_per_node=4)
    ctx1 = CostContext(profile=new, world=4, ranks_per_node=4)
    assert prim.blocking_s(ctx1, "allreduce", 4, 1e4, "intra") == pytest.approx(
        1.7 * prim.blocking_s(ctx0, "allreduce", 4, 1e4, "intra"))
    assert prim.grad_sync_time_s(ctx1, 1e6, range(4)) == pytest.approx(0.5 * prim.grad_sync_time_s(ctx0, 1e6, range(4)))


def test_drift_scales_compute_of_its_world_only(profile):
    from autopar.cost import primitives as prim
    key = _with_exact(profile)
    corr = Corrections(exact={key: 2.0}, drift={"2": 1.5})
    new = apply_corrections(profile, corr)
    assert new.samples["corrections"]["compute_drift"] == {"2": 1.5}
    assert prim.compute_drift(new, 2) == 1.5 and prim.compute_drift(new, 4) == 1.0
    assert prim.compute_drift(profile, 2) == 1.0
    for ph, t in profile.exact[key].items():   # a corrected entry: its own factor
        assert new.exact[key][ph] == pytest.approx(2 * t)
    assert new.exact["conv other"] == profile.exact["conv other"]


def test_scaling_sweep_has_three_series(tmp_path, root, profile):
    from autopar.profile import save_profile
    from autopar.sweep import plot, sweep
    pf = tmp_path / "p.json"
    save_profile(profile, pf)
    res = sweep(root / "strategies/examples/cnn3d_large.py", [1, 2, 4, 8], 2, str(pf))
    assert set(res["series"]) == {"sample-only", "spatial-only", "hybrid (ILP, all kinds)"}
    hyb = {p["world"]: p["step_time_s"] for p in res["series"]["hybrid (ILP, all kinds)"]}
    samp = {p["world"]: p["step_time_s"] for p in res["series"]["sample-only"]}
    # the ILP's hybrid is never predicted slower than sample-only (it can choose it)
    assert all(hyb[w] <= samp[w] * (1 + 1e-9) for w in samp if w in hyb)
    assert plot(res, tmp_path / "s.png").is_file()


def _op(name, inp, kind="conv"):
    return {"name": name, "kind": kind, "target": "aten.relu.default", "args": [{"v": inp}], "kwargs": {},
            "out_shape": [4, 8], "dtype": "float32", "inputs": [inp], "in_shapes": [[4, 8]], "params": {},
            "param_names": {}}


def _plan_file_json(plan):
    """A loadable (schema-2, checked) plan around the synthetic ``plan`` of ``_plan_and_run``:
    a chain of replicated layers whose predictions and exact keys are the synthetic ones."""
    from autopar.artifacts import PLAN_SCHEMA
    w = plan["world_size"]
    layers, glayers = [], []
    for i, l in enumerate(plan["layers"]):
        inp = "x" if i == 0 else f"v{i - 1}"
        glayers.append({"index": i, "name": f"v{i}", "module": f"m{i}", "inputs": [inp], "output": f"v{i}",
                        "ops": [_op(f"v{i}", inp, l["kinds"][0])]})
        layers.append({**l, "name": f"v{i}", "module": f"m{i}", "out_shape": [4, 8],
                       "decomposition": {"kind": "replicate"}, "choice": "replicate",
                       "in_placements": {inp: {"mesh": {"shape": [w], "names": ["replica"]}, "placements": ["Replicate()"]}},
                       "source": "fit"})
    return {**plan, "schema": PLAN_SCHEMA, "layers": layers,
            "model": {"path": "m.py", "sha256": "0" * 64, "name": "m", "batch_size": 4},
            "mesh": {"world_size": w, "ranks_per_node": w, "nodes": 1},
            "calibration": {}, "solver": {"solver": "highs", "status": "Optimal"},
            "graph": {"model_name": "m", "batch_size": 4, "output": f"v{len(layers) - 1}",
                      "inputs": [{"name": "x", "shape": [4, 8], "dtype": "float32"}], "layers": glayers},
            "generated": "x.py"}


def _run_file_json(run, plan):
    from autopar.artifacts import RUN_SCHEMA
    per_layer = [{**m, "module": f"m{m['layer']}", "choice": "replicate", "measured_fwd_s": m["measured_s"] / 3,
                  "measured_bwd_s": 2 * m["measured_s"] / 3, "predicted_s": 0.0} for m in run["measured"]["per_layer"]]
    return {**run, "schema": RUN_SCHEMA, "model": "m", "world_size": plan["world_size"], "backend": "gloo",
            "batch_size": 4, "decompositions": ["replicate"],
            "validation": {"passed": True, "dtype": "float64", "rtol": 1e-9, "atol": 1e-12, "rule": "", "checked": 0,
                           "checks": []},
            "measured": {**run["measured"], "per_layer": per_layer, "step_times_s": [run["measured"]["step_time_s"]],
                         "grad_sync_bytes_per_step": 0},
            "predicted": plan["predicted"], "prediction_error": 0.0, "baseline": {}, "ratio_to_ddp": None,
            "wall_s": 1.0}


def test_cli_refine_from_run_files(tmp_path, profile, monkeypatch, capsys):
    import json

    from autopar.profile import load_profile, save_profile
    from autopar.cli import main
    from autopar.io import sha256_file
    monkeypatch.chdir(tmp_path)
    pf = tmp_path / "p.json"
    save_profile(profile, pf)
    truth = {"a": 1.3, "b": 0.9}
    paths = []
    for i, w in enumerate((2, 4, 2, 4)):
        plan, run = _plan_and_run(w, truth, 2.0, 0.7)
        d = tmp_path / f"r{i}"
        d.mkdir()
        (d / "plan.json").write_text(json.dumps(_plan_file_json(plan)))
        run["plan"] = f"r{i}/plan.json"
        run["plan_sha256"] = sha256_file(d / "plan.json")
        (d / "run.json").write_text(json.dumps(_run_file_json(run, plan)))
        paths.append(str(d))
    assert main(["refine", str(pf), *paths, "-o", "ref.json", "--no-report"]) == 0
    out = capsys.readouterr().out
    assert "cross-validated over 4 runs" in out
    ref = load_profile(tmp_path / "ref.json", check_machine=False)
    info = ref.provenance["refined"]
    assert info["kinds"], "a systematic error must be learned"
    assert info["cross_validation"]["chosen_loo_median_abs_error"] < info["cross_validation"]["uncorrected_loo_median_abs_error"]
    assert load_profile(pf, check_machine=False).samples.get("corrections") is None   # input untouched
    # a plan changed after its run is refused, by name
    (tmp_path / "r0/plan.json").write_text((tmp_path / "r0/plan.json").read_text() + " ")
    assert main(["refine", str(pf), *paths, "-o", "ref2.json", "--no-report"]) == 2
    assert "changed since run" in capsys.readouterr().err
    # a run file that is not a run is refused, by name
    (tmp_path / "r1/run.json").write_text(json.dumps({"plan": "r1/plan.json"}))
    assert main(["refine", str(pf), *paths[1:], "-o", "ref3.json", "--no-report"]) == 2
    assert "RunFileError" in capsys.readouterr().err
