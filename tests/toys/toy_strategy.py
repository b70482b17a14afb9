"""A toy plan-level strategy, added to autopar by this one file plus one import line (``import
toys.toy_strategy``): every layer ``sample(P)`` over the whole world (batch-free layers
``replicate``), run op by op, predicted at ``SCALE`` x the cost model's step for that assignment.

``SCALE`` stands in for a strategy with a cost model of its own (a pipeline schedule, sharded
optimizer state): below 1 the toy is predicted cheaper than every other candidate and the chooser
takes it, above 1 it is listed in plan.json with its prediction and not chosen. Its memory is the
cost model's, so the chooser's memory rule applies to it like to any other."""

from __future__ import annotations

import dataclasses

from autopar.cost.table import evaluate, native_choice
from autopar.planner.strategies import Candidate, register_strategy

NAME = "toy_all_sample"


@register_strategy
class ToyAllSample:
    name = NAME
    priority = 3
    scale = 0.5

    def offer(self, base):
        choice = native_choice(base.table)
        if choice is None:
            return (Candidate(NAME, "toy all-sample", illegal="some layer has no sample over the whole world",
                              priority=self.priority),)
        pred = evaluate(base.table, choice)
        pred = dataclasses.replace(pred, step_time_s=pred.step_time_s * self.scale)
        return (Candidate(NAME, "toy all-sample", pred, table=base.table, choice=tuple(choice),
                          runtime="traced", priority=self.priority,
                          note=f"toy strategy chosen: all-sample at x{self.scale:g} of its priced step"),)
