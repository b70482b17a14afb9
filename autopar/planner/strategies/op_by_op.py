"""The solver's plan (one decomposition per layer, chosen by the dynamic program / ILP), run op
by op by the traced runtime: the candidate every other strategy is compared with."""

from __future__ import annotations

from .registry import Candidate, register_strategy

NAME = "op_by_op"


@register_strategy
class OpByOp:
    name = NAME
    priority = 1

    def offer(self, base):
        return (Candidate(NAME, "op-by-op", base.prediction, table=base.table,
                          choice=tuple(base.solution.choice), runtime="traced", priority=self.priority),)
