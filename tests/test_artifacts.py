"""Typed artifacts (``autopar.artifacts``): every artifact round-trips through JSON, a plan of the
previous schema is migrated (and says so), and hand-edited plans and run sets are refused on
load, naming the unit and the field, before any process starts."""

import copy
import dataclasses
import json
import time
import warnings

import pytest

from autopar.artifacts import (PLAN_SCHEMA, RUN_SCHEMA, Baseline, Check, LayerDecision, LayerTiming,
                               Measured, MeshInfo, Plan, PlanHooks, PlanMigrated, PlanOptions, Prediction,
                               RunFileError, RunResult, RunSet, SolverInfo, TransitionDecision, Validation,
                               load_plan, load_run, load_runset, write_plan, write_run, write_runset)
from autopar.decomp.sharding import Shard, Sharding, from_splits
from autopar.errors import AutoparError, PlanFileError

SHIPPED = "strategies/plans/cnn3d-w2/plan.json"   # world 2: its plan was made for this model file
# The cnn3d-w2 plan as schema 1 wrote it (commit 6dc16ab): spatial + sample + replicate layers,
# global batch-norm statistics. Kept under tests/ so that re-making the shipped plans (whose
# choices move with the cost model) does not move the cases below.
SCHEMA1 = "tests/data/cnn3d-w2-schema1-plan.json"


def _as_schema_1(obj: dict) -> dict:
    """A schema-2 plan written as the previous schema wrote it (no ``mesh.ranks``)."""
    old = copy.deepcopy(obj)
    old["schema"] = "autopar.plan/1"
    old["mesh"].pop("ranks", None)
    return old


@pytest.fixture
def shipped(root, tmp_path):
    """A schema-1 plan file (a user's plan made before the core redesign), its model path made
    absolute so that it loads from a temporary folder."""
    f = tmp_path / "schema1" / "plan.json"
    f.parent.mkdir()
    obj = json.loads((root / SCHEMA1).read_text())
    obj["model"]["path"] = str((root / SHIPPED).parent.joinpath(obj["model"]["path"]).resolve())
    f.write_text(json.dumps(obj))
    return f


@pytest.fixture
def plan(shipped) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanMigrated)
        return load_plan(shipped)


@pytest.fixture
def plan_json(plan) -> dict:
    return plan.to_json()


def _write(tmp_path, obj, name="plan.json"):
    f = tmp_path / name
    f.write_text(json.dumps(obj))
    return f


# ---- round trips ----------------------------------------------------------------------------

