"""Timed and instrumented training steps of ``autopar execute``.

A timed step is fenced by a barrier (and a device synchronisation) and taken as the slowest
rank's wall time (a MAX all-reduce). An instrumented step records layer-boundary timestamps
(``runtime.model.LayerTimer``) and the phases of the step (forward, backward, the wait for the
gradient sync, the optimizer); the per-layer figures are the median over the instrumented steps
of the slowest rank in each step.
"""

from __future__ import annotations

import time
from typing import Any, Callable
from ..runtime.model import LayerTimer


def step_once(model, optim, inputs, loss_of: Callable, finish: Callable[[], None]) -> None:
    optim.zero_grad(set_to_none=True)
    o = model(*inputs)
    loss_of(o).backward()
    finish()
    optim.step()


def interleaved_rounds(runs: dict[str, Callable[[int], list[float]]], steps: int, rounds: int
                       ) -> dict[str, list[float]]:
    """``steps`` timed steps of every run (``runs[name](n)`` times n steps), in ``rounds`` rounds
    of a block of each (the first ``steps % rounds`` blocks one step longer), the order rotating
    round by round: the machine's drift over the run falls on every run alike."""
    rounds = max(1, min(rounds, steps))
    sizes = [steps // rounds + (1 if k < steps % rounds else 0) for k in range(rounds)]
    order = list(runs)
    out: dict[str, list[float]] = {name: [] for name in order}
    for k, n in enumerate(sizes):
        for name in order[k % len(order):] + order[:k % len(order)]:
            out[name] += runs[name](n)
    return out


def timed_steps(model, optim, inputs, loss_of, finish, n: int, comm,
                sync: Callable[[], None], barrier: Callable[[], None]) -> list[float]:
    """``n`` training steps; each one's wall time on the slowest rank of ``comm``'s mesh (s)."""
    import torch
    import torch.distributed as dist
    ts = []
    for _ in range(n):
        barrier()
        sync()
        t0 = time.perf_counter()
        step_once(model, optim, inputs, loss_of, finish)
        sync()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=comm.device)
        comm.all_reduce_(dt, dist.ReduceOp.MAX)
        ts.append(float(dt))
    return ts


def timed_block(model, optim, inputs, loss_of, finish, n: int, comm,
                sync: Callable[[], None], barrier: Callable[[], None]) -> float:
    """The mean wall time of ``n`` consecutive training steps (s), fenced once: a barrier
    before the first and, after the last, the slowest rank's elapsed time (a MAX all-reduce;
    the same value on every rank). Unlike ``timed_steps`` no barrier or all-reduce sits
    between the steps, so a block of short steps is timed as a training loop runs them (a
    fence per step of a 10-20 ms step at world 4 costs a few ms, and its jitter)."""
    import torch
    import torch.distributed as dist
    barrier()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step_once(model, optim, inputs, loss_of, finish)
    sync()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=comm.device)
    comm.all_reduce_(dt, dist.ReduceOp.MAX)
    return float(dt) / max(1, n)


def instrumented_steps(dm, optim, inputs, loss_of, n: int, comm,
                       sync: Callable[[], None], barrier: Callable[[], None]
                       ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """``max(1, n)`` instrumented steps of the planned model ``dm``: per-layer forward and
    backward seconds ``[{layer, fwd_s, bwd_s}]`` and the step's phases, each the median over
    the steps of the slowest rank."""
    import torch
    import torch.distributed as dist


    n_layers = len(dm.graph.layers)
    samples = []
    for _ in range(max(1, n)):
        dm.timer = LayerTimer(sync)
        barrier()
        optim.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        o = dm(*inputs)
        t_fwd_end = time.perf_counter()
        loss_of(o).backward()
        t_bwd_end = time.perf_counter()
        dm.finish_grads()
        t_sync_end = time.perf_counter()
        optim.step()
        t_end = time.perf_counter()
        per = dm.timer.per_layer_s(t_fwd_end, t_bwd_end)
        dm.timer = None
        arr = torch.zeros(2 * n_layers + 4, dtype=torch.float64)
        for li, d in per.items():
            arr[2 * li] = d["fwd_s"]
            arr[2 * li + 1] = d["bwd_s"]
        arr[-4] = t_fwd_end - t0
        arr[-3] = t_bwd_end - t_fwd_end
        arr[-2] = t_sync_end - t_bwd_end
        arr[-1] = t_end - t_sync_end
        if comm.world > 1:
            arr = comm.all_reduce_(arr.to(comm.device), dist.ReduceOp.MAX).cpu()
        samples.append(arr)
    arr = torch.stack(samples).median(dim=0).values
    per_layer = [{"layer": li, "fwd_s": float(arr[2 * li]), "bwd_s": float(arr[2 * li + 1])}
                 for li in range(n_layers)]
    phases = {"fwd_s": float(arr[-4]), "bwd_s": float(arr[-3]), "grad_sync_wait_s": float(arr[-2]),
              "optimizer_s": float(arr[-1])}
    return per_layer, phases
