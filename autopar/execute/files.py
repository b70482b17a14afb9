"""What an execution checks on disk before any process starts (shared by ``execute.runner``
and ``tournament.run``)."""

from __future__ import annotations

from pathlib import Path

from ..artifacts import Plan
from ..errors import PlanFileError
from ..io import atomic_write_text, sha256_file
from ..codegen.generate import generate_module


def check_plan_files(plan_path: Path, plan: Plan) -> Path:
    """Before any process starts: the generated module beside the plan (written again if
    missing) and the model file, unchanged since planning. Returns the module's path."""
    module_path = plan_path.parent / plan.generated
    if not module_path.is_file():
        atomic_write_text(module_path, generate_module(plan))
    mpath = plan.model_file(plan_path)
    if not mpath.is_file():
        raise PlanFileError(f"the plan's model file {mpath} is missing", "re-plan from the model file")
    if sha256_file(mpath) != plan.model.sha256:
        raise PlanFileError(f"the model file {mpath} changed since the plan was made",
                            "re-plan it (autopar plan) so that the plan matches the model")
    return module_path
