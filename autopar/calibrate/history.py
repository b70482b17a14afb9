"""Moved: the speed history is the pure profile model's (``autopar.profile.history``). This name
stays only until the planner and ``explain`` import it from there (``tests/test_layering.py``)."""

from ..profile.history import *  # noqa: F401,F403
from ..profile.history import plan_speed_factor, record, usual_speed  # noqa: F401
