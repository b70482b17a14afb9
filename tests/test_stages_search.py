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


def _uniform(i, dp, tp, mb):
    """A block whose compute splits perfectly over dp x tp; params split over tp only."""
    return StageCost(1e-3 * mb / tp, 2e-3 * mb / tp, 1e-4, act_bytes_per_microbatch=mb * 1e6 / tp,
                     static_bytes=16e6 / tp)


def test_no_pipeline_when_everything_fits_and_stages_when_memory_forces_them():
    free = search_stages(8, 8, 64, _uniform, lambda s, tp, mb: 1e-5)
    assert free.best.stages == 1       # bubble-free data parallelism wins when it fits
    tight = search_stages(8, 8, 64, _uniform, lambda s, tp, mb: 1e-5, memory_limit_bytes=80e6)
    assert tight.best.stages > 1
    best = tight.best
    assert best.price.peak_bytes and max(best.price.peak_bytes) <= 80e6
    per = tight.best_per_stage_count()
    assert sorted(per) == [1, 2, 4, 8]                 # every count recorded
    assert per[1].refused is not None or per[1].price is not None
    assert any(o.refused and "memory" in o.refused for o in tight.options)


def test_uniform_blocks_are_cut_evenly():
    s = search_stages(8, 4, 16, _uniform, lambda s, tp, mb: 1e-5, stage_counts=[4])
    assert s.best.cuts == (2, 4, 6)


def test_infeasible_requests_are_named():
    with pytest.raises(PipelineError, match=r"feasible stage counts \[1, 2, 4, 8\]"):
        search_stages(8, 8, 64, _uniform, lambda s, tp, mb: 0.0, stage_counts=[3])
    nothing = search_stages(8, 8, 64, _uniform, lambda s, tp, mb: 0.0, memory_limit_bytes=1.0)
    with pytest.raises(PipelineError, match="feasible stage counts: none"):
        require_fit(nothing, 8, 8)
