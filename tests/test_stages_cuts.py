"""Values crossing a pipeline cut, planned as redistributions between the two stages' sub-meshes
(issue 41 item 1): the planned steps, their price against the single message the cut was priced
with before, a dp change across a cut, a value without a batch dim, plan.json's record, and the
run-time check of what torch sends against the plan (pure; the runs are in test_stages_runtime)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from autopar.cost.primitives import blocking_s
from autopar.cost.stages import planned_cut_s
from autopar.decomp.base import CostContext
from autopar.decomp.distspec import Replicate, Shard
from autopar.decomp.redistribute import MeshSend
from autopar.decomp.stages import (CutPlan, CutValue, Schedule, Stage, cut_send_time_s, cut_value_spec, even_layout,
                                   plan_cut, plan_cuts)
from autopar.runtime.stages import CutMessageMismatch, check_cut_messages

from fakes import synthetic_profile

ROOT = Path(__file__).resolve().parents[1]


def _stage(i, ranks, dp, tp):
    return Stage(i, i, i + 1, tuple(ranks), dp, tp)


@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_equal_sub_meshes_send_each_block_to_its_peer_and_price_as_the_one_message(dp, tp):
    """Same dp x tp on both sides: the plan is one MeshSend, one message per value from each rank to
    its peer (same coordinates) of its block (samples split over dp, whole over tp); its price is
    cut_send_time_s's one p2p of the bytes per rank, on both link levels (synthetic profile: no
    in-situ latency, so blocking_s is the fit itself)."""
    n = dp * tp
    for rpn, level in ((8, "intra"), (4, "inter")):      # both stages on one node; each on its own
        prof = synthetic_profile(ranks_per_node=rpn)
        a = _stage(0, range(0, n), dp, tp)
        b = _stage(1, range(4, 4 + n), dp, tp)
        v = CutValue("h", (dp * 3, 8, 16), 4)
        plan = plan_cut(0, a, b, [v])
        (steps,) = plan.steps
        assert len(steps) == 1 and isinstance(steps[0], MeshSend)
        assert cut_value_spec(a, v).placements == (Shard(0), Replicate())
        msgs = plan.messages()
        assert sorted(msgs) == [(r, a.peer(r, b)) for r in a.ranks]
        assert all(boxes == ((3, 8, 16),) for boxes in msgs.values())
        ctx = CostContext(profile=prof, world=8, ranks_per_node=rpn)
        per_rank = 3 * 8 * 16 * 4
        want = cut_send_time_s(prof, per_rank, a.ranks, b.ranks)
        assert planned_cut_s(plan, ctx) == pytest.approx(want, rel=1e-12)
        assert want == pytest.approx(prof.collective_time_s("p2p", 2, per_rank, level=level), rel=1e-12)
        assert CutPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_two_values_are_two_messages_per_rank_pair_and_their_prices_add():
    prof = synthetic_profile(ranks_per_node=4)
    ctx = CostContext(profile=prof, world=4, ranks_per_node=4)
    a, b = _stage(0, (0, 1), 2, 1), _stage(1, (2, 3), 2, 1)
    vals = [CutValue("x", (4, 8), 8), CutValue("gate", (4, 8), 8)]
    plan = plan_cut(0, a, b, vals)
    assert plan.messages() == {(0, 2): ((2, 8), (2, 8)), (1, 3): ((2, 8), (2, 8))}
    one = cut_send_time_s(prof, 2 * 8 * 8, a.ranks, b.ranks)
    assert planned_cut_s(plan, ctx) == pytest.approx(2 * one, rel=1e-12)     # a latency per message
    assert planned_cut_s(plan, ctx) > cut_send_time_s(prof, 2 * 2 * 8 * 8, a.ranks, b.ranks)


def test_a_dp_change_across_a_cut_is_priced_by_the_planned_boxes():
    """Stage A dp 2 (ranks 0, 1) -> stage B dp 1 x tp 2 (ranks 2, 3): each rank of B needs the whole
    microbatch, half from each rank of A; A's ranks each send two half-boxes. Priced as the busiest
    rank's bytes (one whole microbatch: B's ranks receive it) in one p2p plus one more latency (two
    messages), not as the one half-size message per peer the equal-mesh formula would give."""
    prof = synthetic_profile(ranks_per_node=4)
    ctx = CostContext(profile=prof, world=4, ranks_per_node=4)
    a, b = _stage(0, (0, 1), 2, 1), _stage(1, (2, 3), 1, 2)
    v = CutValue("h", (4, 8, 16), 4)
    plan = plan_cut(0, a, b, [v])
    assert plan.messages() == {(0, 2): ((2, 8, 16),), (0, 3): ((2, 8, 16),), (1, 2): ((2, 8, 16),),
                               (1, 3): ((2, 8, 16),)}
    (send,) = plan.steps[0]
    assert send.payload_bytes(4) == 4 * 8 * 16 * 4 and send.messages == 2
    want = blocking_s(ctx, "p2p", 2, 4 * 8 * 16 * 4, "intra") + blocking_s(ctx, "p2p", 2, 0.0, "intra")
    assert planned_cut_s(plan, ctx) == pytest.approx(want, rel=1e-12)
    assert planned_cut_s(plan, ctx) > cut_send_time_s(prof, 2 * 8 * 16 * 4, a.ranks, b.ranks)


def test_a_value_without_batch_dim_crosses_whole_and_does_not_grow_with_the_microbatch():
    """A mask every rank holds whole: each rank of B gets it whole from a rank of A (its peer: the
    planner spreads the load), the same bytes whatever the microbatch or dp."""
    prof = synthetic_profile(ranks_per_node=4)
    ctx = CostContext(profile=prof, world=8, ranks_per_node=4)
    a, b = _stage(0, (0, 1, 2, 3), 2, 2), _stage(1, (4, 5, 6, 7), 2, 2)
    mask = CutValue("mask", (8, 8), 1, batched=False)
    plan = plan_cut(0, a, b, [mask])
    assert cut_value_spec(a, mask).placements == (Replicate(), Replicate())
    assert plan.messages() == {(r, r + 4): ((8, 8),) for r in range(4)}
    assert planned_cut_s(plan, ctx) == pytest.approx(cut_send_time_s(prof, 64, a.ranks, b.ranks), rel=1e-12)


def test_on_a_measured_profile_the_planned_price_carries_its_in_situ_p2p_latency():
    """The gloo profile measured the p2p latency inside a step: the planned price is blocking_s (the
    fit with its latency raised to that), i.e. the one-message price plus the difference."""
    from autopar.profile import load_profile
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    ctx = CostContext(profile=prof, world=4, ranks_per_node=4)
    a, b = _stage(0, (0, 1), 2, 1), _stage(1, (2, 3), 2, 1)
    plan = plan_cut(0, a, b, [CutValue("h", (4, 8, 16), 4)])
    n = 2 * 8 * 16 * 4
    assert planned_cut_s(plan, ctx) == pytest.approx(blocking_s(ctx, "p2p", 2, n, "intra"), rel=1e-12)
    assert planned_cut_s(plan, ctx) >= cut_send_time_s(prof, n, a.ranks, b.ranks)


def test_check_cut_messages_names_what_torch_sent_against_the_plan():
    layout = even_layout(2, 2, 2, Schedule("gpipe", 2))
    cuts = plan_cuts(layout, [[CutValue("h", (3, 4), 8)]])
    runner = SimpleNamespace(layout=layout, rank=0, stage=layout.stages[0], modules=[(0, None)])
    good = {(0, 0): [(1, (3, 4), 96)], (0, 1): [(1, (3, 4), 96)]}        # (chunk, microbatch): sends
    assert check_cut_messages(runner, good, cuts, itemsize=8) == 2
    with pytest.raises(CutMessageMismatch, match=r"torch sent \{1: \[\(3, 5\)\]\}"):
        check_cut_messages(runner, {(0, 0): [(1, (3, 5), 120)], (0, 1): [(1, (3, 4), 96)]}, cuts)
    with pytest.raises(CutMessageMismatch, match="bytes per element"):
        check_cut_messages(runner, good, cuts, itemsize=4)
    with pytest.raises(CutMessageMismatch, match="sent 1 microbatches"):
        check_cut_messages(runner, {(0, 0): good[(0, 0)]}, cuts)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_chunk_cuts_with_two_chunks_per_rank(schedule):
    """V = 2 chunks per rank on 2 rank groups: 3 chunk cuts, each from the group holding chunk c
    to the one holding c + 1 (looped: 0 -> 1 -> 0 -> 1; V-shaped: 0 -> 1 -> 1 -> 0, the middle cut
    on one group, no message); each rank's sends checked chunk by chunk."""
    from autopar.decomp.stages import chunk_holder
    layout = even_layout(4, 2, 2, Schedule(schedule, 2, 2))
    cuts = plan_cuts(layout, [[CutValue("h", (3, 4), 8)]] * 3)
    holders = [chunk_holder(layout, c) for c in range(4)]
    assert holders == ([0, 1, 0, 1] if schedule == "interleaved_1f1b" else [0, 1, 1, 0])
    assert [(c.to_json()["from_stage"], c.to_json()["to_stage"]) for c in cuts] == list(zip(holders, holders[1:]))
    for rank in (0, 1):
        chunks = [c for c in range(4) if holders[c] == rank]
        runner = SimpleNamespace(layout=layout, rank=rank, modules=[(c, None) for c in chunks])
        log = {}
        for c in chunks:
            for mb in range(2):
                peer = holders[c + 1] if c < 3 else None
                log[(c, mb)] = [] if peer in (None, rank) else [(peer, (3, 4), 96)]
        sent = sum(1 for v in log.values() for _ in v)
        assert check_cut_messages(runner, log, cuts, itemsize=8) == sent
        bad = {k: ([(1 - rank, (3, 4), 96)] if k[0] == 3 else v) for k, v in log.items()}
        if 3 in chunks:
            with pytest.raises(CutMessageMismatch, match="last chunk"):
                check_cut_messages(runner, bad, cuts)


