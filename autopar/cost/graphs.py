"""Graph parallelism as a plan-level alternative, priced: ``graphs(world)`` on every layer of a
PyG batch (``autopar.decomp.graph.graphs``: the decomposition, its legality and cost formula)
as a one-choice cost table evaluated like the ILP's plans, against which the planner compares
the ILP's best op-by-op plan (``autopar.planner.strategies.graphs``). Here because it builds a ``CostTable``:
the decomposition itself stays below the cost table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..decomp.base import CostContext
from ..decomp.graph.graphs import Graphs, GraphRoles, graph_roles, graphs_cost
from ..decomp.ir import LayerGraphData
from .table import (CostTable, LayerOptions, evaluate, layer_optimizer_step_s, layer_param_tensors,
                    price_grad_reducer, price_optimizer_fixed, price_stragglers)


@dataclass(frozen=True)
class GraphAlternative:
    """The graph-parallel plan's table and prediction, or why it is illegal."""
    parts: int
    table: Any = None
    prediction: Any = None
    illegal: str | None = None
    roles: GraphRoles | None = None
    shares: dict[str, float] | None = None     # the largest rank's node / edge fractions priced


def graphs_alternative(graph: LayerGraphData, ctx: CostContext, table,
                       memory_limit_bytes: float | None, shares=None) -> GraphAlternative:
    """Price ``graphs(world)`` for every layer (module docstring) as a one-choice cost table on
    ``table``'s layer order and gradient buckets, evaluated like the ILP's plans
    (``cost.table.evaluate``); ``illegal`` says why not when it cannot run. ``shares``: None
    (the mean share), or a function of the roles giving the largest rank's node / edge
    fractions of an actual batch (``graphs_cost``)."""
    p = ctx.world
    roles, why = graph_roles(graph)
    if roles is None:
        return GraphAlternative(p, illegal=why)
    b = roles.graphs
    if p < 2:
        return GraphAlternative(p, illegal="world size 1", roles=roles)
    if b < p:
        return GraphAlternative(p, illegal=f"{b} graphs < {p} ranks (some rank would hold no graph)", roles=roles)
    if b % p:
        return GraphAlternative(p, illegal=f"{b} graphs do not split evenly over {p} ranks", roles=roles)
    dec = Graphs(p, b)
    fractions = None
    if shares is not None:
        try:
            fractions = shares(roles)
        except Exception:  # noqa: BLE001 - no batch to measure: the mean share
            fractions = None
    opts = []
    for lay in graph.layers:
        why = dec.check(lay, ctx)
        if why:
            return GraphAlternative(p, illegal=f"layer {lay.index} ({lay.module or lay.name}): {why}",
                                    roles=roles)
        c = dec.cost(lay, ctx) if fractions is None else graphs_cost(dec, lay, ctx, fractions)
        c = dataclasses.replace(c, optim_step_s=layer_optimizer_step_s(c, ctx, layer_param_tensors(lay)))
        opts.append(LayerOptions(lay, [dec], [c]))
    opts = price_grad_reducer(ctx, opts, list(table.topo))   # the native runtime's reducer, as every plan pays it
    opts = price_optimizer_fixed(ctx, opts, list(table.topo))
    opts, charge = price_stragglers(graph, ctx, opts, list(table.topo))
    gt = CostTable(graph, ctx, opts, None, list(table.topo), table.buckets, straggle=charge)
    pred = evaluate(gt, [0] * len(opts))
    if memory_limit_bytes is not None and pred.memory_per_rank_bytes > memory_limit_bytes:
        return GraphAlternative(p, gt, pred, illegal=f"{pred.memory_per_rank_bytes / 2**20:.2f} MiB per rank "
                                f"over the memory limit {memory_limit_bytes / 2**20:.2f} MiB", roles=roles,
                                shares=fractions)
    return GraphAlternative(p, gt, pred, roles=roles, shares=fractions)