def test_plan_round_trips_and_keeps_every_field(plan, shipped, tmp_path):
    orig = json.loads(shipped.read_text())
    j = plan.to_json()
    # schema 2 adds mesh.ranks, schema 3 writes layouts as placements on named mesh axes; every
    # other field of the schema-1 file is kept as it was
    assert j["schema"] == PLAN_SCHEMA and j["mesh"]["ranks"] == [0, 1]
    assert set(orig) <= set(j)
    for k in orig:
        if k not in ("schema", "mesh", "layers", "transitions"):
            assert j[k] == orig[k], k
    assert j["transitions"] == [_renamed(t) for t in orig["transitions"]]
    for old, new in zip(orig["layers"], j["layers"]):
        assert {k: v for k, v in old.items() if k not in ("in_layouts", "out_layout")} == \
            {k: v for k, v in new.items() if k not in ("in_placements", "out_placement")}
        assert new["out_placement"] == from_splits(old["out_layout"]).to_json(2)
    assert {k: v for k, v in j["mesh"].items() if k != "ranks"} == orig["mesh"]
    assert Plan.from_json(j) == plan
    f = write_plan(plan, tmp_path / "p" / "plan.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # schema 2: no migration warning
        assert load_plan(f) == plan
    assert plan.graph().layers[3].index == 3 and len(plan.graph().layers) == len(plan.layers)
    assert plan.graph() is not plan.graph()      # built anew on each call
    assert plan.placement().is_identity and plan.layer(0).decomposition().kind == "spatial"


def test_parts_round_trip(plan):
    d = plan.layers[5]
    assert LayerDecision.from_json(d.to_json(2)) == d and d.fwd_s > 0 and d.kind == "sample"
    t = plan.transitions[0]
    assert TransitionDecision.from_json(t.to_json()) == t
    assert MeshInfo.from_json(plan.mesh.to_json()) == plan.mesh == MeshInfo(2, 4, 1)
    assert SolverInfo.from_json(plan.solver.to_json()) == plan.solver
    assert Prediction.from_json(plan.predicted.to_json()) == plan.predicted
    # a key another stage adds survives the round trip
    p = Prediction.from_json({**plan.predicted.to_json(), "energy_j": 3.0})
    assert p.extra == {"energy_j": 3.0} and p.to_json()["energy_j"] == 3.0


def _run(plan) -> RunResult:
    checks = (Check("output", True, 0.0, 1.0, 0.0), Check("grad:w", False, 1.0, 2.0, 0.5))
    return RunResult(
        plan="p/plan.json", plan_sha256="ab" * 32, model="cnn3d_large", world_size=2, backend="gloo",
        placement={"kind": "stride", "local_stride": 1}, batch_size=4, options={"steps": 2},
        decompositions=tuple(plan.decompositions()),
        validation=Validation(passed=False, dtype="float64", rtol=1e-9, atol=1e-12, rule="r", checked=2,
                              checks=checks),
        measured=Measured(step_time_s=0.1, step_times_s=(0.1, 0.11), phases={"fwd_s": 0.03},
                          per_layer=(LayerTiming(0, "block1.conv", "spatial(1,2x1x1)", 0.01, 0.004, 0.006, 0.012,
                                                 "exact"),), grad_sync_bytes_per_step=100),
        predicted=plan.predicted, prediction_error=0.2,
        baseline=Baseline((0.2, 0.21), 0.2, 1000, False, "ddp"), ratio_to_ddp=0.5, wall_s=3.0)


def test_run_round_trips(plan, tmp_path):
    run = _run(plan)
    j = run.to_json()
    assert j["schema"] == RUN_SCHEMA and [c["tensor"] for c in j["validation"]["failures"]] == ["grad:w"]
    assert RunResult.from_json(j) == run
    write_run(run, tmp_path / "r" / "run.json")
    assert load_run(tmp_path / "r") == run
    no_base = dataclasses.replace(run, baseline=None, ratio_to_ddp=None)
    assert no_base.to_json()["baseline"] == {} and RunResult.from_json(no_base.to_json()) == no_base


def test_a_failed_run_with_nan_and_infinite_differences_is_still_written(plan, tmp_path):
    """A NaN gradient or a shape mismatch gives non-finite figures; run.json is strict JSON, so they
    are written as strings and read back as floats (the run writing it used to raise instead)."""
    import math
    bad = (Check("grad:w", False, math.nan, 1.0, math.nan), Check("param:b", False, math.inf, 0.0, math.inf))
    run = dataclasses.replace(_run(plan), validation=dataclasses.replace(_run(plan).validation, checks=bad))
    write_run(run, tmp_path / "r" / "run.json")
    back = load_run(tmp_path / "r")
    c0, c1 = back.validation.checks
    assert math.isnan(c0.max_abs_diff) and math.isnan(c0.rel) and c1.max_abs_diff == math.inf
    assert '"max_abs_diff": "nan"' in (tmp_path / "r" / "run.json").read_text()


def test_run_of_another_schema_is_refused(plan, tmp_path):
    j = _run(plan).to_json()
    j["schema"] = "autopar.run/0"
    with pytest.raises(RunFileError, match="execute the plan again"):
        load_run(_write(tmp_path, j, "run.json"))
    del j["schema"], j["measured"]
    with pytest.raises(RunFileError):
        load_run(_write(tmp_path, j, "run.json"))


def test_plan_options_round_trip_and_hooks_are_apart():
    o = PlanOptions(world_size=4, kinds=["sample", "spatial"], memory_limit_bytes=2.0**30, placement=2)
    assert o.kinds == ("sample", "spatial")
    assert PlanOptions.from_json(json.loads(json.dumps(o.to_json()))) == o
    assert not {"force", "choice_filter", "profile", "graph", "progress"} & set(o.to_json())
    assert {f.name for f in dataclasses.fields(PlanHooks)} == {"force", "choice_filter", "profile", "graph", "progress"}
    with pytest.raises(AutoparError, match="world size must be"):
        PlanOptions(world_size=0)
    with pytest.raises(AutoparError, match="unknown planning options"):
        PlanOptions.from_json({"world_size": 2, "force": {}})


# ---- schema 1 -------------------------------------------------------------------------------

def test_schema_1_plans_are_migrated_with_a_warning_naming_the_file(root, tmp_path):
    files = sorted((root / "strategies/plans").glob("*/plan.json"))
    assert files
    for i, shipped in enumerate(files):
        f = tmp_path / f"p{i}" / "plan.json"
        f.parent.mkdir()
        f.write_text(json.dumps(_as_schema_1(json.loads(shipped.read_text()))))
        with pytest.warns(PlanMigrated, match=f"{f}.*autopar.plan/1 migrated to autopar.plan/3"):
            p = load_plan(f)
        assert p.schema == PLAN_SCHEMA and p.mesh.ranks == tuple(range(p.world_size))


@pytest.mark.parametrize("schema", ["autopar.plan/0", "autopar.plan/4", "something"])
def test_other_schemas_are_refused_saying_to_replan(plan_json, tmp_path, schema):
    plan_json["schema"] = schema
    with pytest.raises(PlanFileError, match="re-plan") as e:
        load_plan(_write(tmp_path, plan_json))
    assert schema in str(e.value)


# ---- hand-edited plans ----------------------------------------------------------------------

def _sh(shape, names, placements):
    """A hand-written placement record (the plan file's form)."""
    return {"mesh": {"shape": shape, "names": names}, "placements": placements}


def test_schema_2_layouts_are_migrated_or_refused_naming_the_field(root, tmp_path):
    """A plan of the previous schema ([[dim, parts], ...] layouts) loads as the same plan, with
    a warning naming the file; a layout that cannot be read is refused naming the field."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PlanMigrated)
        want = load_plan(root / SHIPPED)
    old = copy.deepcopy(want.to_json())
    old["model"]["path"] = str((root / SHIPPED).parent.joinpath(old["model"]["path"]).resolve())
    old["schema"] = "autopar.plan/2"
    for d in old["layers"]:
        ins = d.pop("in_placements", None) or {}
        d["in_layouts"] = {v: _as_splits(sj) for v, sj in ins.items()}
        d["out_layout"] = _as_splits(d.pop("out_placement"))
    f = _write(tmp_path, old, "old.json")
    with pytest.warns(PlanMigrated, match=f"{f}.*autopar.plan/2 migrated to autopar.plan/3"):
        assert load_plan(f).layers == want.layers
    old["layers"][2]["out_layout"] = [["x", 2]]
    with pytest.raises(PlanFileError, match=r"layers\[2\].out_layout: \[\['x', 2\]\] cannot be migrated"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PlanMigrated)
            load_plan(_write(tmp_path, old, "bad.json"))


def _renamed(t: dict) -> dict:
    """A transition record with the placement keys plans now write (``src_placement``/``dst_placement``)."""
    return {{"src_layout": "src_placement", "dst_layout": "dst_placement"}.get(k, k): v for k, v in t.items()}


def _old_transition_keys(obj: dict) -> dict:
    """``obj`` (a plan's JSON) with its transitions under the keys plans wrote before the rename."""
    old = copy.deepcopy(obj)
    back = {"src_placement": "src_layout", "dst_placement": "dst_layout"}
    old["transitions"] = [{back.get(k, k): v for k, v in t.items()} for t in old["transitions"]]
    return old


def test_transitions_name_placements_and_old_keys_are_migrated_naming_the_file(plan, tmp_path):
    """A new plan writes ``src_placement``/``dst_placement`` and reads back silently; a schema-3
    plan written with the old ``src_layout``/``dst_layout`` loads as the same plan, with a warning
    naming the file and the rename; a schema-2 plan with them too, and re-writes in the new form
    losslessly."""
    j = plan.to_json()
    assert j["transitions"] and all("src_placement" in t and "dst_placement" in t and "src_layout" not in t
                                    and "dst_layout" not in t for t in j["transitions"])
    assert plan.transitions[0].src_placement == j["transitions"][0]["src_placement"]
    f = write_plan(plan, tmp_path / "new" / "plan.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_plan(f) == plan
    n = len(j["transitions"])
    f3 = _write(tmp_path, _old_transition_keys(j), "schema3-old-keys.json")
    with pytest.warns(PlanMigrated, match=rf"{f3}: plan completed on load .*{n} transition\(s\)' "
                                          r"src_layout/dst_layout renamed src_placement/dst_placement"):
        assert load_plan(f3) == plan
    old2 = _old_transition_keys(j)
    old2["schema"] = "autopar.plan/2"
    f2 = _write(tmp_path, old2, "schema2-old-keys.json")
    with pytest.warns(PlanMigrated, match=rf"{f2}: plan of schema autopar.plan/2 .*src_layout/dst_layout renamed"):
        p2 = load_plan(f2)
    assert p2 == plan
    again = write_plan(p2, tmp_path / "rewritten" / "plan.json")
    assert json.loads(again.read_text())["transitions"] == j["transitions"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_plan(again) == plan


def _as_splits(sj):
    """The schema-2 form of a placement record (what the plans shipped before schema 3 hold)."""
    sh = Sharding.from_json(sj)
    splits = [[p.dim, n] for p, n in zip(sh.placements, sh.sizes) if isinstance(p, Shard)]
    return {"splits": splits, "partial": sh.partial_parts} if sh.is_partial else splits


def _edit(plan_json, fn):
    d = copy.deepcopy(plan_json)
    fn(d)
    return d


CASES = {
    "rank beyond the world": (lambda d: d["mesh"].update(ranks=[0, 2]),
                              r"mesh, field mesh.ranks: ranks \[2\] are outside the world of 2"),
    "rank twice": (lambda d: d["mesh"].update(ranks=[1, 1]), r"mesh, field mesh.ranks: ranks \[1\] appear more than once"),
    "ranks of another world": (lambda d: d["mesh"].update(ranks=[0]), "mesh, field mesh.ranks: 1 ranks for a world of 2"),
    "input not covered": (lambda d: d["layers"][5]["in_placements"].pop("relu_2"),
                          r"layer 5 \(\S+\), field layers\[5\].in_placements: misses input value 'relu_2'"),
    "dim the tensor lacks": (lambda d: d["layers"][9]["in_placements"].update(adaptive_avg_pool3d=_sh([2], ["N"], ["Shard(7)"])),
                             r"layer 9 \(\S+\), field layers\[9\].in_placements\['adaptive_avg_pool3d'\]: "
                             r"Shard\(7\) on mesh axis 'N' splits dim 7, but the tensor \[4, 32, 1, 1, 1\] has 5 dims"),
    "more parts than extent": (lambda d: d["layers"][0]["in_placements"].update(x=_sh([2], ["C"], ["Shard(1)"])),
                               r"layer 0 \(block1.conv\), field layers\[0\].in_placements\['x'\]: Shard\(1\) splits "
                               r"dim 1 of extent 1 into 2 parts"),
    "padded extent too small": (lambda d: d["layers"][0]["in_placements"].update(x=_sh([2], ["N"], ["PaddedShard(0, 2)"])),
                                r"layer 0 \(block1.conv\), field layers\[0\].in_placements\['x'\]: PaddedShard\(0, 2\) "
                                r"on mesh axis 'N': the padded extent must be at least dim 0's extent 4"),
    "mesh of another world": (lambda d: d["layers"][3].update(out_placement=_sh([4], ["N"], ["Shard(0)"])),
                              r"layer 3 \(block3.conv\), field layers\[3\].out_placement.mesh.shape: \[4\] holds 4 "
                              r"ranks, but the plan's world is 2 ranks"),
    "mesh ranks outside the world": (lambda d: d["layers"][3]["out_placement"]["mesh"].update(ranks=[0, 5]),
                                     r"layer 3 \(block3.conv\), field layers\[3\].out_placement.mesh.ranks: ranks "
                                     r"\[5\] are outside the world of 2"),
    "axis the mesh lacks": (lambda d: d["layers"][3].update(out_placement={"mesh": {"shape": [2], "names": ["N"]},
                                                                           "placements": {"H": "Shard(2)"}}),
                            r"layer 3, field out_placement.placements: names mesh axis 'H', which the mesh \['N'\] lacks"),
    "blocks do not divide the world": (lambda d: d["layers"][3].update(out_placement=_sh([3, 1], ["N", "x"], ["Shard(0)", "Replicate()"])),
                                       r"layer 3 \(block3.conv\), field layers\[3\].out_placement.mesh.shape: \[3, 1\] "
                                       r"holds 3 ranks, but the plan's world is 2"),
    "unknown kind": (lambda d: d["layers"][7]["decomposition"].update(kind="diagonal"),
                     r"layer 7 \(block5.conv\), field layers\[7\].decomposition.kind: unknown decomposition "
                     r"kind 'diagonal'"),
    "layout not the decomposition's": (lambda d: d["layers"][7].update(out_placement=_sh([2], ["N"], ["Shard(0)"])),
                                       r"layer 7 \(block5.conv\), field layers\[7\].out_placement: is \(N:2\)\[Shard\(0\)\] "
                                       r"but decomposition replicate writes \[Replicate\(\)\]"),
    "decomposition edited": (lambda d: d["layers"][4]["decomposition"].update(kind="replicate"),
                             r"layer 4 \(block4.conv\), field layers\[4\].in_placements\['relu_2'\]: is "
                             r"\(N:2\)\[Shard\(0\)\] but decomposition replicate reads the tensor as \[Replicate\(\)\]"),
    "layer left out": (lambda d: d["layers"].pop(2), r"layers \[2\], field layers: the graph has these layers"),
    "bad placement": (lambda d: d["mesh"].update(placement={"kind": "hilbert"}),
                      "mesh, field mesh.placement: unknown placement"),
    "transition to nowhere": (lambda d: d["transitions"][0].update(dst=99),
                              r"transition 0 \(\S+\), field transitions\[0\].dst: layer 99 is not in"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hand_edited_plan_is_refused_naming_unit_and_field(plan_json, tmp_path, case):
    fn, msg = CASES[case]
    f = _write(tmp_path, _edit(plan_json, fn))
    with pytest.raises(PlanFileError, match=msg) as e:
        load_plan(f)
    assert str(f) in str(e.value) and "re-plan" in e.value.hint


def test_cli_execute_refuses_a_bad_plan_before_any_process_starts(plan_json, tmp_path, capsys):
    from autopar.cli import main
    f = _write(tmp_path, _edit(plan_json, CASES["input not covered"][0]))
    t = time.perf_counter()
    assert main(["execute", str(f)]) == 2
    err = capsys.readouterr().err
    assert "PlanFileError" in err and "layers[5].in_placements" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and time.perf_counter() - t < 10


def test_distmodel_checks_a_plan_dict(plan_json):
    """An older generated module hands DistModel a dict: it is checked like a file."""
    from autopar.runtime.model import DistModel
    bad = _edit(plan_json, CASES["unknown kind"][0])
    with pytest.raises(PlanFileError, match="unknown decomposition kind"):
        DistModel(bad, None, comm=_FakeComm())


class _FakeComm:
    world = 2
    rank = 0


# ---- run sets -------------------------------------------------------------------------------

def _runset(tmp_path, plan, entries, world=4):
    write_plan(plan, tmp_path / "a" / "plan.json")
    write_plan(plan, tmp_path / "b" / "plan.json")
    obj = {"schema": "autopar.runset/1", "world_size": world,
           "plans": [{"plan": p, "ranks": r} for p, r in entries]}
    return _write(tmp_path, obj, "runset.json")


def test_runset_round_trips_and_places_each_plan(plan, tmp_path):
    f = _runset(tmp_path, plan, [("a/plan.json", [0, 1]), ("b/plan.json", [3, 2])])
    rs = load_runset(f)
    assert rs.world_size == 4 and [e.ranks for e in rs.entries] == [(0, 1), (3, 2)]
    assert rs.entries[1].plan.mesh.ranks == (3, 2) and rs.entries[1].plan.world_size == 2
    out = write_runset(rs, tmp_path / "copy.json")
    assert json.loads(out.read_text()) == json.loads(f.read_text())
    assert load_runset(out) == rs
    assert isinstance(rs, RunSet)


def test_runset_with_overlapping_sub_meshes_names_both_plans(plan, tmp_path):
    f = _runset(tmp_path, plan, [("a/plan.json", [0, 1]), ("b/plan.json", [1, 2])])
    with pytest.raises(PlanFileError, match=r"plans\[0\] \(.*a/plan.json\) and plans\[1\] \(.*b/plan.json\), "
                                            r"field plans\[1\].ranks: sub-meshes overlap on ranks \[1\]"):
        load_runset(f)


@pytest.mark.parametrize("entries,msg", [
    ([("a/plan.json", [0, 4])], r"field plans\[0\].ranks: ranks \[4\] are outside the world of 4"),
    ([("a/plan.json", [2, 2])], r"field plans\[0\].ranks: ranks \[2\] appear more than once"),
    ([("a/plan.json", [0, 1, 2])], r"field plans\[0\].ranks: 3 ranks for a plan made for world size 2"),
    ([("nowhere/plan.json", [0, 1])], "plan file not found"),
])
def test_bad_runsets_are_named(plan, tmp_path, entries, msg):
    with pytest.raises(PlanFileError, match=msg):
        load_runset(_runset(tmp_path, plan, entries))


def test_runset_of_another_schema(tmp_path):
    with pytest.raises(PlanFileError, match="autopar.runset/1"):
        load_runset(_write(tmp_path, {"schema": "x", "world_size": 2, "plans": []}, "rs.json"))


def test_plan_of_decisions_only_gets_the_decompositions_layouts(plan):
    """What calibrate.overhead hands DistModel: world size, graph, one decomposition per layer."""
    from autopar.artifacts import plan_from_decisions
    obj = {"world_size": 2, "graph": dict(plan.graph_json),
           "layers": [{"layer": d.layer, "decomposition": d.decomposition_ref.to_json()} for d in plan.layers]}
    p = plan_from_decisions(obj)
    assert [(d.in_placements, d.out_placement) for d in p.layers] == [(d.in_placements, d.out_placement) for d in plan.layers]
    obj["layers"][0]["decomposition"] = {"kind": "diagonal"}
    with pytest.raises(PlanFileError, match="diagonal"):
        plan_from_decisions(obj)


def test_cli_check_names_the_fault_or_says_ok(plan, plan_json, tmp_path, capsys):
    from autopar.cli import main
    good = write_plan(plan, tmp_path / "good" / "plan.json")
    rs = _runset(tmp_path, plan, [("a/plan.json", [0, 1]), ("b/plan.json", [2, 3])])
    assert main(["check", str(good), str(rs)]) == 0
    out = capsys.readouterr().out
    assert "for world 2" in out and "ok" in out and "run set of 2 plans on 4 ranks" in out
    bad = _write(tmp_path, _edit(plan_json, CASES["blocks do not divide the world"][0]))
    assert main(["check", str(bad)]) == 2
    assert "layers[3].out_placement" in capsys.readouterr().err
