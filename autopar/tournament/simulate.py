"""The single-process reference of a tournament run: the T replicas trained in turn in one
process, each replica's full model where the run holds shards, every round's tournament played
by the rules the run states (``autopar.tournament.runtime``'s docstring), and ``autopar
execute`` compares every surviving trainer's final parameters and buffers and every round's
living set and winners with it (float64: to rounding).

The reference is written independently of the runtime it checks: it imports none of the run
time's pairing, data split, batch or decision code and writes its own, plainly (the rules
below); ``tests/test_tournament_tables.py`` holds the runtime's functions against hand-written
tables. The rules:

* data: the model file's ``make_dataset(n, data_seed)``, else ``example_inputs(n)`` /
  ``example_targets(n)`` after ``torch.manual_seed(data_seed)``, n = T x (train + tournament
  samples); trainer t's shard is the model file's ``shard(dataset, t, T)``, else the t-th of T
  contiguous blocks; of its shard a trainer trains on the first ``train_samples_per_trainer``
  samples and holds out the next ``tournament_samples``; step s trains on batch s mod
  (train samples // B).
* pairing in round k: the living, sorted, shuffled by ``random.Random("ltfb:<seed>:<k>")``,
  paired in order, the odd one out alone.
* decision: the partner's model is kept only if its metric is lower; a non-finite metric
  loses to a finite one; two non-finite ones keep the own.
* batch norm: the plan's statistics (``decomp.bn``): global, the model as it is; local, every
  training batch norm over groups of G consecutive samples with running statistics updated by
  the mean of the groups' (``execute.validate.ghost_batch_norm``, the non-tournament
  validation's reference). The evaluation runs the model in training mode and leaves every
  buffer as it was.
* the exchange moves every parameter and every buffer (and, with "weights+optimizer", every
  momentum buffer).
* a trainer killed at round k (``TournamentRunOptions.kill``: it stops before training round
  k) plays rounds 0..k-1 and is absent from round k on: the survivors are compared.
"""

from __future__ import annotations

import math
import random
from typing import Any
from ..execute.validate import ghost_batch_norm
from ..runtime.entry import build_user_model


# ---- the rules, written for the reference -------------------------------------------------------

def reference_pairs(alive, seed: int, round_: int) -> dict[int, int]:
    """Partner of every living trainer in round ``round_`` (module docstring)."""
    order = sorted(int(t) for t in alive)
    random.Random(f"ltfb:{int(seed)}:{int(round_)}").shuffle(order)
    partner = {t: t for t in order}
    for a, b in zip(order[0::2], order[1::2]):
        partner[a], partner[b] = b, a
    return partner


def reference_keeps_partner(own: float, partner: float | None) -> bool:
    """Whether a trainer takes its partner's model (module docstring)."""
    if partner is None or not math.isfinite(partner):
        return False
    return (not math.isfinite(own)) or partner < own


def alive_by_round(trainers: int, rounds: int, kill: tuple[int, int] | None) -> list[list[int]]:
    """The living trainers of every round when ``kill`` = (trainer, round) stops one."""
    out = []
    for k in range(rounds):
        out.append([t for t in range(trainers) if kill is None or not (t == kill[0] and k >= kill[1])])
    return out


def _floats(xs, dtype):
    return [x.to(dtype) if x.is_floating_point() else x for x in xs]


def _target(y, dtype):
    return y.to(dtype) if (y is not None and y.is_floating_point()) else y


def _dataset(mf, level):
    import torch
    n = level.trainers * (level.train_samples_per_trainer + level.tournament_samples)
    if hasattr(mf.module, "make_dataset"):
        xs, ys = mf.module.make_dataset(n, level.data_seed)
    else:
        torch.manual_seed(level.data_seed)
        xs, ys = mf.example_inputs(n), mf.example_targets(n)
    return (list(xs) if isinstance(xs, (tuple, list)) else [xs]), ys


def _trainer_split(mf, level, dataset, t: int):
    """(train inputs, train targets, tournament inputs, tournament targets) of trainer t."""
    xs, ys = dataset
    T = level.trainers
    if hasattr(mf.module, "shard"):
        sx, sy = mf.module.shard((xs, ys), t, T)
        sx = list(sx) if isinstance(sx, (tuple, list)) else [sx]
    else:
        size = len(xs[0]) // T
        lo, hi = t * size, (t + 1) * size
        sx, sy = [x[lo:hi] for x in xs], (None if ys is None else ys[lo:hi])
    a, b = level.train_samples_per_trainer, level.tournament_samples
    cut = (lambda v, i, j: None if v is None else v[i:j])
    return [x[:a] for x in sx], cut(sy, 0, a), [x[a:a + b] for x in sx], cut(sy, a, a + b)


