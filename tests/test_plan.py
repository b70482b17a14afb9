"""`autopar plan`: the plan artifact, the generated module, and named errors for bad input."""

import json
import py_compile

import pytest

from autopar.profile import save_profile
from autopar.cli import main
from autopar.artifacts import PLAN_SCHEMA, load_plan
from autopar.errors import PlanFileError


@pytest.fixture
def prof_file(tmp_path, profile):
    p = tmp_path / "prof.json"
    save_profile(profile, p)
    return p


def test_plan_writes_versioned_plan_and_module(tmp_path, root, prof_file, capsys):
    out = tmp_path / "plan"
    rc = main(["plan", str(root / "strategies/examples/resnet2d.py"), "--world-size", "4",
               "--calibration", str(prof_file), "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "predicted step time" in text and "sample(" in text
    plan = load_plan(out / "plan.json", world_size=4)
    assert plan.schema == PLAN_SCHEMA and plan.world_size == 4 and plan.mesh.ranks == (0, 1, 2, 3)
    assert plan.predicted.step_time_s > 0 and plan.predicted.memory_per_rank_bytes > 0
    assert plan.solver.status == "Optimal" and plan.solver.gap is not None
    assert plan.calibration.fingerprint["host"] == "synthetic"
    assert len(plan.layers) == len(plan.graph().layers)
    assert all(l.source and l.decomposition_ref.kind for l in plan.layers)
    assert json.loads((out / "plan.json").read_text())["schema"] == PLAN_SCHEMA
    mod = out / plan.generated
    py_compile.compile(str(mod), doraise=True)
    src = mod.read_text()
    assert "class PlannedModel(DistModel)" in src and "torchrun --nproc-per-node 4" in src
    assert "import pulp" not in src and "torch.export" not in src


def test_plan_simulated_world_needs_no_processes(tmp_path, root, prof_file):
    out = tmp_path / "big"
    assert main(["plan", str(root / "strategies/examples/resnet50.py"), "--world-size", "1024",
                 "--ranks-per-node", "8", "--calibration", str(prof_file), "-o", str(out)]) == 0
    plan = load_plan(out / "plan.json")
    mesh = plan.mesh
    assert (mesh.world_size, mesh.ranks_per_node, mesh.nodes) == (1024, 8, 128)
    # 128 nodes: the planner searched the rank placements and recorded why it kept this one
    tried = plan.placement_search.tried
    assert tried[0].name == "block" and len(tried) == 8 and mesh.placement_json == plan.placement_search.chosen
    assert plan.predicted.step_time_s == min(t.step_time_s for t in tried if t.solved)


def test_memory_limit_too_low_is_a_named_error(tmp_path, root, prof_file, capsys):
    rc = main(["plan", str(root / "strategies/examples/resnet2d.py"), "--world-size", "2",
               "--calibration", str(prof_file), "-o", str(tmp_path / "p"), "--memory-limit", "1KiB"])
    err = capsys.readouterr().err
    assert rc == 2 and "InfeasiblePlan" in err and "raise --memory-limit to at least" in err
    assert "Traceback" not in err


def test_missing_model_file_exit_2(tmp_path, capsys):
    rc = main(["plan", str(tmp_path / "none.py"), "--world-size", "2"])
    assert rc == 2 and "ModelFileError" in capsys.readouterr().err


def _plan_file(tmp_path, root, prof_file):
    out = tmp_path / "p"
    main(["plan", str(root / "strategies/examples/resnet2d.py"), "--world-size", "2",
          "--calibration", str(prof_file), "-o", str(out)])
    return out / "plan.json"


def test_truncated_plan(tmp_path, root, prof_file):
    f = _plan_file(tmp_path, root, prof_file)
    f.write_text(f.read_text()[:500])
    with pytest.raises(PlanFileError, match="corrupt or truncated"):
        load_plan(f)


def test_other_schema_and_world(tmp_path, root, prof_file, capsys):
    f = _plan_file(tmp_path, root, prof_file)
    with pytest.raises(PlanFileError, match="made for world size 2"):
        load_plan(f, world_size=4)
    d = json.loads(f.read_text())
    d["schema"] = "autopar.plan/0"
    f.write_text(json.dumps(d))
    rc = main(["execute", str(f)])
    assert rc == 2 and "schema" in capsys.readouterr().err


def test_unknown_kind(tmp_path, root, prof_file, capsys):
    rc = main(["plan", str(root / "strategies/examples/resnet2d.py"), "--world-size", "2",
               "--calibration", str(prof_file), "--kinds", "sample,bogus"])
    assert rc == 2 and "bogus" in capsys.readouterr().err


def test_runtime_imports_no_solver_or_tracer():
    import subprocess
    import sys
    code = ("import sys, autopar.runtime, autopar.decomp; "
            "bad = [m for m in ('pulp', 'autopar.solve.ilp', 'autopar.trace.tracer', 'highspy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
