"""Brute-force enumeration of every plan (for tests on small graphs): the ILP's referee."""

from __future__ import annotations

import itertools

from ..cost.table import CostTable, evaluate, tied_choice_sets
from .ilp import tied_ok


def brute_force(table: CostTable, memory_limit_bytes: float | None = None) -> tuple[list[int] | None, float]:
    """(best choice, its step + optimizer time) over all combinations; (None, inf) if none fits."""
    sets = tied_choice_sets(table)
    best, best_t = None, float("inf")
    for choice in itertools.product(*[range(len(o.choices)) for o in table.layers]):
        if sets and not tied_ok(table, list(choice), sets):
            continue                     # a tied parameter held two ways: not a plan
        p = evaluate(table, list(choice))
        if memory_limit_bytes is not None and p.memory_per_rank_bytes > memory_limit_bytes:
            continue
        if p.step_time_s < best_t - 1e-15:
            best, best_t = list(choice), p.step_time_s
    return best, best_t
