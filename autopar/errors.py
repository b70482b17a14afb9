"""Named errors. Each says what went wrong and what to do; the CLI prints one line, exit code 2."""

from __future__ import annotations


class AutoparError(Exception):
    """Base of every error a user can cause and fix. ``hint`` says what to do."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class ModelFileError(AutoparError):
    """The model file is missing, does not import, or lacks ``build_model``/``example_inputs``."""


class TraceError(AutoparError):
    """The model could not be traced; names the operation and the source line."""


class PlanFileError(AutoparError):
    """A plan file is truncated, of another schema version, or made for another world size."""


class RunFileError(AutoparError):
    """A run file (run.json) is missing, truncated or of another schema."""


class CalibrationError(AutoparError):
    """A calibration profile is corrupt, truncated, or of another schema version."""


class IllegalDecomposition(AutoparError):
    """A decomposition cannot be applied to a layer (names the layer and the reason)."""


class PlacementError(AutoparError):
    """A rank placement that does not fit the world size, or an unknown placement in a plan."""


class InfeasiblePlan(AutoparError):
    """No plan fits the memory limit; names the layers that cannot fit and the memory that would."""


class SolverError(AutoparError):
    """The ILP solver failed or returned no solution."""


class ValidationFailed(AutoparError):
    """A distributed run computed a different function than the single-process model."""

    exit_code = 3


class RankFailure(AutoparError):
    """A rank died or hung; names the rank."""

    exit_code = 4


class PipelineError(AutoparError):
    """A pipeline-stage request that cannot be met (stage count, cut, schedule, microbatches);
    lists what can be asked instead (the feasible stage counts, the value crossing a cut backwards)."""
