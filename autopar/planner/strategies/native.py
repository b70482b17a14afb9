"""The native data-parallel plan (``cost.native``): every layer ``sample(P)`` over the whole
world (batch-free layers ``replicate``), run as the user's own module on each rank, priced with
the op-by-op runtime's per-op work removed. Ties with the solver's plan go to it (priority 0):
a user who would otherwise train with DDP never gets a plan the model says is slower.

Illegal when some layer has neither choice, or when the request fixes layers (a test's
``force``, a candidate filter) and the native plan differs from the solver's. plan.json keeps
the comparison under ``runtime`` (``cost.native.RuntimeChoice``)."""

from __future__ import annotations

from ...cost.native import RuntimeChoice, choose_runtime, layer_gaps_s, native_choice
from ...cost.table import evaluate, plan_grad_reducer_s
from .registry import Candidate, register_strategy

NAME = "native"
NO_PLAN = "no native data-parallel plan: some layer cannot take sample over the whole world"
KEPT = "layers pinned or filtered: the ILP's plan is kept"


@register_strategy
class NativeDataParallel:
    name = NAME
    priority = 0

    def offer(self, base):
        nat = native_choice(base.table)
        if nat is None:
            return (Candidate(NAME, "native data parallel", illegal=NO_PLAN, priority=self.priority),)
        # ``choose_runtime`` of the native assignment itself: its prediction on the native runtime
        _, pred = choose_runtime(base.table, nat, evaluate, None)
        illegal = KEPT if base.req.constrained and list(nat) != list(base.solution.choice) else None
        return (Candidate(NAME, "native data parallel", pred, illegal=illegal, table=base.table,
                          choice=tuple(nat), runtime="native", priority=self.priority),)

    def record(self, base, choice) -> dict:
        """plan.json's ``runtime``: which runtime the plan expects and the comparison."""
        table, sol_choice = base.table, list(base.solution.choice)
        gap = sum(f + b for f, b in layer_gaps_s(table))
        n_ops = sum(len(lay.ops) for lay in table.graph.layers)
        ilp = float(base.prediction.step_time_s)
        nat = next(c for c in choice.candidates if c.strategy == NAME)
        # native against the solver's plan alone (another strategy may still beat both)
        wins = nat.illegal is None and nat.step_time_s <= ilp
        rt = _runtime(table, sol_choice, ilp, nat, gap, n_ops, wins)
        if base.req.layer_pins and nat.prediction is None and base.dp_unpinned:
            pins = ", ".join(map(str, base.req.layer_pins))
            rt = RuntimeChoice(rt.choice, rt.runtime, rt.step_time_s, rt.ilp_step_time_s, None, gap, n_ops,
                               f"no native data-parallel plan: the pins ({pins}) leave some layer without "
                               f"sample over the whole world", rt.reducer_s)
        out = {"runtime": rt.to_json()}
        if choice.chosen.strategy == NAME and list(nat.choice) != sol_choice:
            out["note"] = f"replaced by the native data-parallel plan: {rt.reason}"
        return out


def _runtime(table, sol_choice, ilp: float, nat: Candidate, gap: float, n_ops: int, chosen: bool) -> RuntimeChoice:
    """The ``RuntimeChoice`` record of the comparison (``cost.native.choose_runtime``'s words)."""
    if nat.prediction is None:
        return RuntimeChoice(sol_choice, "traced", ilp, ilp, None, gap, n_ops, NO_PLAN)
    t = nat.step_time_s
    if list(nat.choice) == sol_choice:
        return RuntimeChoice(sol_choice, "native", t, ilp, t, gap, n_ops,
                             "the ILP's plan is pure data parallelism: it runs the user's module",
                             plan_grad_reducer_s(table, sol_choice))
    beats = (f"native data parallelism ({t * 1e3:.3f} ms: {n_ops} ops in the user's module, {gap * 1e3:.3f} ms "
             f"less runtime work than op by op) beats the ILP's op-by-op plan ({ilp * 1e3:.3f} ms)")
    if chosen:
        return RuntimeChoice(list(nat.choice), "native", t, ilp, t, gap, n_ops, beats,
                             plan_grad_reducer_s(table, list(nat.choice)))
    if nat.illegal == KEPT and t <= ilp:
        return RuntimeChoice(sol_choice, "traced", ilp, ilp, t, gap, n_ops, KEPT,
                             plan_grad_reducer_s(table, list(nat.choice)))
    why = ("does not fit the memory limit" if nat.illegal is not None and nat.illegal != KEPT else
           f"is slower ({t * 1e3:.3f} ms vs {ilp * 1e3:.3f} ms)")
    return RuntimeChoice(sol_choice, "traced", ilp, ilp, t, gap, n_ops, f"the native data-parallel plan {why}",
                         plan_grad_reducer_s(table, sol_choice))