def _batch(xs, ys, step: int, B: int):
    i = step % (len(xs[0]) // B)
    return [x[i * B:(i + 1) * B] for x in xs], (None if ys is None else ys[i * B:(i + 1) * B])


def _state(model, opt, exchange: str) -> list:
    """Every tensor an exchange moves (module docstring)."""
    import torch
    ts = [p.data for p in model.parameters()] + [b for _, b in sorted(model.named_buffers())]
    if exchange == "weights+optimizer":
        for p in model.parameters():
            st = opt.state.setdefault(p, {})
            if st.get("momentum_buffer") is None:
                st["momentum_buffer"] = torch.zeros_like(p.data)
            ts.append(st["momentum_buffer"])
    return ts


def _metric(model, mf, tour_x, tour_y, B, metric, loss_fn, dtype, bn_group) -> float:
    import torch

    saved = [b.detach().clone() for _, b in model.named_buffers()]
    losses, outs = [], []
    with torch.no_grad(), ghost_batch_norm(bn_group):
        for i in range(len(tour_x[0]) // B):
            xs, ys = _batch(tour_x, tour_y, i, B)
            xs, ys = _floats(xs, dtype), _target(ys, dtype)
            o = model(*xs)
            if metric == "loss":
                losses.append(float(loss_fn(o, ys) if ys is not None else loss_fn(o)))
            else:
                outs.append(o)
    for (_, b), s in zip(model.named_buffers(), saved):
        b.copy_(s)
    try:
        if metric == "loss":
            return float(torch.tensor(losses, dtype=torch.float64).mean())
        return float(mf.module.tournament_metric(torch.cat(outs), _floats(tour_x, dtype), _target(tour_y, dtype)))
    except Exception:        # the user's metric raised: the model loses (as in the run)
        return math.inf


def simulate(plan, plan_path, opts) -> dict[str, Any]:
    """Train ``plan.trainers.trainers`` replicas for ``opts.rounds`` rounds (``opts``: a
    ``TournamentRunOptions``; its ``kill`` removes a trainer from the round it names on).
    Returns, per trainer, the final parameters and buffers (float64), the living set of each
    round, and the records of every round (trainer, partner, metrics, winner)."""
    import torch


    level = plan.trainers
    T, B, I = level.trainers, plan.model.batch_size, level.interval_steps
    dtype = getattr(torch, opts.dtype)
    stats = plan.bn_stats()
    bn_group = stats.group if stats.local else None
    models, optims = [], []
    mf = None
    for t in range(T):
        mf, m = build_user_model(plan, plan_path, opts.seed + t)
        m.to(dtype=dtype).train()
        models.append(m)
        optims.append(torch.optim.SGD(m.parameters(), lr=opts.lr, momentum=opts.momentum))
    dataset = _dataset(mf, level)
    splits = [_trainer_split(mf, level, dataset, t) for t in range(T)]
    loss_fn = mf.loss_fn()
    kill = tuple(opts.kill) if opts.kill is not None else None
    alive_rounds = alive_by_round(T, opts.rounds, kill)
    records = []
    for k, alive in enumerate(alive_rounds):
        for t in alive:
            tx, ty = splits[t][0], splits[t][1]
            for s in range(I):
                xs, ys = _batch(tx, ty, k * I + s, B)
                xs, ys = _floats(xs, dtype), _target(ys, dtype)
                optims[t].zero_grad(set_to_none=True)
                with ghost_batch_norm(bn_group):
                    o = models[t](*xs)
                    loss = loss_fn(o, ys) if ys is not None else loss_fn(o)
                loss.backward()
                optims[t].step()
        partner = reference_pairs(alive, level.pairing_seed, k)
        sent = {t: [x.detach().clone() for x in _state(models[t], optims[t], level.exchange)] for t in alive}
        winner = {}
        for t in alive:
            p = partner[t]
            mine = _state(models[t], optims[t], level.exchange)
            args = (mf, splits[t][2], splits[t][3], B, level.metric, loss_fn, dtype, bn_group)
            m_own = _metric(models[t], *args)
            m_p = None
            if p != t:
                for dst, src in zip(mine, sent[p]):
                    dst.copy_(src)
                m_p = _metric(models[t], *args)
                for dst, src in zip(mine, sent[t]):
                    dst.copy_(src)
            winner[t] = p if reference_keeps_partner(m_own, m_p) else t
            records.append({"round": k, "trainer": t, "partner": p, "metric_own": m_own,
                            "metric_partner": m_p, "winner": winner[t]})
        for t in alive:
            if winner[t] != t:
                for dst, src in zip(_state(models[t], optims[t], level.exchange), sent[winner[t]]):
                    dst.copy_(src)
    survivors = alive_rounds[-1] if alive_rounds else list(range(T))
    params = [{q: v.detach().to(torch.float64).clone() for q, v in m.named_parameters()} for m in models]
    buffers = [{q: v.detach().to(torch.float64).clone() for q, v in m.named_buffers()} for m in models]
    return {"params": params, "buffers": buffers, "records": records, "alive": alive_rounds,
            "survivors": survivors}
