"""Choosing pipeline stages: the number of stages S, the cut points, the sub-mesh of each stage
(dp x tp) and the microbatches M, priced by ``decomp.stages.price_pipeline``.

In the spirit of Alpa's inter-operator pass (a dynamic program over cuts, each stage priced by
the intra-operator plan of its sub-mesh), simplified to what torch's schedules run: every stage
gets a sub-mesh of the same shape (``world / S`` ranks as dp x tp; peers across a cut share
coordinates), so for one (S, dp, tp, M) the schedule's step is

    T(S, cuts) = sum_s (f_s + b_s) + (M-1) max_s (f_s + b_s) + sends + sync tail   (1F1B)

and, with per-unit costs additive and the same for every stage's sub-mesh, ``sum_s (f_s + b_s)``
does not depend on the cuts: the best cuts minimise the bottleneck ``max_s (f_s + b_s)``
subject to each stage's memory (``static + in_flight(s) * activations``, in_flight from the
schedule). That is solved exactly by bisection on the bottleneck with a greedy packing
(``_cuts_for``): stages take as many units as fit under the bound, in order; the in-flight count
falls with s, so a stage never gains by handing units to a later one -- packing greedily is
optimal for a given bound, and the smallest feasible bound is found to 1e-9 relative.

Units are the layers the model can be cut between (transformer blocks); ``unit_cost(i, dp, tp,
microbatch)`` prices unit i on a stage sub-mesh (its forward, backward, gradient sync over dp,
activation bytes per microbatch, static bytes), cached per (unit, sub-mesh, microbatch); the
caller folds embeddings into the first unit and the head into the last. Everything tried is
returned, refused or priced, so plan.json can list every stage count with its prediction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

from ..decomp.stages import (PipelinePrice, Schedule, StageCost, feasible_stage_counts, in_flight_microbatches,
                             price_pipeline)
from ..errors import PipelineError


@dataclass(frozen=True)
class StageOption:
    """One configuration tried: S stages of dp x tp ranks, M microbatches of ``microbatch``
    samples, cut before units ``cuts``; its price or why it was refused."""

    stages: int
    dp: int
    tp: int
    microbatches: int
    microbatch: int
    schedule: str
    cuts: tuple[int, ...] = ()
    price: PipelinePrice | None = None
    refused: str | None = None

    @property
    def step_s(self) -> float:
        return self.price.step_s if self.price is not None else float("inf")

    def to_json(self) -> dict:
        d = {"stages": self.stages, "dp": self.dp, "tp": self.tp, "microbatches": self.microbatches,
             "microbatch_samples": self.microbatch, "schedule": self.schedule, "cuts": list(self.cuts)}
        if self.refused is not None:
            d["refused"] = self.refused
        else:
            d.update(self.price.to_json())
        return d


@dataclass(frozen=True)
class StageSearch:
    """Every option tried; ``best`` (None when nothing fits) and the best per stage count."""

    options: tuple[StageOption, ...]
    best: StageOption | None

    def best_per_stage_count(self) -> dict[int, StageOption]:
        out: dict[int, StageOption] = {}
        for o in self.options:
            cur = out.get(o.stages)
            # priced beats refused; among refused the last tried (the largest tp: the closest to fit)
            if cur is None or (cur.price is None and (o.price is not None or o.refused is not None)) or \
                    (o.price is not None and o.step_s < cur.step_s):
                out[o.stages] = o
        return out

    def to_json(self) -> dict:
        per = self.best_per_stage_count()
        return {"chosen": None if self.best is None else self.best.to_json(),
                "per_stage_count": [per[s].to_json() for s in sorted(per)],
                "options_tried": len(self.options)}


UnitCost = Callable[[int, int, int, int], StageCost]


def _sum(costs: Sequence[StageCost]) -> StageCost:
    return StageCost(sum(c.fwd_s for c in costs), sum(c.bwd_s for c in costs), sum(c.grad_sync_s for c in costs),
                     sum(c.act_bytes_per_microbatch for c in costs), sum(c.static_bytes for c in costs))


def _cuts_for(units: Sequence[StageCost], s_count: int, schedule: Schedule,
              memory_limit_bytes: float | None) -> tuple[int, ...] | None:
    """Cuts (first unit of stages 1..S-1) minimising the bottleneck f + b under the memory limit,
    or None when no cut fits (module docstring: bisection + greedy packing)."""
    n = len(units)
    work = [u.fwd_s + u.bwd_s for u in units]

    def pack(bound: float) -> tuple[int, ...] | None:
        cuts, i = [], 0
        for s in range(s_count):
            left = s_count - s - 1                     # stages still to fill after this one
            fl = in_flight_microbatches(schedule, s_count, s)
            t = act = stat = 0.0
            j = i
            while j < n - left:
                t2, act2, stat2 = t + work[j], act + units[j].act_bytes_per_microbatch, stat + units[j].static_bytes
                over_mem = memory_limit_bytes is not None and stat2 + fl * act2 > memory_limit_bytes
                if j > i and (t2 > bound or over_mem):
                    break
                if j == i and over_mem:
                    return None
                t, act, stat = t2, act2, stat2
                j += 1
            if j == i or (s == s_count - 1 and j < n):
                return None
            if t > bound * (1 + 1e-12):
                return None
            if s < s_count - 1:
                cuts.append(j)
            i = j
        return tuple(cuts) if i == n else None

    lo, hi = max(work), sum(work) * (1 + 1e-9)
    if pack(hi) is None:          # not even with time unbounded: memory rules every cut out
        return None
    for _ in range(200):
        if hi - lo <= 1e-9 * hi:
            break
        mid = 0.5 * (lo + hi)
        if pack(mid) is not None:
            hi = mid
        else:
            lo = mid
    return pack(hi)


def search_stages(n_units: int, world: int, batch: int, unit_cost: UnitCost, cut_send_s: Callable[[int, int, int], float],
                  *, stage_counts: Sequence[int] | None = None, tps: Sequence[int] = (1,),
                  microbatch_sizes: Sequence[int] | None = None, microbatches: int | None = None,
                  schedule: str = "1f1b", virtual: int = 1, memory_limit_bytes: float | None = None) -> StageSearch:
    """Try every (S, tp, microbatch size) -- S from ``stage_counts`` (default: every feasible
    count), tp dividing the stage's ranks, dp the rest, M = batch / (dp * microbatch) (or
    ``microbatches`` fixed) -- with the best cuts of each; return them all and the fastest.

    ``cut_send_s(s, tp, microbatch)``: one microbatch's values over the cut after stage s for a
    layout of S stages (the caller knows the link level: stage ranks are consecutive blocks)."""
    feasible = feasible_stage_counts(n_units, world, virtual)
    counts = list(stage_counts) if stage_counts is not None else feasible
    bad = [s for s in counts if s not in feasible]
    if bad:
        raise PipelineError(f"--pipeline {bad[0]} is not feasible for {n_units} layers on {world} ranks",
                            f"use one of the feasible stage counts {feasible}")

    @functools.lru_cache(maxsize=None)
    def unit(i: int, dp: int, tp: int, mb: int) -> StageCost:   # cached per (unit, sub-mesh, microbatch)
        return unit_cost(i, dp, tp, mb)

    options: list[StageOption] = []
    for s_count in counts:
        per = world // s_count
        for tp in tps:
            if per % tp:
                continue
            dp = per // tp
            if microbatches is not None:
                if batch % (dp * microbatches):
                    options.append(StageOption(s_count, dp, tp, microbatches, 0, schedule,
                                               refused=f"batch {batch} does not split into dp {dp} x M {microbatches}"))
                    continue
                pairs = [(microbatches, batch // (dp * microbatches))]
            else:
                sizes = microbatch_sizes or [1, 2, 4, 8]
                pairs = [(batch // (dp * mb), mb) for mb in sizes if batch % (dp * mb) == 0]
                if not pairs:
                    options.append(StageOption(s_count, dp, tp, 0, 0, schedule,
                                               refused=f"batch {batch} does not split over dp {dp}"))
                    continue
            for m, mb in pairs:
                try:
                    sch = Schedule(schedule, m, virtual)
                except PipelineError as e:
                    options.append(StageOption(s_count, dp, tp, m, mb, schedule, refused=e.message))
                    continue
                if schedule == "1f1b" and m < s_count:
                    options.append(StageOption(s_count, dp, tp, m, mb, schedule,
                                               refused=f"1F1B needs M >= S ({m} < {s_count})"))
                    continue
                units = [unit(i, dp, tp, mb) for i in range(n_units)]
                cuts = _cuts_for(units, s_count, sch, memory_limit_bytes)
                if cuts is None:
                    options.append(StageOption(s_count, dp, tp, m, mb, schedule,
                                               refused="no cut leaves every stage within the memory limit"))
                    continue
                bounds = [0, *cuts, n_units]
                costs = [_sum(units[bounds[k]:bounds[k + 1]]) for k in range(s_count)]
                sends = [cut_send_s(k, tp, mb) for k in range(s_count - 1)]
                options.append(StageOption(s_count, dp, tp, m, mb, schedule, cuts,
                                           price_pipeline(costs, sends, sch)))
    priced = [o for o in options if o.price is not None]
    best = min(priced, key=lambda o: (o.step_s, o.stages, o.tp)) if priced else None
    return StageSearch(tuple(options), best)


def require_fit(search: StageSearch, world: int, n_units: int) -> StageOption:
    """The chosen option, or a named error listing the stage counts that fit."""
    if search.best is not None:
        return search.best
    fits = sorted({o.stages for o in search.options if o.price is not None})
    tried = sorted({o.stages for o in search.options})
    raise PipelineError(f"no stage layout of {tried} stages fits on {world} ranks for {n_units} layers "
                        f"(every one leaves a stage without memory or the batch unsplit)",
                        f"feasible stage counts: {fits or 'none'}; raise the memory limit or the batch")


__all__ = ["StageOption", "StageSearch", "require_fit", "search_stages"]
