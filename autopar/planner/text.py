"""What ``autopar plan`` prints: the plan table and where planning time went."""

from __future__ import annotations

from ..artifacts import Plan
from ..report.planview import format_plan


def format_plan_table(plan: Plan, verbose: bool = False) -> str:
    """The printed plan: summary, then the layer table with routine layers folded (every row
    when ``verbose``); ``autopar.report.planview.format_plan``."""
    return format_plan(plan, verbose=verbose)


def format_timings(t: dict[str, float]) -> str:
    """One line: where planning time went (``autopar plan --verbose``)."""
    return (f"timings: load {t.get('load_s', 0):.2f} s, trace {t.get('trace_s', 0):.2f} s, pricing "
            f"{t.get('price_s', 0):.2f} s, placements {t.get('placements_s', 0):.2f} s "
            f"({int(t.get('placements_priced', 1))} priced, {int(t.get('placements_solved', 1))} "
            f"solved), ILP {t.get('solve_s', 0):.2f} s, "
            + (f"measuring shapes {t['measure_s']:.2f} s, " if t.get("measure_s") else "")
            + f"write {t.get('write_s', 0):.2f} s; total "
            f"{t.get('total_s', 0):.2f} s in make_plan")