def test_plan_json_records_each_cut_and_prices_the_schedule_with_it(monkeypatch, tmp_path):
    """plan --pipeline 2 at world 4: runtime.cuts holds, per cut and value, the planned steps (a
    MeshSend from each rank to its peer), and the schedule's send term is the 1F1B formula over
    that cut's planned price."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    for k, v in {"AUTOPAR_GPT_LAYERS": "4", "AUTOPAR_GPT_EMBED": "16", "AUTOPAR_GPT_HEADS": "4",
                 "AUTOPAR_GPT_SEQ": "8", "AUTOPAR_GPT_VOCAB": "32"}.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    res = make_plan(ROOT / "strategies/examples/gpt.py",
                    PlanOptions(world_size=4, batch_size=8, placement="block", trace_cache=False, pipeline=2,
                                microbatches=4, out_dir=str(tmp_path / "plan")), PlanHooks(profile=prof))
    rt = json.loads(res.plan_path.read_text())["runtime"]
    (cut,) = rt["cuts"]
    (val,) = cut["values"]
    st = rt["stages"]["stages"]
    dp, mb = st[0]["dp"], 8 // st[0]["dp"] // 4
    assert val["shape"] == [dp * mb, 8, 16] and val["batched"] and val["itemsize"] == 4
    assert val["steps_str"].startswith("MeshSend(")
    plan = CutPlan.from_json(cut)
    assert sorted(plan.messages()) == [(r, r + len(st[0]["ranks"])) for r in st[0]["ranks"]]
    c = planned_cut_s(plan, res.table.ctx)
    s_count, m = 2, 4
    assert rt["price"]["send_s"] == pytest.approx(2 * c * ((s_count - 1) * m / s_count + s_count - 2), rel=1e-12)
