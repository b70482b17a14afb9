"""Moved: the profile is the pure profile model's (``autopar.profile.profile``). This name stays
only until the planner and the CLI import it from there (``tests/test_layering.py``'s allow-list)."""

from ..profile.profile import *  # noqa: F401,F403
from ..profile.profile import __all__  # noqa: F401
