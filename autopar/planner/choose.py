"""Stage 5, choose: every registered plan-level strategy (``planner.strategies``) offers its
candidates for the solved table; one rule picks (memory fit, forced, fastest, priority). When
none fits the memory limit, the error names every strategy and why (``strategies.none_fits``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from .load import Loaded, Request
from .solve import Solved
from .strategies import STRATEGIES, Choice, Offer, choose as choose_rule, memory_fit, none_fits, offer_all
from .strategies.native import NAME as NATIVE
from .strategies.op_by_op import NAME as OP_BY_OP


@dataclass(frozen=True)
class Chosen:
    """The plan chosen: its table, solution (one choice per layer), prediction, the records
    strategies keep in plan.json (``runtime``, ``graph_parallel``) and every candidate priced."""
    table: Any
    solution: Any
    prediction: Any
    choice: Choice
    records: dict[str, Any]
    pin_marks: dict[int, str]


def choose(loaded: Loaded, solved: Solved, req: Request, replan: Callable[..., Any] | None = None) -> Chosen:
    """``replan``: ``make_plan`` itself, for strategies that re-plan the model (``Offer.replan``)."""
    placed = solved.placed
    base = Offer(req, loaded, placed.table.graph, placed.table, placed.solution, placed.prediction,
                 dp_unpinned=solved.maker.dp_unpinned.get(id(placed.table), False), replan=replan)
    cands = offer_all(base)
    fallback = next(c for c in cands if c.strategy == OP_BY_OP)
    choice = choose_rule(cands, req.memory_limit_bytes, fallback)
    if solved.infeasible is not None and memory_fit(choice.chosen.prediction, req.memory_limit_bytes) is not None:
        # no strategy fits either: the solver's own words for its plan, then every strategy's
        e = solved.infeasible
        # (the op-by-op candidate is the plan solved without the limit: the solver's message
        # names the smallest memory any per-layer plan reaches, so its own figure is dropped)
        own = [dataclasses.replace(c, illegal="no per-layer plan fits (the solver's words above)", prediction=None)
               if c.strategy == OP_BY_OP else c for c in choice.candidates]
        raise none_fits(own, e.message, e.hint, error=type(e))
    own = {name: s.record(base, choice) for name, s in STRATEGIES.items() if hasattr(s, "record")}
    records: dict[str, Any] = {}
    for rec in own.values():                 # registration order: a later record wins
        records.update(rec)
    c, sol = choice.chosen, placed.solution
    if c.strategy not in (OP_BY_OP, NATIVE) and "runtime" not in own.get(c.strategy, {}):
        records["runtime"] = {"expected": c.runtime, "step_time_s": c.step_time_s,
                              "reason": f"plan-level strategy {c.label} chosen"}
    note = records.pop("note", None) or c.note    # the native plan the solver chose itself: no note
    if c.strategy != OP_BY_OP and (note or list(c.choice) != list(sol.choice)):
        sol = dataclasses.replace(sol, choice=list(c.choice),
                                  notes=list(sol.notes) + [note or f"plan-level strategy {c.label} chosen"])
    if "runtime" in records:
        req.say(f"runtime: {records['runtime']['expected']} ({records['runtime']['reason']})")
    marks = solved.maker.pin_marks.get(id(c.table), {})
    return Chosen(c.table, sol, c.prediction, choice, records, marks)
