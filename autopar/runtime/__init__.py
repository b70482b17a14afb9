"""The runtime library that generated modules import. It imports neither the solver (pulp) nor
the tracer (torch.export): a test checks this."""

from .comm import Comm
from .redistribute import redistribute
from .entry import build_planned, run_generated
from .model import DistModel
from . import layers  # noqa: F401,E402  (registers the decompositions' run-time halves)

__all__ = ["Comm", "DistModel", "build_planned", "redistribute", "run_generated"]
