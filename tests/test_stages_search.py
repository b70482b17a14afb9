"""The stage search (``autopar.cost.stages``): cuts against brute force, memory forcing stages,
every stage count recorded, infeasible requests named. Pure."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.cost.stages import _cuts_for, require_fit, search_stages
from autopar.decomp.stages import Schedule, StageCost, in_flight_microbatches
from autopar.errors import PipelineError


def _brute(units, s_count, schedule, limit):
    n, best = len(units), None
    for cuts in itertools.combinations(range(1, n), s_count - 1):
        b = [0, *cuts, n]
        ok, worst = True, 0.0
        for k in range(s_count):
            seg = units[b[k]:b[k + 1]]
            mem = sum(u.static_bytes for u in seg) + in_flight_microbatches(schedule, s_count, k) * \
                sum(u.act_bytes_per_microbatch for u in seg)
            if limit is not None and mem > limit:
                ok = False
            worst = max(worst, sum(u.fwd_s + u.bwd_s for u in seg))
        if ok and (best is None or worst < best):
            best = worst
    return best


def test_cuts_minimise_the_bottleneck_like_brute_force_with_and_without_memory():
    rng = random.Random(7)
    for _ in range(150):
        n, s_count = rng.randint(2, 9), rng.randint(1, 4)
        if s_count > n:
            continue
        units = [StageCost(rng.uniform(0.1, 1), rng.uniform(0.2, 2), 0, rng.uniform(1, 5), rng.uniform(1, 5))
                 for _ in range(n)]
        sch = Schedule("1f1b", 8)
        limit = rng.choice([None, 20.0, 40.0])
        want = _brute(units, s_count, sch, limit)
        cuts = _cuts_for(units, s_count, sch, limit)
        if want is None:
            assert cuts is None
            continue
        b = [0, *cuts, n]
        got = max(sum(u.fwd_s + u.bwd_s for u in units[b[k]:b[k + 1]]) for k in range(s_count))
        assert got == pytest.approx(want, rel=1e-8)


def _uniform(i, dp, tp, mb, data="replicate"):
    """A block whose compute splits perfectly over dp x tp; params split over tp only."""
    return StageCost(1e-3 * mb / tp, 2e-3 * mb / tp, 1e-4, act_bytes_per_microbatch=mb * 1e6 / tp,
                     static_bytes=16e6 / tp)


def test_no_pipeline_when_everything_fits_and_stages_when_memory_forces_them():
    free = search_stages(8, 8, 64, _uniform, lambda S, k, tp, mb, data: 1e-5)
    assert free.best.stages == 1       # bubble-free data parallelism wins when it fits
    tight = search_stages(8, 8, 64, _uniform, lambda S, k, tp, mb, data: 1e-5, memory_limit_bytes=80e6)
    assert tight.best.stages > 1
    best = tight.best
    assert best.price.peak_bytes and max(best.price.peak_bytes) <= 80e6
    per = tight.best_per_stage_count()
    assert sorted(per) == [1, 2, 4, 8]                 # every count recorded
    assert per[1].refused is not None or per[1].price is not None
    assert any(o.refused and "memory" in o.refused for o in tight.options)


def test_uniform_blocks_are_cut_evenly():
    s = search_stages(8, 4, 16, _uniform, lambda S, k, tp, mb, data: 1e-5, stage_counts=[4])
    assert s.best.cuts == (2, 4, 6)


def test_infeasible_requests_are_named():
    with pytest.raises(PipelineError, match=r"feasible stage counts \[1, 2, 4, 8\]"):
        search_stages(8, 8, 64, _uniform, lambda S, k, tp, mb, data: 0.0, stage_counts=[3])
    nothing = search_stages(8, 8, 64, _uniform, lambda S, k, tp, mb, data: 0.0, memory_limit_bytes=1.0)
    with pytest.raises(PipelineError, match="feasible stage counts: none"):
        require_fit(nothing, 8, 8)


def _exhaustive_best(n, world, batch, unit, limit, schedule="1f1b"):
    """Every (S, tp, M) cut and priced, nothing pruned: the reference for the pruned search."""
    from autopar.cost.stages import _sum, microbatch_counts
    from autopar.decomp.stages import feasible_stage_counts, price_pipeline
    best = None
    for s_count in feasible_stage_counts(n, world):
        for tp in (1, 2):
            per = world // s_count
            if per % tp or batch % (per // tp):
                continue
            dp = per // tp
            for m in microbatch_counts(batch // dp, s_count, schedule):
                mb = batch // (dp * m)
                units = [unit(i, dp, tp, mb) for i in range(n)]
                sch = Schedule(schedule, m)
                cuts = _cuts_for(units, s_count, sch, limit)
                if cuts is None:
                    continue
                b = [0, *cuts, n]
                p = price_pipeline([_sum(units[b[k]:b[k + 1]]) for k in range(s_count)], [1e-5] * (s_count - 1), sch)
                best = p.step_s if best is None else min(best, p.step_s)
    return best


def test_pruning_by_the_lower_bound_keeps_the_best_and_every_m_divisor_is_tried():
    def unit(i, dp, tp, mb, data="replicate"):        # uneven blocks, a per-microbatch overhead: M matters both ways
        return StageCost(1e-3 * (1 + i % 3) * mb / tp + 2e-4, 2e-3 * mb / tp + 2e-4, 1e-4 * dp,
                         act_bytes_per_microbatch=mb * 1e6 / tp, static_bytes=16e6 / tp)
    for limit in (None, 60e6):
        s = search_stages(8, 8, 32, unit, lambda S, k, tp, mb, data: 1e-5, tps=(1, 2), memory_limit_bytes=limit)
        assert s.best.step_s == pytest.approx(_exhaustive_best(8, 8, 32, unit, limit), rel=1e-12)
        if limit is None:      # the unsplit data-parallel option is found early and bounds most others
            assert sum(1 for o in s.options if o.refused and o.refused.startswith("pruned")) > 10
        assert all(o.bound_s <= o.step_s * (1 + 1e-12) for o in s.options if o.price is not None)
    tried = {o.microbatches for o in s.options if o.stages == 2 and o.dp == 4}
    assert tried == {2, 4, 8}      # per-replica batch 8: every divisor >= S = 2


def test_min_peak_bytes_is_the_least_peak_of_any_cut():
    from autopar.cost.stages import min_peak_bytes
    rng = random.Random(3)
    for _ in range(60):
        n, s_count = rng.randint(2, 8), rng.randint(1, 4)
        if s_count > n:
            continue
        units = [StageCost(1, 1, 0, rng.uniform(1, 5), rng.uniform(1, 5)) for _ in range(n)]
        sch = Schedule("1f1b", 8)
        best = min(max(sum(u.static_bytes for u in units[b[k]:b[k + 1]]) + in_flight_microbatches(sch, s_count, k) *
                       sum(u.act_bytes_per_microbatch for u in units[b[k]:b[k + 1]]) for k in range(s_count))
                   for cuts in itertools.combinations(range(1, n), s_count - 1) for b in [[0, *cuts, n]])
        assert min_peak_bytes(units, s_count, sch) == pytest.approx(best, rel=1e-5)


def test_nothing_fitting_names_the_memory_each_stage_count_reaches():
    nothing = search_stages(8, 8, 64, _uniform, lambda S, k, tp, mb, data: 0.0, memory_limit_bytes=1e6)
    with pytest.raises(PipelineError, match=r"least peak per rank each stage count reaches: 1: [\d.]+ MiB, 2: "):
        require_fit(nothing, 8, 8)


def test_each_stage_takes_fsdp_only_where_memory_needs_it():
    """1F1B keeps 2 microbatches in flight on stage 0 and 1 on stage 1: under a limit only an
    FSDP2 stage 0 fits its half of the blocks, while stage 1 fits replicated. The search's "mixed"
    option shards stage 0 only and beats sharding both (its gathers add to the fill); replicating
    both fits no cut."""
    from autopar.decomp.stages import StageCost

    def unit(i, dp, tp, mb, data="replicate"):
        if data == "fsdp":
            return StageCost(1.0, 1.0, 0.5, 10.0, 60.0, fill_s=0.2)
        return StageCost(1.0, 1.0, 0.1, 10.0, 100.0)
    kw = dict(stage_counts=[2], microbatches=4, memory_limit_bytes=460.0)
    s = search_stages(8, 4, 8, unit, lambda S, k, tp, mb, data: 0.0, data_axes=("replicate", "fsdp"), **kw)
    by = {o.data: o for o in s.options}
    assert by["replicate"].price is None and "memory" in by["replicate"].refused
    assert s.best.data == "mixed" and s.best.stage_data == ("fsdp", "replicate") and s.best.cuts == (4,)
    assert s.best.step_s < by["fsdp"].step_s
    assert s.best.to_json()["stage_data"] == ["fsdp", "replicate"]
    alone = search_stages(8, 4, 8, unit, lambda S, k, tp, mb, data: 0.0, data_axes=("replicate", "fsdp"), mixed=False, **kw)
    assert alone.best.data == "fsdp" and all(o.data != "mixed" for o in alone.options)
