"""The plan artifact now lives in ``autopar.artifacts`` (typed ``Plan``, schema, loader, writer).

What is left here is for callers that still index the plan as a dict
(``autopar.calibrate.refine``): ``load_plan`` applies the same checks and the same schema-1
migration as ``autopar.artifacts.load_plan`` and returns the plan's JSON. New code uses
``autopar.artifacts.load_plan`` (a ``Plan``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import artifacts
from ..artifacts import PLAN_SCHEMA  # noqa: F401  (re-exported)


def load_plan(path: str | Path, world_size: int | None = None) -> dict[str, Any]:
    """``autopar.artifacts.load_plan(path).to_json()``: a checked (schema 1: migrated) plan dict."""
    return artifacts.load_plan(path, world_size).to_json()
