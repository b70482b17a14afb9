"""Tournament training (LTFB) of a batch-norm CNN against its single-process simulation: every
batch-norm semantics the plan offers (local statistics with the default and an explicit group,
global statistics), trainers of 2 ranks (2 x 2 at world 4, on the native path and the traced
op-by-op path) and of 1 rank (4 x 1), every surviving trainer's parameters AND buffers
(running statistics and their counters) compared in float64; the survivors of a killed trainer
validated against a simulation of the surviving set; the bytes of the exchange counted and
priced in the run's dtype.

The model is a small BN CNN written here (two conv + batch-norm blocks, 6 x 6 images), so a run
of 2 rounds x 2 steps takes a few seconds on 2 cores."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest

from autopar.artifacts import PlanHooks, PlanOptions
from autopar.planner import make_tournament_plan
from autopar.tournament.pricing import TournamentOptions

BN_CNN = '''
"""A small batch-norm CNN for the tournament tests."""
import torch
from torch import nn
import torch.nn.functional as F

DEFAULT_BATCH_SIZE = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 6, 6),)


def example_targets(batch_size):
    return torch.randint(0, 3, (batch_size,))


def loss_fn(output, target):
    return F.cross_entropy(output, target)
'''

#: parameters (conv1, bn1 w/b, conv2, bn2 w/b, head w/b) and buffers (2 x running mean, var, count)
N_PARAMS, N_BUFFERS = 8, 6
PARAM_NUMEL = 4 * 3 * 9 + 4 + 4 + 4 * 4 * 9 + 4 + 4 + 3 * 4 + 3
BUFFER_FLOAT_NUMEL, BUFFER_INT_NUMEL = 2 * (4 + 4), 2


def _bn_plan(tmp_path, profile, name, trainers=2, batch_norm="local", bn_group=None, **kw):
    mf = tmp_path / "bn_cnn.py"
    if not mf.exists():
        mf.write_text(BN_CNN)
    return make_tournament_plan(
        mf, PlanOptions(world_size=4, batch_size=8, out_dir=str(tmp_path / f"plan-{name}"),
                        batch_norm=batch_norm, bn_group=bn_group),
        TournamentOptions(trainers=trainers, interval_steps=2, train_samples_per_trainer=24,
                          tournament_samples=16, **kw),
        PlanHooks(profile=profile))


def _run(plan_path, tmp_path, name, **kw):
    from autopar.tournament.run import execute_tournament
    from autopar.tournament.runtime import TournamentRunOptions
    opts = TournamentRunOptions(rounds=kw.pop("rounds", 2), timeout_s=kw.pop("timeout_s", 120), **kw)
    tmp = tmp_path / f"{name}-tmp"
    tmp.mkdir()
    before, tempfile.tempdir = tempfile.tempdir, str(tmp)
    try:
        return execute_tournament(plan_path, opts, out_dir=tmp_path / name, progress=lambda s: None)
    finally:
        tempfile.tempdir = before


def _sim_params(plan, plan_path, **kw):
    from autopar.tournament.runtime import TournamentRunOptions
    from autopar.tournament.simulate import simulate
    return simulate(plan, plan_path, TournamentRunOptions(rounds=2, **kw))["params"]


def _max_diff(pa, pb) -> float:
    return max(float((pa[t][q] - pb[t][q]).abs().max()) for t in range(len(pa)) for q in pa[t])


# ---- runs (gloo, real processes) ----------------------------------------------------------------

@pytest.mark.dist
@pytest.mark.parametrize("case", ["local", "local-traced", "local-G2", "global"])
def test_two_trainers_of_two_ranks_with_batch_norm_equal_the_simulation(tmp_path, profile, monkeypatch, case):
    """2 x 2 at world 4 under each batch-norm semantics: every trainer's parameters and buffers
    (running mean, variance, counter) equal the simulation's, every winner too. "traced": the
    op-by-op runtime (AUTOPAR_NATIVE=0), where an evaluation's batch norms record running-stat
    updates that must not reach the next exchange."""
    mode = "global" if case == "global" else "local"
    res = _bn_plan(tmp_path, profile, case, batch_norm=mode, bn_group=2 if case == "local-G2" else None)
    plan = res.plan
    want_group = {"local": 4, "local-traced": 4, "local-G2": 2, "global": None}[case]
    assert (plan.bn_stats().mode, plan.bn_stats().group) == (mode, want_group)
    assert plan.trainers.ranks_per_trainer == 2
    if case == "local-traced":
        monkeypatch.setenv("AUTOPAR_NATIVE", "0")
    run, out = _run(res.plan_path, tmp_path, case)
    v = run["validation"]
    assert v["passed"] and v["winners_equal"] and v["alive_equal"], v
    assert v["checked"] == 2 * (N_PARAMS + N_BUFFERS), v          # buffers compared, not only weights
    assert v["max_rel_diff"] <= 1e-9 and v["survivors"] == [0, 1]
    # the semantics matter here: the simulation under the other statistics differs, so the
    # comparison above could not pass with the wrong ones
    other = dataclasses.replace(plan, batch_norm={"mode": "local", "group": 2} if mode == "global"
                                else {"mode": "global", "group": None})
    assert _max_diff(_sim_params(plan, res.plan_path), _sim_params(other, res.plan_path)) > 1e-4


@pytest.mark.dist
def test_four_trainers_of_one_rank_with_batch_norm_equal_the_simulation(tmp_path, profile):
    res = _bn_plan(tmp_path, profile, "t4", trainers=4, exchange="weights+optimizer")
    assert res.plan.trainers.ranks_per_trainer == 1
    run, _ = _run(res.plan_path, tmp_path, "t4")
    v = run["validation"]
    assert v["passed"] and v["checked"] == 4 * (N_PARAMS + N_BUFFERS), v


@pytest.mark.dist
def test_the_survivors_of_a_killed_trainer_equal_a_simulation_of_the_surviving_set(tmp_path, profile):
    """Trainer 1 of 4 killed before round 1: trainers 0, 2, 3 are validated (parameters,
    buffers, living sets, winners) against the simulation where trainer 1 plays round 0 only."""
    res = _bn_plan(tmp_path, profile, "kill", trainers=4)
    run, _ = _run(res.plan_path, tmp_path, "kill", rounds=3, kill=(1, 1), timeout_s=60)
    assert run["stopped"] == [1]
    v = run["validation"]
    assert "skipped" not in v, v
    assert v["passed"] and v["alive_equal"] and v["winners_equal"], v
    assert v["survivors"] == [0, 2, 3] and v["checked"] == 3 * (N_PARAMS + N_BUFFERS)
    assert [lg["alive"] for lg in run["rounds_log"]] == [[0, 1, 2, 3], [0, 2, 3], [0, 2, 3]]


@pytest.mark.dist
def test_exchange_bytes_count_every_tensor_sent_and_match_the_price_in_the_run_dtype(tmp_path, profile):
    """Each rank sends its parameter shards and every buffer whole (float64 running statistics,
    int64 counters); run.json counts them, per round and trainer and in total, and the plan's
    price in the run's dtype names the same bytes."""
    res = _bn_plan(tmp_path, profile, "bytes", trainers=4)
    run, out = _run(res.plan_path, tmp_path, "bytes")
    per_rank = 8 * (PARAM_NUMEL + BUFFER_FLOAT_NUMEL) + 8 * BUFFER_INT_NUMEL     # one rank holds all
    m = run["measured"]
    assert m["exchange_bytes_per_rank"] == per_rank
    rounds = run["rounds_log"]
    assert all(x["exchange_bytes"] == (per_rank if x["partner"] != x["trainer"] else 0)
               for lg in rounds for x in lg["results"])
    assert m["exchange_bytes"] == sum(x["exchange_bytes"] for lg in rounds for x in lg["results"]) == 2 * 4 * per_rank
    p = run["predicted"]
    assert p["priced_dtype"] == "float64" and p["exchange_bytes_per_rank"] == per_rank
    pred = res.plan.trainers.predicted.extra    # the per-dtype figures (artifacts.TrainerPrediction)
    assert pred["exchange_bytes_per_rank_float32"] == 4 * (PARAM_NUMEL + BUFFER_FLOAT_NUMEL) + 8 * BUFFER_INT_NUMEL
    assert pred["exchange_s_float64"] > pred["exchange_s_float32"] > 0
    assert f"| exchange per rank (bytes) | {per_rank} | {per_rank} |" in (out / "report.md").read_text()
