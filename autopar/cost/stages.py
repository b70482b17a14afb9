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
caller folds embeddings into the first unit and the head into the last; a model of identical
blocks prices one block once per (sub-mesh, microbatch) and every range is a sum of it.

M: every divisor of the per-replica batch ``batch / dp`` (at least S under 1F1B). Options are
priced in order of a lower bound on their step, ``M W / S`` (W: one microbatch's f + b over all
units; the bottleneck stage is at least the mean and runs M microbatches; the sends and the sync
tail only add), and an option whose bound is not below the best step found is recorded as
pruned without being cut. Everything tried is returned, refused, pruned or priced, so plan.json
can list every stage count with its prediction; a stage count refused for memory names the
least peak per rank any cut of it reaches (``min_peak_bytes``: bisection with the same packing).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ..decomp.fsdp import Sharded, UnitParams, unit_comm, unit_memory
from ..decomp.stages import (CutPlan, PipelinePrice, Schedule, StageCost, feasible_stage_counts,
                             in_flight_microbatches, price_pipeline)
from ..errors import PipelineError
from .redistribute import redistribution_s


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
    bound_s: float | None = None              # the lower bound the search ordered and pruned by
    min_peak_bytes: float | None = None       # refused for memory: the least peak any cut reaches
    data: str = "replicate"                   # every stage's dp axis (``decomp.stages.STAGE_DATA``), or "mixed"
    stage_data: tuple[str, ...] = ()          # "mixed": each stage's own (FSDP2 where memory needs it)

    @property
    def step_s(self) -> float:
        return self.price.step_s if self.price is not None else float("inf")

    def to_json(self) -> dict:
        d = {"stages": self.stages, "dp": self.dp, "tp": self.tp, "microbatches": self.microbatches,
             "microbatch_samples": self.microbatch, "schedule": self.schedule, "cuts": list(self.cuts),
             "data": self.data}
        if self.stage_data:
            d["stage_data"] = list(self.stage_data)
        if self.bound_s is not None:
            d["lower_bound_s"] = self.bound_s
        if self.min_peak_bytes is not None:
            d["min_peak_bytes"] = self.min_peak_bytes
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
            # priced beats refused (the faster first); among refused, the one closest to fitting
            if cur is None or (o.price is not None and (cur.price is None or o.step_s < cur.step_s)) or \
                    (o.price is None and cur.price is None and o.min_peak_bytes is not None and
                     (cur.min_peak_bytes is None or o.min_peak_bytes < cur.min_peak_bytes)):
                out[o.stages] = o
        return out

    def to_json(self) -> dict:
        per = self.best_per_stage_count()
        return {"chosen": None if self.best is None else self.best.to_json(),
                "per_stage_count": [per[s].to_json() for s in sorted(per)],
                "options_tried": len(self.options)}


def planned_cut_s(plan: CutPlan, ctx) -> float:
    """One microbatch's values over one cut, one way (``c_k`` of ``decomp.stages.price_pipeline``),
    from the cut's planned steps (``decomp.stages.plan_cut``)::

        c_k = sum over values v of  t_fwd(steps_v)        (cost.redistribute.redistribution_s)

    Each value is a ``MeshSend`` (plus, were the placements to differ, its collectives on either
    mesh), priced at the link level its (sender, receiver) pairs cross (``ctx.worst_level``:
    'inter' when a pair spans nodes) as one p2p of the busiest rank's bytes plus a latency per
    extra message. The values are summed because torch sends each as its own message (a value's
    gradient goes back the same way: ``price_pipeline`` doubles c_k). With equal sub-meshes on
    both sides each rank sends its block to its peer: one p2p of ``bytes per rank`` per value,
    which for one value is ``decomp.stages.cut_send_time_s`` when the profile measured no
    in-situ latency (``cost.primitives.blocking_s`` raises the latency to it otherwise)."""
    total = 0.0
    for v, steps in zip(plan.values, plan.steps):
        total += redistribution_s(steps, ctx, v.itemsize)[0]
    return total


UnitCost = Callable[[int, int, int, int, str], StageCost]


def _sum(costs: Sequence[StageCost]) -> StageCost:
    return StageCost(sum(c.fwd_s for c in costs), sum(c.bwd_s for c in costs), sum(c.grad_sync_s for c in costs),
                     sum(c.act_bytes_per_microbatch for c in costs), sum(c.static_bytes for c in costs),
                     sum(c.fill_s for c in costs), max((c.transient_bytes for c in costs), default=0.0))


