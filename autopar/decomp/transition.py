"""Transitions between the layouts of neighbouring layers, and their price.

The runtime moves a tensor from the producer's ``out_placement`` to the consumer's ``in_placement``
with ``autopar.runtime.redistribute.redistribute``, which runs the steps
``autopar.decomp.redistribute.plan_redistribution`` plans between the layouts' ``DistSpec``s
(``Sharding.to_spec``); ``autopar.cost.redistribute.redistribution_s`` prices them. Layouts
are compared, planned and priced by their owned blocks (``Sharding.owned``): a consumer that
reads a halo (``HaloShard``, a spatially split convolution's input) takes the producer's
``Shard`` on the same axis as it is, and exchanges the halo itself inside the layer (priced
in the layer's fwd_comm_s), so the transition adds nothing for it. For two partial-free
layouts the plan is one exchange, so the price is, as before::

    0                                              if the layouts are equal, or every rank
                                                   already holds what it needs (a slice)
    T_all_to_all(P, n_recv * P/(P-1))              otherwise, n_recv = bytes the busiest rank
                                                   receives from (or sends to) others

(forward; the backward moves the same bytes back). A layout with a partial-sum axis adds the
steps that resolve it (reduce-scatter or all-reduce), priced the same way.

For world <= EXACT_WORLD the plan is enumerated; beyond, layouts are not planned: rank 0
(holding block 0, the largest) stands for the busiest rank, n_recv = |dst block 0| - |dst block
0 n src block 0|, and a partial sum is resolved by an all-reduce over its partial group first
(``_unplanned_partial_s``). Moving *into* a partial layout happens only between decompositions
that leave one, and is planned exactly.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

from .sharding import Sharding, overlap
from .redistribute import COLLECTIVES, plan_redistribution, transfer_bytes

EXACT_WORLD = 16


def recv_bytes(src: Sharding, dst: Sharding, shape: Sequence[int], world: int, itemsize: int) -> float:
    """Bytes the busiest rank receives (or sends) in the transition; with a partial axis, summed
    over the planned steps."""
    src, dst = src.owned(), dst.owned()
    if src == dst:
        return 0.0
    return _recv_bytes(src, dst, tuple(int(n) for n in shape), int(world), int(itemsize))


@functools.lru_cache(maxsize=65536)
def _recv_bytes(src: Sharding, dst: Sharding, shape: tuple[int, ...], world: int, itemsize: int) -> float:
    """Cached: a cost table asks for the same few (layouts, shape) pairs on many edges, and the
    placement search builds one table per placement."""
    if src.is_partial or dst.is_partial:
        return float(sum(max(st.traffic_bytes(itemsize)) for st in plan_layouts(src, dst, shape, world)))
    if world <= EXACT_WORLD:
        sent, recv = transfer_bytes(src, dst, shape, world, itemsize)
        return float(max(sent, recv))
    d0 = dst.block_bounds(shape, 0, world)
    s0 = src.block_bounds(shape, 0, world)
    ov = overlap(d0, s0)
    have = math.prod(e for _, e in ov) if ov else 0
    return float((math.prod(e for _, e in d0) - have) * itemsize)


def plan_layouts(src: Sharding, dst: Sharding, shape: tuple[int, ...], world: int) -> tuple:
    """The redistribution steps between two layouts' owned blocks on ranks 0..world-1 (cached;
    none into a ``HaloShard`` over the same blocks: the layer exchanges its halo)."""
    return _plan_layouts(src.owned(), dst.owned(), tuple(shape), world)


@functools.lru_cache(maxsize=16384)
def _plan_layouts(src: Sharding, dst: Sharding, shape: tuple[int, ...], world: int) -> tuple:
    return plan_redistribution(src.to_spec(shape, world), dst.to_spec(shape, world))


def transition_s(src: Sharding, dst: Sharding, shape: Sequence[int], itemsize: int, ctx) -> tuple[float, float]:
    """(forward s, backward s) to move a tensor of ``shape`` from ``src`` to ``dst`` (their
    owned blocks: a halo is the consuming layer's)."""
    src, dst = src.owned(), dst.owned()
    if src == dst:
        return 0.0, 0.0
    shape = tuple(int(n) for n in shape)
    if ctx.world > EXACT_WORLD:
        if not src.is_partial and not dst.is_partial:
            return _unplanned_s(src, dst, shape, itemsize, ctx)
        if not dst.is_partial:
            return _unplanned_partial_s(src, dst, shape, itemsize, ctx)
    from ..cost.redistribute import step_s
    steps = _moving_steps(src, dst, shape, ctx.world, int(itemsize))
    if not steps:
        return 0.0, 0.0
    levels = tuple(ctx.level(gs[0]) if len(gs) == 1 else ctx.worst_level(gs) for _, _, gs in steps)
    memo = getattr(ctx, "cost_memo", None)   # the placement search's: one price per link level
    key = ("transition", src, dst, shape, itemsize, levels)
    if memo is not None and key in memo:
        return memo[key]
    fwd = bwd = 0.0
    for (st, nbytes, _), level in zip(steps, levels):
        f, b = step_s(st, ctx, itemsize, level, nbytes)
        fwd += f
        bwd += b
    if memo is not None:
        memo[key] = (fwd, bwd)
    return fwd, bwd


@functools.lru_cache(maxsize=65536)
def _moving_steps(src: Sharding, dst: Sharding, shape: tuple[int, ...], world: int,
                  itemsize: int) -> tuple:
    """(step, payload bytes, global groups) of the planned collectives that move data (cached:
    pricing asks for the same pairs on many edges and under many placements). A group of the
    whole world is ``range(world)``, as ``ctx.level`` answers that fastest."""
    from ..cost.redistribute import global_groups
    out = []
    for st in plan_layouts(src, dst, shape, world):
        if isinstance(st, COLLECTIVES) and max(st.traffic_bytes(itemsize)) > 0:
            gs = global_groups(st)
            if gs == (tuple(range(world)),):
                gs = (range(world),)
            out.append((st, st.payload_bytes(itemsize), gs))
    return tuple(out)


def _unplanned_s(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int, ctx) -> tuple[float, float]:
    """Large worlds, partial-free layouts: one all-to-all of the block-0 estimate."""
    n = recv_bytes(src, dst, shape, ctx.world, itemsize)
    if n <= 0:
        return 0.0, 0.0
    level = ctx.level(range(ctx.world))
    memo = getattr(ctx, "cost_memo", None)
    key = ("transition", src, dst, shape, itemsize, (level,))
    if memo is not None:
        if key not in memo:
            memo[key] = _all_to_all_s(n, level, ctx)
        return memo[key]
    return _all_to_all_s(n, level, ctx)


def _unplanned_partial_s(src: Sharding, dst: Sharding, shape: tuple[int, ...], itemsize: int,
                         ctx) -> tuple[float, float]:
    """Large worlds, a partial sum resolved (planning every rank's steps is O(P^2)): the
    all-reduce of rank 0's block over its partial group (an upper bound of the reduce-scatter
    the planner may find), then the partial-free estimate from the summed layout to ``dst``::

        T = T_allreduce(p, |src block 0| bytes) (its backward the same)
          + _unplanned_s(src without partial, dst)
    """
    from ..cost.primitives import blocking_s
    summed = src.without_partial()
    n = math.prod(src.max_local_shape(shape)) * itemsize
    group = src.partial_group(0, ctx.world)
    t = blocking_s(ctx, "allreduce", len(group), float(n), ctx.level(group))
    f, b = _unplanned_s(summed, dst, shape, itemsize, ctx) if summed != dst else (0.0, 0.0)
    return t + f, t + b


def _all_to_all_s(n: float, level: str, ctx) -> tuple[float, float]:
    # the profile's all_to_all takes the whole buffer a rank sends, its own block included
    from ..cost.primitives import blocking_s
    t = blocking_s(ctx, "all_to_all", ctx.world, n * ctx.world / (ctx.world - 1), level)
    return t, t
