"""Pieces shared by the tensor-parallel decompositions (Megatron-LM, Shoeybi et al. 2019;
sequence parallelism, Korthikanti et al. 2022).

Every decomposition here lives on a 2-D mesh ``(sample s) x (tensor p)``, world ``P = s * p``,
with the tensor axis innermost::

    rank = c_s * p + c_t

so a tensor-parallel group (varying ``c_t``, the heads / sequence / vocabulary blocks of one
sample block) is ``p`` consecutive ranks: it stays within a node under block placement, and the
data-parallel gradient all-reduce (varying ``c_s``) is the one that crosses nodes. In ``Sharding``
terms an activation replicated over the tensor group is ``((0, s),)`` (replicas innermost), a
partial sum over it ``((0, s),), partial=p`` and a sequence split ``((0, s), (1, p))``; all three
put ``c_t = rank % p``, so they compose with each other and with ``filter(s, p)`` /
``row_parallel(s, p)`` (whose filter / channel axis is the same innermost axis).
"""

from __future__ import annotations

import functools
import math

from ..base import CostContext, Decomposition
from ..sharding import Sharding, Shard


def mesh(sample: int, parts: int) -> Sharding:
    """The (s, p) grid as a Sharding used only for rank arithmetic (dims are labels)."""
    return Sharding.of((Shard(0), sample), (Shard(1), parts))


@functools.lru_cache(maxsize=4096)
def partition(sample: int, parts: int, vary: str) -> tuple[tuple[int, ...], ...]:
    """Groups of ranks that differ only along ``vary`` ("t": a tensor group; "s": a sample
    group, the ranks holding the same tensor block of every sample block)."""
    if vary == "t":
        return tuple(tuple(range(cs * parts, (cs + 1) * parts)) for cs in range(sample))
    return tuple(tuple(cs * parts + ct for cs in range(sample)) for ct in range(parts))


def grad_sync(ctx: CostContext, sharded_bytes: float, whole_bytes: float, sample: int, parts: int):
    """(seconds, bytes synced, latency entries) of the gradient all-reduces of a tensor-parallel
    layer: a shard's gradient among its ``s`` sample replicas (the ``p`` groups run side by side:
    priced once, on the worst link of the partition), a whole parameter's over the world.

        T = T_allreduce(s, sharded bytes) [if s > 1] + T_allreduce(P, whole bytes) [if P > 1]
    """
    from ...cost import primitives as prim
    secs = synced = 0.0
    latency: list = []
    if sharded_bytes and sample > 1:
        groups = partition(sample, parts, "s")
        level = ctx.worst_level(groups)
        secs += prim.grad_allreduce_s(ctx, sharded_bytes, sample, level)
        synced += sharded_bytes
        sig = "world" if sample == ctx.world else f"allreduce {sample} {level} {groups[0]}"
        latency.append((sig, *prim.grad_latencies_s(ctx, sample, level)))
    if whole_bytes and ctx.world > 1:
        secs += prim.grad_sync_time_s(ctx, whole_bytes, range(ctx.world))
        synced += whole_bytes
        latency.extend(prim.grad_sync_latency(ctx, range(ctx.world), "world"))
    return secs, synced, tuple(latency)


def two_axis_candidates(cls, ctx: CostContext) -> list:
    """(world / p, p) for every divisor p > 1 of the world with p <= the ranks of one node: the
    tensor axis carries blocking activation collectives in every layer, so (as in Megatron-LM
    practice) it stays within a node; across nodes only the data-parallel axis. This also keeps
    the candidate count per layer small at large world sizes (3 at 1024 ranks of 8 per node
    instead of 10), which the ILP's size grows with."""
    top = ctx.ranks_on_node
    return [cls(ctx.world // p, p) for p in range(2, min(ctx.world, top) + 1) if ctx.world % p == 0]


def mesh_check(dec, layer, ctx: CostContext) -> str | None:
    """The checks every (sample, parts) kind starts with, prefixed with the unit's name: the
    protocol's own (``Decomposition.check``: registered ops, no constants) and the mesh
    covering the world."""
    name = layer.module or layer.name
    why = Decomposition.check(dec, layer, ctx)
    if why:
        return f"{name}: {why}"
    if dec.sample * dec.parts != ctx.world:
        return f"{name}: {dec.sample} x {dec.parts} ranks, world size is {ctx.world}"
    return None


def nbytes(shape, itemsize: int) -> float:
    return float(math.prod(int(n) for n in shape) * itemsize)
