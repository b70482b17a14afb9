"""Collective benchmarks, run inside every rank of a process group (see ``run.calibrate``).

Each group size p is measured in its own fresh world of p processes (the "whole world" form:
a gloo error poisons a group, and idle extra ranks would only sit in a barrier). Per
collective and message size: ``warmup`` untimed ops, then ``repeats`` timed iterations of
``barrier -> perf_counter -> op (-> cuda synchronize) -> perf_counter``, interleaved with
the other sizes and kinds (see ``measure_rank``). Every rank returns its
own times; the parent takes the max across ranks per iteration (a collective is done when its
last rank is) and the median over iterations.

Byte conventions (the same as ``Profile.collective_time_s``): allreduce/broadcast: buffer per
rank; allgather: whole gathered output (input n/p per rank, output concatenated on dim 0, as
gloo needs); reduce_scatter: whole input per rank (scattered on dim 0); all_to_all: total one
rank sends, its own block included (``all_to_all_single`` with even splits); p2p: one message,
measured as half a ping-pong between ranks 0 and 1 (no barrier skew in it).

``measure_rank(..., group=g)`` measures inside a subgroup of a larger world instead (the
multi-node calibration, :mod:`autopar.calibrate.cluster`): ``rank`` and ``world`` are then the
rank within ``g`` and its size, every op and barrier runs on ``g``, and broadcast roots and p2p
peers are translated to global ranks. Only members of ``g`` may call it.

float32 elements: a requested size is rounded to whole elements (and to a multiple of p where
the buffer is split p ways); the size actually moved is what is recorded.
"""

from __future__ import annotations

import time

MEASURED_KINDS = ("allreduce", "allgather", "reduce_scatter", "all_to_all", "broadcast", "p2p")


def _elements(kind: str, nbytes: int, p: int) -> tuple[int, int]:
    """(elements per rank buffer to allocate, actual bytes by the convention) for ``kind``."""
    e = max(1, round(nbytes / 4))
    if kind in ("allgather", "reduce_scatter", "all_to_all"):
        per = max(1, round(e / p))
        return per, 4 * per * p
    return e, 4 * e


def _make_op(kind: str, nbytes: int, rank: int, p: int, dev, gather, scatter, group=None):
    """(callable running one ``kind`` op on fresh buffers, actual bytes, time scale).

    ``rank`` and ``p`` are within ``group`` (None: the default group)."""
    import torch
    import torch.distributed as dist

    def glob(r: int) -> int:  # a rank of ``group`` as the global rank send/recv/broadcast take
        return r if group is None else dist.get_global_rank(group, r)

    g = {} if group is None else {"group": group}
    e, actual = _elements(kind, nbytes, p)
    if kind == "allreduce":
        buf = torch.ones(e, device=dev)
        return (lambda: dist.all_reduce(buf, **g)), actual, 1.0
    if kind == "broadcast":
        buf = torch.ones(e, device=dev)
        root = glob(0)
        return (lambda: dist.broadcast(buf, src=root, **g)), actual, 1.0
    if kind == "allgather":
        inp, outp = torch.ones(e, device=dev), torch.empty(e * p, device=dev)
        return (lambda: gather(outp, inp, **g)), actual, 1.0
    if kind == "reduce_scatter":
        inp, outp = torch.ones(e * p, device=dev), torch.empty(e, device=dev)
        return (lambda: scatter(outp, inp, **g)), actual, 1.0
    if kind == "all_to_all":
        inp, outp = torch.ones(e * p, device=dev), torch.empty(e * p, device=dev)
        return (lambda: dist.all_to_all_single(outp, inp, [e] * p, [e] * p, **g)), actual, 1.0
    if kind == "p2p":
        buf = torch.ones(e, device=dev)
        peer = glob(1 - rank) if rank in (0, 1) else None

        def ping_pong():
            if rank == 0:
                dist.send(buf, peer, **g)
                dist.recv(buf, peer, **g)
            else:
                dist.recv(buf, peer, **g)
                dist.send(buf, peer, **g)
        return ping_pong, actual, 0.5  # one round trip = two messages
    raise ValueError(f"unknown collective {kind!r}")


def measure_rank(rank: int, world: int, kinds: tuple, sizes: tuple, repeats: int, warmup: int,
                 device: str = "cpu", seed: int = 0, group=None) -> dict:
    """Run in every rank: ``{kind: [{"nbytes": n, "times_s": [...]}]}`` for this rank.

    Interleaved rounds: each round times every (kind, size) once, in an order shuffled per
    round (the same on every rank, from ``seed``), so slow phases of the machine (other work,
    scheduler regimes of an oversubscribed node) spread over all sizes instead of bending
    the curve of whichever sizes ran at that moment. p2p is measured only when ``world == 2``.

    ``group``: measure inside this subgroup (``rank``/``world`` are then its rank and size;
    see the module docstring); None (default) is the default group.
    """
    import random

    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # torch >= 2.10 names them *_single; older ones only have *_into_tensor / *_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    cases, seen = [], set()
    for kind in kinds:
        for n in sizes:
            # sizes that round to the same buffer (a few bytes split p ways) are measured once
            actual = _elements(kind, n, world)[1]
            if (kind != "p2p" or world == 2) and (kind, actual) not in seen:
                seen.add((kind, actual))
                cases.append((kind, n))
    ops = {case: _make_op(case[0], case[1], rank, world, dev, gather, scatter, group)
           for case in cases}
    barrier = (lambda: dist.barrier()) if group is None else (lambda: dist.barrier(group=group))
    times: dict[tuple, list] = {case: [] for case in cases}
    for case in cases:
        for _ in range(warmup):
            ops[case][0]()
    sync()
    rng = random.Random(seed)
    for _ in range(repeats):
        order = list(cases)
        rng.shuffle(order)
        for case in order:
            op, _, scale = ops[case]
            barrier()
            sync()
            t0 = time.perf_counter()
            op()
            sync()
            times[case].append((time.perf_counter() - t0) * scale)
    out: dict[str, list] = {}
    for kind, n in cases:
        out.setdefault(kind, []).append({"nbytes": ops[(kind, n)][1], "times_s": times[(kind, n)]})
    return out


def combine_ranks(per_rank: list[dict]) -> dict:
    """Per-iteration max across ranks: ``{kind: [{"nbytes", "median_s", "mean_s", "times_s"}]}``.

    The fits use ``median_s``; ``mean_s`` is kept because on an oversubscribed node the times
    are bimodal (a rank either runs at once or waits a whole time slice) and a step made of
    many collectives pays the mean.
    """
    import statistics

    combined: dict[str, list] = {}
    for kind in per_rank[0]:
        rows = []
        for i, row in enumerate(per_rank[0][kind]):
            iters = zip(*(r[kind][i]["times_s"] for r in per_rank))
            times = [float(f"{max(t):.6g}") for t in iters]
            rows.append({"nbytes": row["nbytes"], "median_s": float(f"{statistics.median(times):.6g}"),
                         "mean_s": float(f"{statistics.fmean(times):.6g}"), "times_s": times})
        combined[kind] = rows
    return combined
