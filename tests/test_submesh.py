"""Plans on disjoint sub-meshes of one world: two different plans executed at once on the two
halves of a world of 4, each equal to its own single-process reference (float64)."""

from __future__ import annotations

import importlib.util

import pytest

from autopar.runtime.comm import Comm

pytestmark = pytest.mark.dist


def test_comm_maps_mesh_ranks_to_global_ranks():
    c = Comm(1, 2, ranks=(2, 3))
    assert c.global_rank(0) == 2 and c.global_rank(1) == 3
    with pytest.raises(ValueError, match="distinct"):
        Comm(0, 2, ranks=(2, 2))
    with pytest.raises(ValueError, match="increase"):
        Comm(0, 2, ranks=(3, 2))
    with pytest.raises(ValueError, match="2 ranks"):
        Comm(0, 2, ranks=(0, 1, 2))


def _plans(root, tmp_path, profile):
    """Two different plans of two ranks each: data parallel and spatial."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    model = root / "strategies/examples/resnet2d.py"
    out = []
    for name, kinds in (("sample", ["sample", "replicate"]), ("spatial", ["spatial", "replicate"])):
        r = make_plan(model, PlanOptions(world_size=2, batch_size=4, kinds=kinds,
                                         out_dir=tmp_path / name), PlanHooks(profile=profile))
        out.append(str(r.plan_path))
    return out


def test_two_plans_on_two_halves_each_equal_to_its_reference(root, tmp_path, profile):
    """``autopar execute RUNSET``: a data-parallel and a spatial plan at once on ranks {0, 1}
    and {2, 3} of a world of 4; each is validated (float64, every tensor) against its own
    single-process reference and timed on its own half."""
    import json

    from autopar.execute.runner import ExecuteOptions, execute_runset

    paths = _plans(root, tmp_path, profile)
    rs = tmp_path / "runset.json"
    rs.write_text(json.dumps({"schema": "autopar.runset/1", "world_size": 4,
                              "plans": [{"plan": paths[0], "ranks": [0, 1]},
                                        {"plan": paths[1], "ranks": [2, 3]}]}))
    runs, out = execute_runset(rs, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=180),
                               out_dir=tmp_path / "run", progress=lambda s: None)
    assert len(runs) == 2
    kinds = [sorted({str(d).split("(")[0] for d in r.decompositions}) for r in runs]
    assert "sample" in kinds[0] and "spatial" in kinds[1], kinds
    for r in runs:
        assert r.validation.passed, r.validation.failures
        assert r.validation.checked > 10 and r.world_size == 2
        assert r.measured.step_time_s > 0 and r.baseline is not None
    summary = json.loads((out / "runset.json").read_text())
    assert [p["ranks"] for p in summary["plans"]] == [[0, 1], [2, 3]]
    assert all(p["validation_passed"] for p in summary["plans"])


def test_plan_groups_cover_the_sub_mesh(root, tmp_path, profile):
    from autopar.artifacts import load_plan
    from autopar.runtime.model import plan_groups
    paths = _plans(root, tmp_path, profile)
    groups = plan_groups(load_plan(paths[1]), (2, 3))
    assert (2, 3) in groups and all(set(g) <= {2, 3} for g in groups)
