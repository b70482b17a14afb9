"""Stage 7, write: the generated module and plan.json, atomically, beside each other."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..artifacts import Plan, write_plan
from ..codegen.generate import generate_module
from ..io import atomic_write_text


def rel_path(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` (absolute when on another drive)."""
    try:
        return os.path.relpath(Path(path).resolve(), Path(base).resolve())
    except ValueError:
        return str(Path(path).resolve())


def default_plan_dir(model_name: str, world: int) -> Path:
    return Path("strategies") / "plans" / f"{model_name}-w{world}"


def write_module(plan: Plan, out_dir: Path) -> Path:
    """The generated module (``codegen``), written into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    module_path = out_dir / plan.generated
    atomic_write_text(module_path, generate_module(plan))
    return module_path


def write_plan_file(plan: Plan, out_dir: Path) -> Path:
    """plan.json, written into ``out_dir`` (after the module, so that a plan.json names a
    module that exists)."""
    return write_plan(plan, out_dir / "plan.json")


def with_timings(plan: Plan, timings_s: dict[str, float]) -> Plan:
    return dataclasses.replace(plan, timings_s=dict(timings_s))
