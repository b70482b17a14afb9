"""Price of a planned redistribution (``autopar.decomp.redistribute``), forward and backward.

Legend: a *dim* is a tensor dimension; an *axis* is a mesh axis. Step groups are mesh-local;
they are mapped to global ranks (``step.src.mesh.ranks``) before asking the context about links.

Each collective step is a blocking collective (``cost.primitives.blocking_s``)::

    t_fwd = blocking_s(ctx, kind, p, n, level(groups))
    t_bwd = blocking_s(ctx, adjoint(kind), p, n, level(groups))

with p the group size, n the step's ``payload_bytes`` (the profile's convention per kind:
all-reduce the buffer, all-gather the whole gathered output, reduce-scatter the whole input,
all-to-all all one rank sends incl. its own block = max(sent, recv) * p/(p-1)), and the adjoint
all-gather <-> reduce-scatter, all-reduce -> all-reduce, all-to-all -> all-to-all (the reverse
exchange moves the same bytes, so n is unchanged). Slice, Pad, Unpad and ToPartial are local: 0.
The level is ``ctx.level(group)`` for one group, ``ctx.worst_level(groups)`` for several running
side by side.

A ``MeshSend`` (point-to-point sends between two meshes) runs all its messages at once; the
busiest rank's link bounds it. With n its ``payload_bytes`` (the busiest rank's max(sent,
received) bytes) and k its ``messages`` (most peers one rank sends to or receives from)::

    t = blocking_s(ctx, "p2p", 2, n, level) + (k - 1) * blocking_s(ctx, "p2p", 2, 0, level)

one p2p of all the busiest rank's bytes plus a latency per extra message; its adjoint sends the
gradients back along the same pairs, the same bytes: t_bwd = t_fwd. The level is
``ctx.worst_level`` of its (sender, receiver) pairs, global ranks already.
"""

from __future__ import annotations

from typing import Sequence

from ..decomp.redistribute import COLLECTIVES, MeshSend, Step
from .primitives import blocking_s

ADJOINT = {"allreduce": "allreduce", "reduce_scatter": "allgather", "allgather": "reduce_scatter",
           "all_to_all": "all_to_all", "p2p": "p2p"}


def global_groups(step: Step) -> tuple[tuple[int, ...], ...]:
    if isinstance(step, MeshSend):      # its transfers name global ranks already
        return step.pairs
    ranks = step.src.mesh.ranks
    return tuple(tuple(ranks[i] for i in g) for g in step.groups)


def step_level(step: Step, ctx) -> str:
    groups = global_groups(step)
    return ctx.level(groups[0]) if len(groups) == 1 else ctx.worst_level(groups)


def step_s(step: Step, ctx, itemsize: int, level: str | None = None,
           nbytes: float | None = None) -> tuple[float, float]:
    """(forward s, backward s) of one step (``level``, ``nbytes``: already known to the caller)."""
    if not isinstance(step, COLLECTIVES):
        return 0.0, 0.0
    p = step.p
    n = step.payload_bytes(itemsize) if nbytes is None else nbytes
    if p <= 1 or n <= 0:
        return 0.0, 0.0
    level = level or step_level(step, ctx)
    if isinstance(step, MeshSend):      # module docstring
        t = blocking_s(ctx, "p2p", 2, n, level) + (step.messages - 1) * blocking_s(ctx, "p2p", 2, 0.0, level)
        return t, t
    fwd = blocking_s(ctx, step.kind, p, n, level)
    adj = ADJOINT[step.kind]
    return fwd, (fwd if adj == step.kind else blocking_s(ctx, adj, p, n, level))


def redistribution_s(steps: Sequence[Step], ctx, itemsize: int) -> tuple[float, float]:
    """(forward s, backward s) of a whole plan: the sum of its steps (they run one after
    another)."""
    fwd = bwd = 0.0
    for st in steps:
        f, b = step_s(st, ctx, itemsize)
        fwd += f
        bwd += b
    return fwd, bwd
