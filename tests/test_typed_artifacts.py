"""Typed artifacts, finished (issue 39 item 5): a plan's calibration, placement search, batch-norm
statistics, illegal candidates and trainer-level prediction, and a run's placement and options,
are typed values; every record's unknown keys are a read-only ``JsonObject``; and the files read
and write exactly as before (load -> write gives the same JSON, byte for byte once written by
this schema)."""

import json
import warnings
from pathlib import Path

import pytest

from autopar.artifacts import (CalibrationRef, JsonObject, PlacementSearchRecord, PlacementTrialRecord, Plan,
                               PlanMigrated, RunResult, TournamentRun, TrainerLevel, TrainerPrediction,
                               load_plan, load_run, write_plan, write_run)
from autopar.decomp.bn import BatchNormStats
from autopar.errors import PlanFileError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_PLANS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "strategies/plans").glob("*/plan.json"))
SHIPPED_RUNS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "reports").glob("*/run.json"))
#: plan.json keys this change typed; the migration (schema 2 -> 3) touches none of them
TYPED_KEYS = ("calibration", "placement_search", "batch_norm", "trainers", "runtime", "solver", "predicted",
              "model", "timings_s", "padding", "options", "strategies")


def _load_quietly(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanMigrated)
        return load_plan(path)


def _in_tmp(root, rel, tmp_path) -> Path:
    """The shipped plan copied to ``tmp_path``, its model path made absolute."""
    obj = json.loads((root / rel).read_text())
    obj["model"]["path"] = str((root / rel).parent.joinpath(obj["model"]["path"]).resolve())
    f = tmp_path / "in" / "plan.json"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(obj))
    return f


def test_there_are_shipped_artifacts_to_check():
    assert len(SHIPPED_PLANS) >= 10 and len(SHIPPED_RUNS) >= 10


