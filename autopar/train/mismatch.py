"""Differences between a model (or checkpoint) and the plan's model: one named error listing
the first few, shared by ``parallelize`` and the checkpoint loaders."""

from __future__ import annotations

from ..errors import AutoparError

#: how many mismatches a structural error lists
FIRST_MISMATCHES = 5


class ModelMismatch(AutoparError):
    """A model or checkpoint whose parameter names or shapes differ from the plan's model."""


def mismatches(want: dict[str, tuple], have: dict[str, tuple]) -> list[str]:
    """Human-readable differences between two name -> shape maps (want: the plan's)."""
    out = []
    for q in want:
        if q not in have:
            out.append(f"{q} missing")
        elif tuple(have[q]) != tuple(want[q]):
            out.append(f"{q} has shape {tuple(have[q])}, expected {tuple(want[q])}")
    out.extend(f"{q} unexpected" for q in have if q not in want)
    return out


def first_of(bad: list[str]) -> str:
    """The first ``FIRST_MISMATCHES`` differences, and how many more there are."""
    more = f"; and {len(bad) - FIRST_MISMATCHES} more" if len(bad) > FIRST_MISMATCHES else ""
    return "; ".join(bad[:FIRST_MISMATCHES]) + more
