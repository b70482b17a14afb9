"""Measuring missing shapes: the explicit step BEFORE planning (``autopar plan --measure-shapes``).

Planning starts no process (``autopar.planner``): it prices the shapes the profile lacks by the
generic model and names them (``PlanResult.missing_shapes``). This step plans (in memory), asks
``calibrate.ondemand.OnDemand`` to measure the competitive local shapes the profile and its shape
file lack, in one child process within the budget, writes them to the shape file beside the
profile (``PROFILE-shapes.json``), and plans again with them, up to ``ROUNDS`` times (the new
optimum may have competitive shapes of its own). The caller then plans with
``PlanOptions(shapes=<the shape file>)``, which plan.json records (``calibration.shapes``: path,
sha256, entries), so a re-plan reads the same numbers."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..artifacts import PlanHooks, PlanOptions
from ..planner import load_calibration, make_plan
from .ondemand import OnDemand

#: rounds of plan -> measure -> plan again
ROUNDS = 3


@dataclass(frozen=True)
class ShapeMeasurement:
    """What the step did: the shape file to plan with (None: nothing to read), how many shapes
    it measured, those left to the generic model (budget), why nothing could be measured."""
    shapes_path: Path | None
    measured: int
    left_out: tuple[str, ...]
    not_measured_because: str | None
    rounds: int
    spent_s: float

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["shapes_path"] = str(self.shapes_path) if self.shapes_path else None
        out["left_out"] = list(self.left_out)
        return out


def measure_missing_shapes(model_file: str | Path, options: PlanOptions,
                           progress: Callable[[str], None] = print, rounds: int = ROUNDS) -> ShapeMeasurement:
    """Measure the competitive shapes ``model_file`` planned as ``options`` say needs and the
    profile lacks (module docstring); plans nothing to disk."""
    t0 = time.perf_counter()
    cal_path, profile = load_calibration(options.calibration)
    od = OnDemand(cal_path, profile, options.world_size, progress, options.measure_budget_s)
    if od.reason is not None:
        progress(f"exact shapes: not measured: {od.reason}")
        return ShapeMeasurement(None, 0, (), od.reason, 0, 0.0)
    quiet = dataclasses.replace(options, write=False, measure_shapes=False,
                                shapes=str(od.path) if od.cached else options.shapes)
    n = 0
    for n in range(1, rounds + 1):
        res = make_plan(model_file, quiet, PlanHooks())
        if not od.measure_for(res.table, res.solution.choice):
            break
        quiet = dataclasses.replace(quiet, shapes=str(od.path))
    path = od.path if od.path.exists() and (od.cached or od.measured) else None
    return ShapeMeasurement(path, len(od.measured), tuple(od.left_out), None, n, time.perf_counter() - t0)
