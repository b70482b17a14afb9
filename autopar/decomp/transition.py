"""Transitions between the layouts of neighbouring layers, and their price.

The runtime moves a tensor from the producer's ``out_layout`` to the consumer's ``in_layout``
with ``autopar.runtime.comm.redistribute``: local copies where a rank already holds the data,
one all-to-all for the rest; its backward is the same exchange reversed. Price (forward; the
backward moves the same bytes back)::

    0                                              if the layouts are equal, or every rank
                                                   already holds what it needs (a slice)
    T_all_to_all(P, n_recv * P/(P-1))              otherwise, n_recv = bytes the busiest rank
                                                   receives from others

For world <= EXACT_WORLD the transfer plan is enumerated; beyond, rank 0 (holding block 0,
the largest) stands for the busiest rank: n_recv = |dst block 0| - |dst block 0 n src block 0|.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

from .layout import Layout, overlap

EXACT_WORLD = 16


def recv_bytes(src: Layout, dst: Layout, shape: Sequence[int], world: int, itemsize: int) -> float:
    if src == dst:
        return 0.0
    return _recv_bytes(src, dst, tuple(int(n) for n in shape), int(world), int(itemsize))


@functools.lru_cache(maxsize=65536)
def _recv_bytes(src: Layout, dst: Layout, shape: tuple[int, ...], world: int, itemsize: int) -> float:
    """Cached: a cost table asks for the same few (layouts, shape) pairs on many edges, and the
    placement search builds one table per placement."""
    if world <= EXACT_WORLD:
        from ..runtime.comm import transfer_bytes
        sent, recv = transfer_bytes(src, dst, shape, world, itemsize)
        return float(max(sent, recv))
    d0 = dst.block_bounds(shape, 0, world)
    s0 = src.block_bounds(shape, 0, world)
    ov = overlap(d0, s0)
    have = math.prod(e for _, e in ov) if ov else 0
    return float((math.prod(e for _, e in d0) - have) * itemsize)


def transition_s(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int, ctx) -> tuple[float, float]:
    """(forward s, backward s) to move a tensor of ``shape`` from ``src`` to ``dst``."""
    n = recv_bytes(src, dst, shape, ctx.world, itemsize)
    if n <= 0:
        return 0.0, 0.0
    level = ctx.level(range(ctx.world))
    memo = getattr(ctx, "cost_memo", None)   # the placement search's: one price per link level
    if memo is not None:
        key = ("transition", src, dst, tuple(shape), itemsize, level)
        if key not in memo:
            memo[key] = _transition_s(n, level, ctx)
        return memo[key]
    return _transition_s(n, level, ctx)


def _transition_s(n: float, level: str, ctx) -> tuple[float, float]:
    # the profile's all_to_all takes the whole buffer a rank sends, its own block included
    from ..cost.primitives import blocking_s
    t = blocking_s(ctx, "all_to_all", ctx.world, n * ctx.world / (ctx.world - 1), level)
    return t, t
