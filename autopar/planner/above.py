"""Job-level strategies (``planner.strategies``, ``level = "job"``): the model re-planned per
padded bucket (``--graph-sizes``) or per trainer count (``--trainers``) through ``make_plan``,
each alternative a candidate of the one chooser (memory fit, then the smallest ``cost_s``, then
priority), the chosen one written by its strategy (``realize``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..artifacts import PlanHooks, PlanOptions
from .make import make_plan
from .strategies import STRATEGIES, JobOffer, choose, none_fits
from .strategies.buckets import NAME as PADDING_BUCKETS
from .strategies.trainers import NAME as TRAINERS


def plan_above(strategy: str, model_file: str | Path, options: PlanOptions, level_options: Any,
               hooks: PlanHooks | None = None, say: Callable[[str], None] | None = None):
    """Offer, choose and realize the job-level strategy named ``strategy``: its candidates
    (``offer(JobOffer)``) go through the one chooser; none legal: the strategy's own refusal
    (``refuse``) or ``InfeasiblePlan`` naming every candidate's reason."""
    hooks = hooks or PlanHooks()
    s = STRATEGIES[strategy]
    job = JobOffer(Path(model_file), options, hooks, level_options, make_plan,
                   say or hooks.progress or (lambda line: None))
    choice = choose(s.offer(job), options.memory_limit_bytes)
    if choice.chosen is None:
        if hasattr(s, "refuse"):
            s.refuse(job, choice)
        raise none_fits(choice.candidates, f"no {strategy} candidate is legal", "raise --memory-limit or add ranks",
                        level="job")
    return s.realize(job, choice)


def make_padded_plan(model_file: str | Path, options: PlanOptions, padding, hooks: PlanHooks | None = None):
    """Plan a padded GNN for the graph sizes of ``padding.sizes_path`` (``PaddingOptions``):
    every padding policy priced and chosen (``strategies.buckets``), the plan of the largest
    shape written as ``plan.json`` with the decision under ``padding``, the plan of every other
    bucket beside it (``bucket-N<n>-E<e>/``). Returns (PlanResult, PaddingDecision)."""
    return plan_above(PADDING_BUCKETS, model_file, options, padding, hooks)


def make_tournament_plan(model_file: str | Path, options: PlanOptions, topts, hooks: PlanHooks | None = None,
                         say: Callable[[str], None] = lambda s: None):
    """Plan one trainer of ``world_size / T`` ranks for the given T, or for every divisor T of
    the world (``trainers="auto"``), price each (``tournament.pricing``), keep the one the
    chooser picks (``strategies.trainers``) and write its plan with the trainer level. Returns
    ``tournament.pricing.TournamentPlanResult``."""
    return plan_above(TRAINERS, model_file, options, topts, hooks, say)
