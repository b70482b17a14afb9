"""Graph (sample) parallelism of a PyTorch Geometric batch: whole graphs per rank.

A PyG mini-batch concatenates B graphs: node tensors ``x [N, F]`` and the ``batch [N]``
vector (graph id of each node), edge tensors ``edge_attr [E, Fe]`` and ``edge_index [2, E]``
(global node ids), graph-level targets ``y [B]``. ``graphs(P)`` gives every rank B / P whole
graphs: the nodes of its graphs (a contiguous node range when ``batch`` is sorted), the edges
whose source node is in that range, ``edge_index`` re-based by the range's first node,
``batch`` re-based by the rank's first graph, and B / P rows of every graph-level tensor. Each
rank then runs the user's own module on its sub-batch (``runtime.native``, as a pure
``sample(P)`` plan does), and the gradients are summed over the world with the loss weighted
``n_r / N`` (``runtime.model.DistModel.local_loss``): the same function as one process on the
whole batch, because message passing never crosses a graph boundary and pooling is per graph.

It is a *plan-level* alternative, not a per-layer choice: the ILP never sees it
(``candidates`` is empty). ``cost.graphs.graphs_alternative`` prices it against the ILP's best
op-by-op plan after the solve (``autopar.planner.make_plan``) and the cheaper one is kept; plan.json
records both predictions under ``solver.graph_parallel``. Which inputs are node, edge, index
and batch vectors comes from the tracer's marks (``autopar.trace.graph_items``), not from the
model file; the run-time split is ``autopar.runtime.graphs.split_graph_batch``.

Legal when: the batch is a PyG batch (node and edge items along dim 0, an integer ``batch``
vector among the node inputs), the output is graph-level (dim 0 = B), B >= P and P divides B,
and no batch norm trains (a rank's statistics would be over its graphs' nodes only).

Cost (written once, ``graphs_cost``): ``price_replicated_weights`` with every op on a rank's
local share -- node-indexed values N / P rows, edge-indexed values E / P, graph-level values
B / P (the mean); when the planner has the model file's example batch, node and edge values at
the largest rank's fractions of that batch's nodes and edges instead (the imbalance of whole
graphs of different sizes; ``runtime.graphs.largest_shares``) -- with the per-op runtime
work of the native module (``CostContext.native_runtime``: the user's module runs natively, as
under DDP); weights whole, gradient all-reduce over the world as ``sample(P)``;
memory: whole weights, gradients, optimizer state and B / P graphs' saved activations.
Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ...errors import AutoparError
from ..base import CostContext, Decomposition, LayerCost, register
from ..common import price_replicated_weights
from ..ir import BATCH_NORM, REGISTERED, Layer, LayerGraphData
from ..sharding import Sharding, Shard


@dataclass(frozen=True)
class GraphRoles:
    """What each model input is to a graph split (positions in ``graph.inputs``):
    ``node`` inputs split along dim 0 by node range, ``edge`` inputs (position, item dim) by
    the edges of the range, ``edge_index`` (position) the integer ``[2, E]`` edge index
    re-based by the first node, ``batch`` the graph-id vector, ``graphs`` = B."""
    node: tuple[int, ...]
    edge: tuple[tuple[int, int], ...]
    edge_index: int | None
    batch: int
    graphs: int

    def to_json(self) -> dict[str, Any]:
        return {"node": list(self.node), "edge": [list(e) for e in self.edge],
                "edge_index": self.edge_index, "batch": self.batch, "graphs": self.graphs}


def _input_items(graph: LayerGraphData) -> dict[str, tuple[int, str]]:
    out: dict[str, tuple[int, str]] = {}
    names = {gi.name for gi in graph.inputs}
    for lay in graph.layers:
        for op in lay.ops:
            for v, (d, k) in (op.attrs.get("items") or {}).items():
                if v in names:
                    out[v] = (int(d), str(k))
    return out


def graph_roles(graph: LayerGraphData) -> tuple[GraphRoles | None, str | None]:
    """(roles, None) for a PyG batch whose output is graph-level, else (None, why not)."""
    items = _input_items(graph)
    if not items:
        return None, "no message passing (no edge- or node-indexed input)"
    node, edge, index, batch = [], [], None, None
    for i, gi in enumerate(graph.inputs):
        it = items.get(gi.name)
        integer = not str(gi.dtype).startswith(("float", "bfloat", "complex"))
        if it is None:
            if gi.shape:
                return None, f"input {gi.name} {list(gi.shape)} is neither node- nor edge-indexed"
            continue
        d, kind = it
        if kind == "node":
            if d != 0:
                return None, f"node input {gi.name} has its nodes along dim {d} (a padded batch: sample)"
            if integer and len(gi.shape) == 1:
                if batch is not None:
                    return None, f"two integer node vectors ({graph.inputs[batch].name}, {gi.name})"
                batch = i
            else:
                node.append(i)
        else:
            if integer and len(gi.shape) == 2 and d == 1 and int(gi.shape[0]) == 2:
                index = i
            elif d != 0:
                return None, f"edge input {gi.name} has its edges along dim {d} (a padded batch: sample)"
            edge.append((i, d))
    if batch is None:
        return None, "no batch vector (an integer node input [N] giving each node's graph)"
    out = graph.value_shape(graph.output)
    if not out:
        return None, "the output is a scalar, not one row per graph"
    return GraphRoles(tuple(node), tuple(edge), index, batch, int(out[0])), None


@register
@dataclass(frozen=True)
class Graphs(Decomposition):
    """``graphs(P)``: B / P whole graphs of a PyG batch per rank (module docstring). Every
    layer of a graph-parallel plan carries it; layouts are nominal (even blocks of the item or
    graph dim) for pricing and for the output's loss layout -- the real split follows graph
    boundaries (``runtime.graphs``) and runs only natively."""

    parts: int = 2
    graphs: int = 2          # B, the graphs of the batch (its graph-level dim 0)
    kind = "graphs"
    supported_ops = REGISTERED

    def value_layout(self, layer: Layer, value: str, shape) -> Sharding:
        for op in layer.ops:
            it = (op.attrs.get("items") or {}).get(value)
            if it is not None:
                return Sharding.of((Shard(int(it[0])), self.parts))
        if shape and int(shape[0]) == self.graphs and self.graphs % self.parts == 0:
            return Sharding.of((Shard(0), self.parts))
        return Sharding()

    def in_placement(self, layer: Layer, value: str) -> Sharding:
        try:
            shape = layer.in_shape(value)
        except KeyError:
            shape = ()
        return self.value_layout(layer, value, shape)

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        v = value or layer.output
        return self.value_layout(layer, v, layer.value_shape(v))

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        return []

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        return []          # plan-level only: ``cost.graphs.graphs_alternative``

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        if self.parts != ctx.world:
            return f"graphs({self.parts}) must span the world of {ctx.world} ranks"
        if self.graphs % self.parts:
            return f"{self.graphs} graphs do not split evenly over {self.parts} ranks"
        for op in layer.ops:
            if op.kind == BATCH_NORM and op.attrs.get("training", True):
                return f"{op.name}: batch norm would normalise each rank's graphs alone"
        return None

    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """Module docstring: every op on its mean local share, run natively."""
        return graphs_cost(self, layer, ctx)

    def run(self, comm, layer, op, inputs, params, buffers):
        raise AutoparError(f"graphs({self.parts}) runs the user's module natively, not op by op "
                           f"({op.name})", "run the plan with AUTOPAR_NATIVE unset (the native path)")


def graphs_cost(dec: Graphs, layer: Layer, ctx: CostContext,
                shares: dict[str, float] | None = None) -> LayerCost:
    """``price_replicated_weights`` with every op on a rank's share (module docstring), no
    per-op runtime overhead. ``shares`` ({"node": f, "edge": f}): the largest rank's fraction of
    the batch's nodes / edges (``runtime.graphs.largest_shares`` of an actual batch), priced
    instead of the mean 1 / P for values of that item kind."""
    items = {v: (int(d), str(k)) for op in layer.ops for v, (d, k) in (op.attrs.get("items") or {}).items()}

    def block(v, s, operand_rank=None):
        it = items.get(v)
        if shares and it is not None and it[1] in shares and it[0] < len(s):
            out = [int(n) for n in s]
            out[it[0]] = max(1, math.ceil(int(s[it[0]]) * float(shares[it[1]])))
            return tuple(out)
        lay = dec.value_layout(layer, v, s)
        return lay.max_local_shape(s) if operand_rank is None else lay.max_local_operand_shape(s, operand_rank)

    def local(op, ins, out):
        return ([block(v, s, len(op.out_shape)) for v, s in zip(op.inputs, op.in_shapes)],
                block(op.name, op.out_shape))
    return price_replicated_weights(layer, Sharding(), _native_ctx(ctx), compute_shapes=local)


def _native_ctx(ctx: CostContext) -> CostContext:
    """``ctx`` that prices every op as run inside the user's module (``native_runtime``: the
    per-op runtime work of ``runtime_op``'s native table, ``cost.primitives``)."""
    return dataclasses.replace(ctx, native_runtime=True, cost_memo=None)
