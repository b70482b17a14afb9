"""The tournament's rules held against hand-written tables, for both the run time
(``autopar.tournament.runtime``) and the single-process reference (``autopar.tournament.simulate``),
which writes its own versions and must not import the run time's (a reference that calls the
code it checks cannot find a bug in it). Pure logic: no process group."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from autopar.tournament import runtime as rt
from autopar.tournament import simulate as ref

NAN, INF = math.nan, math.inf


def test_the_reference_imports_none_of_the_run_time_it_checks():
    tree = ast.parse(Path(ref.__file__).read_text())
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = "autopar.tournament." if node.level == 1 else ("autopar." if node.level == 2 else "")
            imported.append(base + (node.module or ""))
        elif isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
    assert "autopar.execute.validate" in imported          # the walk sees the function-level imports
    assert not [m for m in imported if m.startswith("autopar.tournament.runtime")], imported


# ---- pairing: a seeded shuffle of the sorted living trainers, paired in order ---------------------

#: (alive, seed, round) -> partners. The shuffle is ``random.Random("ltfb:<seed>:<round>")``
#: (CPython's Mersenne Twister seeded from the string): these rows pin it, so a change of the
#: pairing rule or of its seed string shows up here, not as a silent re-pairing of every run.
PAIRING = [
    (([0, 1, 2, 3], 0, 0), {0: 1, 1: 0, 2: 3, 3: 2}),
    (([0, 1, 2, 3], 0, 1), {0: 1, 1: 0, 2: 3, 3: 2}),
    (([0, 2, 3], 0, 1), {0: 0, 2: 3, 3: 2}),
    (([0, 1, 2, 3, 4, 5, 6, 7], 3, 5), {0: 1, 1: 0, 2: 4, 4: 2, 3: 5, 5: 3, 6: 7, 7: 6}),
    (([5], 1, 0), {5: 5}),
    (([1, 4, 6, 7, 9], 2, 4), {1: 9, 9: 1, 4: 6, 6: 4, 7: 7}),
]


@pytest.mark.parametrize("fn", [rt.pairing, ref.reference_pairs], ids=["runtime", "reference"])
@pytest.mark.parametrize("args,want", PAIRING)
def test_pairing_table(fn, args, want):
    alive, seed, k = args
    assert fn(alive, seed, k) == want
    assert fn(list(reversed(alive)), seed, k) == want      # the order the living are listed in is free


def test_reference_and_runtime_pairings_agree_beyond_the_table():
    for n in range(1, 9):
        for k in range(6):
            alive = list(range(0, 2 * n, 2))
            assert ref.reference_pairs(alive, 7, k) == rt.pairing(alive, 7, k)


# ---- decision: lower wins, ties keep the own model, a non-finite metric loses ----------------------

#: (own metric, partner's metric) -> keep the partner's model?
DECIDE = [
    ((1.0, 0.5), True), ((0.5, 1.0), False), ((1.0, 1.0), False), ((1.0, None), False),
    ((NAN, 0.5), True), ((INF, 0.5), True), ((0.5, NAN), False), ((0.5, INF), False),
    ((NAN, NAN), False), ((INF, INF), False), ((NAN, -INF), False), ((-1.0, -2.0), True),
]


@pytest.mark.parametrize("args,want", DECIDE)
def test_decision_table(args, want):
    assert rt.decide(*args)[0] is want
    assert ref.reference_keeps_partner(*args) is want


# ---- data: T contiguous blocks (or the model file's shard), train then tournament samples -----------

def _mf(module=None):
    """A model file whose samples are numbered: input row i holds i, target i = 100 + i."""
    return SimpleNamespace(module=module or SimpleNamespace(),
                           example_inputs=lambda n: (torch.arange(n, dtype=torch.float64).reshape(n, 1),),
                           example_targets=lambda n: torch.arange(n) + 100)


LEVEL = SimpleNamespace(trainers=2, train_samples_per_trainer=4, tournament_samples=2, data_seed=0)

#: trainer -> (training samples, tournament samples) of 12 numbered samples, T = 2, 4 + 2 each
SPLIT_BLOCKS = {0: ([0, 1, 2, 3], [4, 5]), 1: ([6, 7, 8, 9], [10, 11])}
#: the same with the model file's shard = every T-th sample from t
SPLIT_STRIDED = {0: ([0, 2, 4, 6], [8, 10]), 1: ([1, 3, 5, 7], [9, 11])}


def _strided_module():
    def make_dataset(n, seed):
        return (torch.arange(n, dtype=torch.float64).reshape(n, 1),), torch.arange(n) + 100

    def shard(dataset, t, T):
        (x,), y = dataset
        return (x[t::T],), y[t::T]
    return SimpleNamespace(make_dataset=make_dataset, shard=shard)


@pytest.mark.parametrize("module,table", [(None, SPLIT_BLOCKS), (_strided_module(), SPLIT_STRIDED)],
                         ids=["blocks", "model-file-shard"])
def test_data_split_table(module, table):
    mf = _mf(module)
    dataset = ref._dataset(mf, LEVEL)
    for t, (train, tour) in table.items():
        d = rt.trainer_data(mf, LEVEL, t)
        assert d.train_inputs[0].flatten().tolist() == train and d.tour_inputs[0].flatten().tolist() == tour
        assert d.train_targets.tolist() == [100 + i for i in train] and d.tour_targets.tolist() == [100 + i for i in tour]
        tx, ty, ux, uy = ref._trainer_split(mf, LEVEL, dataset, t)
        assert tx[0].flatten().tolist() == train and ux[0].flatten().tolist() == tour
        assert ty.tolist() == [100 + i for i in train] and uy.tolist() == [100 + i for i in tour]


#: step -> the samples of its batch (B = 2 of trainer 1's 4 training samples [6, 7, 8, 9]: cyclic)
BATCHES = {0: [6, 7], 1: [8, 9], 2: [6, 7], 5: [8, 9]}


def test_batch_table():
    d = rt.trainer_data(_mf(), LEVEL, 1)
    for step, want in BATCHES.items():
        xs, ys = rt.batch_of(d.train_inputs, d.train_targets, step, 2)
        assert xs[0].flatten().tolist() == want and ys.tolist() == [100 + i for i in want]
        xs, ys = ref._batch(d.train_inputs, d.train_targets, step, 2)
        assert xs[0].flatten().tolist() == want and ys.tolist() == [100 + i for i in want]


# ---- the living trainers of each round after an injected kill ---------------------------------------

def test_alive_by_round_table():
    assert ref.alive_by_round(4, 3, None) == [[0, 1, 2, 3]] * 3
    assert ref.alive_by_round(4, 3, (1, 1)) == [[0, 1, 2, 3], [0, 2, 3], [0, 2, 3]]
    assert ref.alive_by_round(2, 2, (0, 0)) == [[1], [1]]
    assert ref.alive_by_round(3, 2, (2, 5)) == [[0, 1, 2]] * 2        # a kill past the last round


# ---- the exchange's message: every tensor's bytes, each in its own dtype ------------------------------

def test_the_exchange_message_is_every_tensor_in_its_own_dtype():
    ts = [torch.randn(3, 2, dtype=torch.float64), torch.randn(5, dtype=torch.float32),
          torch.tensor(7, dtype=torch.int64), torch.tensor([True, False]), torch.randn(0)]
    msg = rt.pack(ts)
    assert msg.dtype == torch.uint8 and msg.numel() == 6 * 8 + 5 * 4 + 8 + 2 * 1
    dst = [torch.zeros_like(t) for t in ts]
    rt.unpack_into(msg, dst)
    for a, b in zip(ts, dst):
        assert a.dtype == b.dtype and torch.equal(a, b)      # bit-exact, counters included


def test_the_buffers_priced_are_the_models(tmp_path, profile):
    """The exchange's price counts every buffer of the model (a meta build) and, without the
    model, the same buffers from the traced graph: running mean and variance per channel and
    the int64 counters."""
    from autopar.tournament.pricing import graph_buffers, model_buffers, state_bytes_per_rank
    from autopar.modelfile import load_model_file
    from test_tournament_bn import BUFFER_FLOAT_NUMEL, BUFFER_INT_NUMEL, PARAM_NUMEL, _bn_plan
    res = _bn_plan(tmp_path, profile, "tables", trainers=4)
    mf = load_model_file(tmp_path / "bn_cnn.py")
    bufs = model_buffers(mf, res.plan)
    assert bufs == graph_buffers(res.plan)
    assert sum(n for n, dt in bufs.values() if dt == "float32") == BUFFER_FLOAT_NUMEL
    assert sum(n for n, dt in bufs.values() if dt == "int64") == BUFFER_INT_NUMEL
    assert state_bytes_per_rank(res.plan, dtype="float64", buffers=bufs) == 8 * (PARAM_NUMEL + BUFFER_FLOAT_NUMEL + BUFFER_INT_NUMEL)
    assert state_bytes_per_rank(res.plan, "weights+optimizer", dtype="float32", buffers=bufs) == (
        4 * 2 * PARAM_NUMEL + 4 * BUFFER_FLOAT_NUMEL + 8 * BUFFER_INT_NUMEL)
