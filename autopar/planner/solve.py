"""Stage 4, solve: under each rank placement of the request, a cost table solved (dynamic
program / ILP), the fastest placement kept (``solve.placement.search_placement``)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from ..cost.table import evaluate
from ..errors import InfeasiblePlan, SolverError
from ..solve.elimination import limited_lower_bound_s
from ..solve.ilp import solve as solve_ilp
from ..solve.placement import PlacementResult, search_placement
from .load import Request
from .price import Priced, TableMaker
from .strategies.sharded import fitting_step_s as sharded_fitting_step_s
from .trace import Traced


@dataclass
class TableSolver:
    """``solve(table)``: transitions priced, then solved; keeps the seconds of each."""
    req: Request
    edges_s: list[float] = field(default_factory=list)
    solves_s: list[float] = field(default_factory=list)
    # the solver's InfeasiblePlan under the memory limit, when it was raised: the table was then
    # solved without the limit, so that plan-level strategies that store less than any choice per
    # layer (sharded data parallelism) are still offered; ``choose`` raises it when none fits
    infeasible: Exception | None = None

    def solve(self, table):
        t = time.perf_counter()
        table.ensure_edges()
        self.edges_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        o = self.req.options
        if o.memory_limit_bytes is None:
            s = solve_ilp(table, memory_limit_bytes=None, time_limit_s=o.time_limit_s, solver=o.solver)
        else:
            # the fastest plan without the limit first: when it fits, it is the answer under the limit
            # too; when the limit cannot be met (or not within the time limit), it is what
            # plan-level strategies that store less than any choice per layer start from
            free = solve_ilp(table, memory_limit_bytes=None, time_limit_s=o.time_limit_s, solver=o.solver)
            if evaluate(table, free.choice).memory_per_rank_bytes <= o.memory_limit_bytes:
                s = free
            elif (skip := self._limited_beaten(table, free)) is not None:
                s = dataclasses.replace(free, notes=list(free.notes) + [skip])
            else:
                # the DP knows no memory limit: its plan, over the limit, would be found again
                solver = "ilp" if free.solver == "dp" else o.solver
                try:
                    s = solve_ilp(table, memory_limit_bytes=o.memory_limit_bytes, time_limit_s=o.time_limit_s,
                                  solver=solver)
                except (InfeasiblePlan, SolverError) as e:
                    self.infeasible = self.infeasible or e
                    s = free
        self.solves_s.append(time.perf_counter() - t)
        return s

    def _limited_beaten(self, table, free) -> str | None:
        """Why the memory-limited ILP need not run (its note), or None: the sharded strategy
        offers a plan over ``free`` that fits the limit, and no per-layer plan that fits can be
        faster (``limited_lower_bound_s``); that ILP can take minutes (a 96-layer GPT at 1024
        ranks: HiGHS's time limit, 60 s)."""
        limit = self.req.options.memory_limit_bytes
        target = sharded_fitting_step_s(table, free.choice, self.req, limit)
        if target is None:
            return None
        lb = limited_lower_bound_s(table, limit, at_least=target)
        if lb is None or lb < target:
            return None
        return (f"the memory-limited ILP was not run: no per-layer plan within {limit / 2**20:.1f} MiB is "
                f"faster than {lb:.6g} s (Lagrangian bound, solve.elimination.limited_lower_bound_s), and "
                f"sharded data parallelism over this plan fits in {target:.6g} s")


@dataclass(frozen=True)
class Solved:
    """The placement search's result, the maker of its tables (pins), and where time went."""
    placed: PlacementResult
    maker: TableMaker
    timings_s: dict[str, float]
    infeasible: Exception | None = None   # the solver's InfeasiblePlan under the limit (TableSolver)

    @property
    def table(self):
        return self.placed.table


def solve(traced: Traced, priced: Priced, req: Request) -> Solved:
    maker, solver = TableMaker(traced.graph, req), TableSolver(req)
    t = time.perf_counter()
    placed = search_placement(priced.ctx, req.options.placement, maker.make, solver.solve, evaluate)
    search_s = time.perf_counter() - t
    tables_s, edges_s, solves_s = maker.tables_s, solver.edges_s, solver.solves_s
    # where the time went (``--verbose``, plan.json): the first table with its transitions,
    # the other placements (their tables, bounds and transitions where solved), the solves
    price_s = tables_s[0] + (edges_s[0] if edges_s else 0.0)
    timings = {"cost_s": sum(tables_s) + sum(edges_s), "solve_s": sum(solves_s), "price_s": price_s,
               "placements_s": max(0.0, search_s - price_s - sum(solves_s)),
               "placements_priced": float(len(tables_s)), "placements_solved": float(len(solves_s))}
    tab, sol = placed.table, placed.solution
    req.say(f"priced {tab.size()['choices']} layer choices and {tab.size()['pairs']} transitions "
            f"in {price_s:.2f} s" + (f" (+{timings['placements_s']:.2f} s for {len(tables_s) - 1} more "
                                     f"placements)" if len(tables_s) > 1 else ""))
    req.say(f"solved with {sol.solver} in {sol.time_s:.2f} s ({sol.status}, gap {sol.gap})"
            + (f"; {len(solves_s)} placements solved in {timings['solve_s']:.2f} s" if len(solves_s) > 1 else ""))
    req.say(placed.summary())
    return Solved(placed, maker, timings, solver.infeasible)