def fsdp_unit_cost(c: StageCost, params: UnitParams, dp: int, optim_copies: float, optim_whole_s: float,
                   collective_s: Callable[[str, int, float], float],
                   optim_step_s: Callable[[int, float], float], prev_fwd_s: float) -> StageCost:
    """One unit of a stage whose dp axis is FSDP2 (``decomp.stages.STAGE_DATA``), from its cost
    ``c`` on a stage that replicates it (forward, backward, activations: unchanged; ``c.grad_sync_s``
    holds no dp traffic yet, only its tp-group sync and ``optim_whole_s``, the optimizer on the
    whole unit). Under torch's pipelining an FSDP2 unit is gathered by its first microbatch's
    forward and then kept whole (``PipelineStage`` sets ``reshard_after_backward`` False and
    ``requires_gradient_sync`` False on every backward, then runs FSDP's post-backward once, after
    the last): ``decomp.fsdp``'s level 1 with M microbatches, so with F, S, G, k of ``decomp.fsdp``::

        static_bytes    = (S + F) + F + k S           (``unit_memory`` level 1: shard + whole
                                                       parameters, whole gradient, sharded state)
        transient_bytes = G                           (the reduce-scatter's input, once the last
                                                       backward has freed every activation)
        grad_sync_s     = c.grad_sync_s - optim_whole_s + RS(dp, G) + opt(S)
        fill_s          = max(0, AG(dp, G) - prev_fwd_s)  (its gather, issued when the previous
                                                       unit's forward starts, FSDP2's prefetch;
                                                       ``prev_fwd_s`` is that forward, 0 for unit 0.
                                                       Units are priced before the cuts are known,
                                                       so a later stage's first unit counts the
                                                       previous unit's forward too: at most that
                                                       much under the truth)

    Against a replicated unit (static F + F + k F, sync AR(dp, F) + opt(F)) it saves
    k (F - S) - S of state: nothing with plain SGD (k = 0) or momentum (k = 1) at dp 2, F/2 with
    AdamW (k = 2) at dp 2, up to ~2F at large dp; the all-reduce becomes a reduce-scatter plus one
    gather a step. (ZeRO-3's saving, parameters gathered per microbatch and freed, would cost M
    gathers a step under a schedule; torch's pipelining keeps them whole, so it is not offered.)"""
    s = Sharded(level=1, dp=dp)
    mem = unit_memory(params, s, optim_copies)
    comm = unit_comm(params, s, collective_s, optim_step_s)
    return StageCost(c.fwd_s, c.bwd_s, c.grad_sync_s - optim_whole_s + comm.reduce_s + comm.optim_s,
                     c.act_bytes_per_microbatch, mem.resident_bytes, max(0.0, comm.allgather_s - prev_fwd_s),
                     params.gathered_bytes(dp))


def _reach(units: Sequence[StageCost], i: int, stop: int, in_flight: float, work_bound: float | None,
           memory_limit_bytes: float | None) -> int:
    """The farthest unit a stage starting at unit ``i`` covers (exclusive; at most ``stop``) under
    ``work_bound`` (f + b) and the memory limit (static + max(transient, in-flight x activations))."""
    t = act = stat = tr = 0.0
    j = i
    while j < stop:
        u = units[j]
        t2, act2, stat2 = t + u.fwd_s + u.bwd_s, act + u.act_bytes_per_microbatch, stat + u.static_bytes
        tr2 = max(tr, u.transient_bytes)
        over_mem = memory_limit_bytes is not None and stat2 + max(tr2, in_flight * act2) > memory_limit_bytes
        over_t = work_bound is not None and t2 > work_bound * (1 + 1e-12)
        if over_mem or (j > i and over_t):
            break
        t, act, stat, tr = t2, act2, stat2, tr2
        j += 1
    return j


