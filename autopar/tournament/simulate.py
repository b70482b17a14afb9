"""The single-process reference of a tournament run: the T replicas trained in turn, one
process, the same data, seeds, pairings and decisions (``autopar.tournament.runtime``), each
replica's full model where the run holds shards. ``autopar execute`` compares every surviving
trainer's final parameters and every round's winners with it (float64: to rounding)."""

from __future__ import annotations

from typing import Any

from .runtime import (TournamentRunOptions, batch_of, cast_float, cast_target, decide, full_dataset,
                      pairing, safe_metric, trainer_data)


def _state(model, opt, exchange: str) -> list:
    import torch
    ts = [p.data for p in model.parameters()]
    ts += [b for _, b in sorted(model.named_buffers()) if b.is_floating_point()]
    if exchange == "weights+optimizer":
        for p in model.parameters():
            st = opt.state.setdefault(p, {})
            if st.get("momentum_buffer") is None:
                st["momentum_buffer"] = torch.zeros_like(p.data)
            ts.append(st["momentum_buffer"])
    return ts


def _metric(model, mf, data, B, metric, loss_fn, dtype) -> tuple[float, str]:
    import torch
    saved = {q: b.detach().clone() for q, b in model.named_buffers()}
    nb = len(data.tour_inputs[0]) // B
    losses, outs = [], []
    with torch.no_grad():
        for i in range(nb):
            xs, ys = batch_of(data.tour_inputs, data.tour_targets, i, B)
            xs, ys = cast_float(xs, dtype), cast_target(ys, dtype)
            o = model(*xs)
            if metric == "loss":
                losses.append((loss_fn(o, ys) if ys is not None else loss_fn(o)).reshape(1).to(torch.float64))
            else:
                outs.append(o)
    for q, b in model.named_buffers():
        b.copy_(saved[q])
    if metric == "loss":
        s = torch.cat(losses)
        return safe_metric(lambda: s.mean())
    return safe_metric(mf.module.tournament_metric, torch.cat(outs), cast_float(data.tour_inputs, dtype),
                       cast_target(data.tour_targets, dtype))


def simulate(plan, plan_path, opts: TournamentRunOptions) -> dict[str, Any]:
    """Train ``plan.trainers.trainers`` replicas for ``opts.rounds`` rounds; return the final
    parameters of each and the records of every round (as the run writes them)."""
    import torch

    from ..runtime.entry import build_user_model

    level = plan.trainers
    T, B, I = level.trainers, plan.model.batch_size, level.interval_steps
    dtype = getattr(torch, opts.dtype)
    models, opts_, datas = [], [], []
    mf = None
    for t in range(T):
        mf, m = build_user_model(plan, plan_path, opts.seed + t)
        m.to(dtype=dtype).train()
        models.append(m)
        opts_.append(torch.optim.SGD(m.parameters(), lr=opts.lr, momentum=opts.momentum))
    dataset = full_dataset(mf, level)
    datas = [trainer_data(mf, level, t, dataset) for t in range(T)]
    loss_fn = mf.loss_fn()
    records = []
    for k in range(opts.rounds):
        for t in range(T):
            for s in range(I):
                xs, ys = batch_of(datas[t].train_inputs, datas[t].train_targets, k * I + s, B)
                xs, ys = cast_float(xs, dtype), cast_target(ys, dtype)
                opts_[t].zero_grad(set_to_none=True)
                o = models[t](*xs)
                (loss_fn(o, ys) if ys is not None else loss_fn(o)).backward()
                opts_[t].step()
        alive = list(range(T))
        pairs = pairing(alive, level.pairing_seed, k)
        snap = [[x.detach().clone() for x in _state(models[t], opts_[t], level.exchange)] for t in range(T)]
        new = []
        for t in range(T):
            p = pairs[t]
            m_own, _ = _metric(models[t], mf, datas[t], B, level.metric, loss_fn, dtype)
            m_p = None
            if p != t:
                own = _state(models[t], opts_[t], level.exchange)
                for dst, src in zip(own, snap[p]):
                    dst.copy_(src)
                m_p, _ = _metric(models[t], mf, datas[t], B, level.metric, loss_fn, dtype)
                for dst, src in zip(own, snap[t]):
                    dst.copy_(src)
            keep, _ = decide(m_own, m_p)
            new.append(p if keep else t)
            records.append({"round": k, "trainer": t, "partner": p, "metric_own": m_own,
                            "metric_partner": m_p, "winner": p if keep else t})
        for t in range(T):
            if new[t] != t:
                for dst, src in zip(_state(models[t], opts_[t], level.exchange), snap[new[t]]):
                    dst.copy_(src)
    params = [{q: v.detach().to(torch.float64).clone() for q, v in m.named_parameters()} for m in models]
    return {"params": params, "records": records}