@pytest.mark.parametrize("rel", SHIPPED_PLANS)
def test_shipped_plan_reads_typed_and_writes_what_it_read(root, rel, tmp_path):
    f = _in_tmp(root, rel, tmp_path)
    orig = json.loads(f.read_text())
    plan = _load_quietly(f)
    assert isinstance(plan.calibration, CalibrationRef) and isinstance(plan.batch_norm, BatchNormStats)
    assert isinstance(plan.extra, JsonObject)
    if "placement_search" in orig:
        ps = plan.placement_search
        assert isinstance(ps, PlacementSearchRecord) and all(isinstance(t, PlacementTrialRecord) for t in ps.tried)
        assert ps.chosen == orig["placement_search"]["chosen"]
        assert [t.name for t in ps.tried] == [t["name"] for t in orig["placement_search"]["tried"]]
    cal = orig["calibration"]
    assert plan.calibration.path == cal.get("path") and plan.calibration.fingerprint == cal.get("fingerprint")
    for d in plan.layers:
        assert isinstance(d.illegal, JsonObject) and all(isinstance(v, str) for v in d.illegal.values())
    j = plan.to_json()
    # the fields typed here come back as the file had them (key order included); the layers and
    # transitions only as the schema 2 -> 3 migration rewrites their placements
    for k in TYPED_KEYS:
        assert (k in j) == (k in orig), k
        if k in orig:
            assert json.dumps(j[k]) == json.dumps(orig[k]), k
    assert [d["illegal"] for d in j["layers"]] == [d.get("illegal", {}) for d in orig["layers"]]
    assert {k: v for k, v in j.items() if k not in ("schema", "mesh", "layers", "transitions")} == \
        {k: v for k, v in orig.items() if k not in ("schema", "mesh", "layers", "transitions")}
    # transitions: as the file had them, under the placement keys (src_layout -> src_placement)
    rename = {"src_layout": "src_placement", "dst_layout": "dst_placement"}
    assert j.get("transitions") == [{rename.get(k, k): v for k, v in t.items()} for t in orig.get("transitions", [])]
    # schema 3, as written today: load -> write is the same file, byte for byte
    a = write_plan(plan, tmp_path / "a" / "plan.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = load_plan(a)
    assert again == plan
    b = write_plan(again, tmp_path / "b" / "plan.json")
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("rel", SHIPPED_RUNS)
def test_shipped_run_reads_typed_and_writes_what_it_read(root, rel, tmp_path):
    orig = json.loads((root / rel).read_text())
    run = load_run(root / rel)
    assert isinstance(run.placement, JsonObject) and isinstance(run.options, JsonObject)
    assert run.to_json() == orig
    a = write_run(run, tmp_path / "a.json")
    assert load_run(a) == run and write_run(load_run(a), tmp_path / "b.json").read_bytes() == a.read_bytes()


def test_unknown_keys_survive_at_every_level(root, tmp_path):
    f = _in_tmp(root, SHIPPED_PLANS[0], tmp_path)
    obj = _load_quietly(f).to_json()
    obj["future_top"] = {"a": [1, 2]}
    obj["calibration"]["future_cal"] = 1.5
    obj["placement_search"] = {"mode": "search", "chosen": {"kind": "stride", "local_stride": 1},
                               "chosen_name": "block", "tried": [{"name": "block", "solved": True,
                                                                  "future_trial": "x"}], "future_ps": None}
    obj["layers"][0]["future_layer"] = [3]
    obj["mesh"]["future_mesh"] = "m"
    plan = Plan.from_json(json.loads(json.dumps(obj)), "edited")
    assert plan.extra == {"future_top": {"a": [1, 2]}} and plan.calibration.extra == {"future_cal": 1.5}
    assert plan.placement_search.tried[0].extra == {"future_trial": "x"}
    assert plan.to_json() == obj


def test_json_objects_are_read_only_and_written_as_copies():
    o = JsonObject({"a": {"b": [1]}})
    with pytest.raises(TypeError):
        o["a"] = 2                                   # type: ignore[index]
    j = o.to_json()
    j["a"]["b"].append(2)
    assert o == {"a": {"b": [1]}} and isinstance(j, dict)
    with pytest.raises(TypeError, match="keys must be strings"):
        JsonObject({1: "x"})


def test_dicts_given_in_code_are_read_into_the_typed_values(root, tmp_path):
    """Callers that still build these records from dicts (the planner, the tournament) get the
    typed values, and the view by key keeps their reads working."""
    plan = _load_quietly(_in_tmp(root, SHIPPED_PLANS[0], tmp_path))
    import dataclasses
    p2 = dataclasses.replace(plan, calibration={"path": None, "fingerprint": {"host": "h"},
                                                "machine_speed": {"speed_factor": 1.25}},
                             placement_search={"mode": "block", "tried": [{"name": "block", "note": "n"}]},
                             batch_norm={"mode": "local", "group": 2}, extra={"k": 1})
    assert p2.calibration.speed_factor == 1.25 and p2.calibration.fingerprint == {"host": "h"}
    assert p2.calibration.to_json() == {"path": None, "fingerprint": {"host": "h"},
                                        "machine_speed": {"speed_factor": 1.25}}
    assert p2.calibration.machine_speed == {"speed_factor": 1.25} and p2.calibration.shapes is None
    assert "shapes" not in p2.calibration.to_json()
    assert p2.placement_search.tried[0].note == "n" and p2.batch_norm == BatchNormStats("local", 2)
    assert isinstance(p2.extra, JsonObject) and Plan.from_json(p2.to_json()) == p2


def test_trainer_prediction_is_typed_in_the_plan_and_the_run():
    pred = {"trainers": 2, "step_s": 0.01, "exchange_s": 0.002, "exchange_s_float32": 0.001,
            "samples_per_s": 800.0, "memory_per_rank_bytes": 1e6}
    tl = TrainerLevel(trainers=2, ranks_per_trainer=1, predicted=pred)
    assert isinstance(tl.predicted, TrainerPrediction) and tl.predicted.step_s == 0.01
    assert tl.predicted.extra == {"exchange_s_float32": 0.001}          # per-dtype figures by name
    assert tl.to_json()["predicted"] == pred and TrainerLevel.from_json(tl.to_json()) == tl
    # the dict reads of callers not yet moved
    assert tl.predicted.to_json() == pred and tl.predicted.extra["exchange_s_float32"] == 0.001
    run = {"schema": "autopar.tournament-run/1", "plan": "p.json", "model": "m", "trainers": 2,
           "ranks_per_trainer": 1, "world_size": 2, "options": {"rounds": 2},
           "predicted": {**pred, "priced_dtype": "float32"}, "future": 1}
    t = TournamentRun.from_json(run)
    assert isinstance(t.predicted, TrainerPrediction) and t.predicted.priced_dtype == "float32"
    assert isinstance(t.options, JsonObject) and t.to_json() == run


@pytest.mark.parametrize("bn, fld", [({"mode": "ghost"}, "batch_norm.mode"),
                                     ({"mode": "local", "group": "4"}, "batch_norm.group"),
                                     ({"mode": "local", "group": 3}, "batch_norm.group")])
def test_bad_batch_norm_is_refused_naming_the_field(root, tmp_path, bn, fld):
    plan = _load_quietly(_in_tmp(root, SHIPPED_PLANS[0], tmp_path))
    obj = plan.to_json()
    obj["batch_norm"] = bn
    if bn.get("group") == 3:
        obj["model"]["batch_size"] = 8                 # 3 does not divide it
    with pytest.raises(PlanFileError, match=fld.replace(".", r"\.")):
        Plan.from_json(obj, "edited")