def _pack_choosing(variants: Sequence[Sequence[StageCost]], s_count: int, schedule: Schedule,
                   work_bound: float | None, memory_limit_bytes: float | None
                   ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Greedy packing: each stage in order takes as many units as fit under ``work_bound`` (f + b)
    and the memory limit; the cuts and, per stage, which of ``variants`` (the same units priced
    other ways, with the same f + b: a replicated or an FSDP2 data axis) it takes: the one
    reaching farthest, the first on a tie. None when units are left over. Taking the farthest
    reach is optimal for a bound (a stage that ends later leaves the rest a suffix, and a suffix's
    cost only shrinks): module docstring; the variants change only memory, so the farthest of
    their reaches is the farthest any choice reaches."""
    n = len(variants[0])
    cuts, picks, i = [], [], 0
    for s in range(s_count):
        fl = in_flight_microbatches(schedule, s_count, s)
        reach = [_reach(v, i, n - (s_count - s - 1), fl, work_bound, memory_limit_bytes) for v in variants]
        k = max(range(len(variants)), key=lambda q: (reach[q], -q))
        j = reach[k]
        if j == i:
            return None
        if s < s_count - 1:
            cuts.append(j)
        picks.append(k)
        i = j
    return (tuple(cuts), tuple(picks)) if i == n else None


def _pack(units: Sequence[StageCost], s_count: int, schedule: Schedule, work_bound: float | None,
          memory_limit_bytes: float | None) -> tuple[int, ...] | None:
    """``_pack_choosing`` with one way to price the units: the cuts, or None."""
    r = _pack_choosing([units], s_count, schedule, work_bound, memory_limit_bytes)
    return r[0] if r is not None else None


def _cuts_for(units: Sequence[StageCost], s_count: int, schedule: Schedule,
              memory_limit_bytes: float | None) -> tuple[int, ...] | None:
    """Cuts (first unit of stages 1..S-1) minimising the bottleneck f + b under the memory limit,
    or None when no cut fits (module docstring: bisection + greedy packing)."""
    r = _cuts_choosing([units], s_count, schedule, memory_limit_bytes)
    return r[0] if r is not None else None


def _cuts_choosing(variants: Sequence[Sequence[StageCost]], s_count: int, schedule: Schedule,
                   memory_limit_bytes: float | None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``_cuts_for`` where each stage may take its units priced any of ``variants`` ways
    (``_pack_choosing``): the cuts and each stage's pick."""
    work = [u.fwd_s + u.bwd_s for u in variants[0]]
    if _pack_choosing(variants, s_count, schedule, None, memory_limit_bytes) is None:
        return None               # not even with time unbounded: memory rules every cut out
    hi = _least_passing(max(work), sum(work) * (1 + 1e-9), 1e-9,
                        lambda t: _pack_choosing(variants, s_count, schedule, t, memory_limit_bytes) is not None)
    return _pack_choosing(variants, s_count, schedule, hi, memory_limit_bytes)


def min_peak_bytes(units: Sequence[StageCost], s_count: int, schedule: Schedule) -> float:
    """The least per-rank peak (static + in-flight x activations of the fullest stage) any cut
    into ``s_count`` stages reaches: bisection on the limit with the greedy packing (what the
    refusal of a stage count names)."""
    lo, hi = 0.0, max(1.0, sum(u.static_bytes + u.transient_bytes + in_flight_microbatches(schedule, s_count, 0)
                               * u.act_bytes_per_microbatch for u in units))
    if any(u.static_bytes == float("inf") for u in units):
        return float("inf")
    return _least_passing(lo, hi, 1e-6, lambda m: _pack(units, s_count, schedule, None, m) is not None)


def _least_passing(lo: float, hi: float, rel: float, passes: Callable[[float], bool]) -> float:
    """Bisection for the least value in [lo, hi] that ``passes`` (monotone: passing at x passes
    above it; ``hi`` passes), to ``rel`` relative: the upper end of the last bracket."""
    for _ in range(200):
        if hi - lo <= rel * hi:
            break
        mid = 0.5 * (lo + hi)
        if passes(mid):
            hi = mid
        else:
            lo = mid
    return hi


def microbatch_counts(per_replica: int, s_count: int, schedule: str) -> list[int]:
    """M to try: every divisor of the per-replica batch (each microbatch a whole number of
    samples), at least S under 1F1B (torch's 1F1B needs a microbatch in flight per stage)."""
    return [m for m in range(1, per_replica + 1)
            if per_replica % m == 0 and (schedule != "1f1b" or m >= s_count)]


def search_stages(n_units: int, world: int, batch: int, unit_cost: UnitCost,
                  cut_send_s: Callable[[int, int, int, int, str], float], *, stage_counts: Sequence[int] | None = None,
                  tps: Sequence[int] = (1,), microbatches: int | None = None, schedule: str = "1f1b",
                  virtual: int = 1, memory_limit_bytes: float | None = None,
                  data_axes: Sequence[str] = ("replicate",), mixed: bool = True) -> StageSearch:
    """Try every (S, tp, M, data) -- S from ``stage_counts`` (default: every feasible count), tp
    from ``tps`` dividing the stage's ranks, dp the rest, M every divisor of the per-replica batch
    ``batch / dp`` (``microbatch_counts``; or ``microbatches`` fixed), what the dp axis does with
    the parameters from ``data_axes`` (``decomp.stages.STAGE_DATA``; dp 1: replicate only; with
    both and ``mixed``, also "mixed": each stage replicated where that reaches as far as FSDP2
    under the memory limit, else FSDP2, ``_pack_choosing``) -- with the best cuts of each; return them all and the
    fastest (ties: fewer stages, smaller tp, replicated before mixed before sharded).

    Pruning: every option's step is at least ``M W / S`` (W: one microbatch's f + b summed over
    the units; the bottleneck stage is at least the mean, and it runs M microbatches), so options
    are priced in order of that bound and one whose bound is not below the best step found is
    recorded as pruned, with its bound, without cutting it.

    A stage plan ("plan" in ``data_axes``: the solver's plan on all of a stage's ranks, recorded as
    dp = the stage's ranks, tp 1) takes M from the divisors of the whole batch, and its
    ``microbatch`` is the whole microbatch's samples (they need not split over the ranks: the
    plan may split them spatially, by channel...); it is tried where a stage has more than one
    rank, or everywhere when it is the only axis.

    ``cut_send_s(S, k, tp, microbatch, data)``: one microbatch's values over cut k of a layout of S
    stages (the caller knows the link level: stage ranks are consecutive blocks)."""
    feasible = feasible_stage_counts(n_units, world, virtual)
    counts = list(stage_counts) if stage_counts is not None else feasible
    bad = [s for s in counts if s not in feasible]
    if bad:
        raise PipelineError(f"--pipeline {bad[0]} is not feasible for {n_units} layers on {world} ranks",
                            f"use one of the feasible stage counts {feasible}")

    @functools.lru_cache(maxsize=None)
    def units_of(dp: int, tp: int, mb: int, data: str) -> tuple[StageCost, ...]:   # per (sub-mesh, microbatch)
        return tuple(unit_cost(i, dp, tp, mb, data) for i in range(n_units))

    options: list[StageOption] = []
    todo: list[tuple[float, int, int, int, int, int, str]] = []     # (bound, S, dp, tp, M, microbatch, data)
    block_axes = tuple(d for d in data_axes if d != "plan")

    def queue(s_count: int, dp: int, tp: int, m: int, mb: int, datas: Sequence[str], samples: int) -> None:
        """Check M against the schedule and queue each data axis with its lower bound."""
        try:
            Schedule(schedule, m, virtual)
        except PipelineError as e:
            options.append(StageOption(s_count, dp, tp, m, mb, schedule, refused=e.message))
            return
        if schedule == "1f1b" and m < s_count:
            options.append(StageOption(s_count, dp, tp, m, mb, schedule, refused=f"1F1B needs M >= S ({m} < {s_count})"))
            return
        for data in datas:
            work = sum(u.fwd_s + u.bwd_s for u in units_of(dp, tp, mb, "replicate" if data == "mixed" else data))
            if not math.isfinite(work):          # the sub-mesh has no sub-plan (none fits its budget)
                options.append(StageOption(s_count, dp, tp, m, mb, schedule, data=data,
                                           refused=f"no sub-plan on {dp * tp} ranks for {samples} samples "
                                                   "(the solver found none within its memory budget)"))
                continue
            todo.append((m * work / s_count, s_count, dp, tp, m, mb, data))

    for s_count in counts:
        per = world // s_count
        if "plan" in data_axes and (per > 1 or not block_axes):
            # a stage plan: the solver's plan on all ``per`` ranks for one microbatch of the whole batch
            # (``microbatch``: its samples; they need not split over the ranks: spatial, channel...)
            ms = [microbatches] if microbatches is not None else microbatch_counts(batch, s_count, schedule)
            if microbatches is not None and batch % microbatches:
                options.append(StageOption(s_count, per, 1, microbatches, 0, schedule, data="plan",
                                           refused=f"batch {batch} does not split into M {microbatches}"))
            else:
                for m in ms:
                    queue(s_count, per, 1, m, batch // m, ("plan",), batch // m)
        for tp in tps if block_axes else ():
            if per % tp:
                continue
            dp = per // tp
            if batch % dp:
                options.append(StageOption(s_count, dp, tp, 0, 0, schedule,
                                           refused=f"batch {batch} does not split over dp {dp}"))
                continue
            ms = [microbatches] if microbatches is not None else microbatch_counts(batch // dp, s_count, schedule)
            if microbatches is not None and (batch // dp) % microbatches:
                options.append(StageOption(s_count, dp, tp, microbatches, 0, schedule,
                                           refused=f"batch {batch} does not split into dp {dp} x M {microbatches}"))
                continue
            if not ms:
                options.append(StageOption(s_count, dp, tp, 0, 0, schedule,
                                           refused=f"the per-replica batch {batch // dp} has no M >= S = {s_count}"))
                continue
            for m in ms:
                mb = batch // (dp * m)
                datas = list(block_axes if dp > 1 else ("replicate",))
                if mixed and dp > 1 and {"replicate", "fsdp"} <= set(datas):
                    datas.append("mixed")       # each stage its own: replicated where it fits, else FSDP2
                queue(s_count, dp, tp, m, mb, datas, mb * dp)
    best: StageOption | None = None
    order = {d: i for i, d in enumerate(("replicate", "mixed", "fsdp", "plan"))}
    for bound, s_count, dp, tp, m, mb, data in sorted(todo, key=lambda t: (*t[:6], order.get(t[6], 9))):
        if best is not None and bound >= best.step_s:
            options.append(StageOption(s_count, dp, tp, m, mb, schedule, bound_s=bound, data=data,
                                       refused=f"pruned: lower bound {bound:.6g} s >= best {best.step_s:.6g} s"))
            continue
        sch = Schedule(schedule, m, virtual)
        axes = ("replicate", "fsdp") if data == "mixed" else (data,)     # the ways a stage may take
        variants = [units_of(dp, tp, mb, a) for a in axes]
        got = _cuts_choosing(variants, s_count, sch, memory_limit_bytes)
        if got is None and data == "mixed":
            options.append(StageOption(s_count, dp, tp, m, mb, schedule, bound_s=bound, data=data,
                                       refused="no cut leaves every stage within the memory limit"))
            continue
        if got is None:
            need = min_peak_bytes(variants[0], s_count, sch)
            options.append(StageOption(s_count, dp, tp, m, mb, schedule, bound_s=bound, min_peak_bytes=need, data=data,
                                       refused=f"no cut leaves every stage within the memory limit (the least "
                                               f"peak any cut reaches: {need / 2**20:.1f} MiB per rank)"))
            continue
        cuts, picks = got
        if data == "mixed" and len(set(picks)) == 1:      # every stage the same: the uniform option's
            options.append(StageOption(s_count, dp, tp, m, mb, schedule, bound_s=bound, data=data,
                                       refused=f"every stage takes {axes[picks[0]]}: the uniform option"))
            continue
        bounds = [0, *cuts, n_units]
        costs = [_sum(variants[picks[k]][bounds[k]:bounds[k + 1]]) for k in range(s_count)]
        sends = [cut_send_s(s_count, k, tp, mb, data) for k in range(s_count - 1)]
        op = StageOption(s_count, dp, tp, m, mb, schedule, cuts, price_pipeline(costs, sends, sch), bound_s=bound,
                         data=data, stage_data=tuple(axes[k] for k in picks) if data == "mixed" else ())
        options.append(op)
        if best is None or (op.step_s, op.stages, op.tp, order[op.data]) < \
                (best.step_s, best.stages, best.tp, order[best.data]):
            best = op
    return StageSearch(tuple(options), best)


def require_fit(search: StageSearch, world: int, n_units: int) -> StageOption:
    """The chosen option, or a named error listing the stage counts that fit and, for the others,
    the least memory per rank they reach."""
    if search.best is not None:
        return search.best
    raise PipelineError(f"no stage layout fits on {world} ranks for {n_units} layers "
                        f"(every one leaves a stage without memory or the batch unsplit)",
                        f"{memory_reach(search.options)}; raise the memory limit or the batch")


def memory_reach(options: Sequence[StageOption]) -> str:
    """'S stages: X MiB' per stage count: the least peak per rank any option of it reaches."""
    least: dict[int, float] = {}
    for o in options:
        v = o.min_peak_bytes if o.min_peak_bytes is not None else (
            max(o.price.peak_bytes) if o.price is not None else None)
        if v is not None:
            least[o.stages] = min(least.get(o.stages, float("inf")), v)
    fits = sorted({o.stages for o in options if o.price is not None})
    reach = ", ".join(f"{s}: {least[s] / 2**20:.1f} MiB" for s in sorted(least))
    return f"feasible stage counts: {fits or 'none'}; the least peak per rank each stage count reaches: {reach or 'none'}"


__all__ = ["StageOption", "StageSearch", "fsdp_unit_cost", "memory_reach", "microbatch_counts", "min_peak_bytes", "planned_cut_s",
           "require_fit", "search_stages"]
