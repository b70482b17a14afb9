"""Checks of a GNN batch before training: every edge index must point at a node of its own
graph. An index past the node tensor fails inside a gather at best; an index into another
graph of a PyG batch, or at a padded node of a dense one, silently mixes graphs. Both are
caught here, before the first step, with the graph, the edge and the value.

What is an edge index and what a node tensor comes from the tracer's marks
(``autopar.trace.graph_items``, ``op.attrs["items"]``) on the plan's graph inputs:

* dense padded form (items along dim 1): integer edge inputs ``[B, E]`` (``src``, ``dst``)
  index the gather's source of ``N_src`` nodes (the padded graph plus its extra zero node):
  ``0 <= v < N_src``; with a node mask (a floating node input ``[B, N]``, 1 for real nodes)
  graph ``g``'s indices must be ``< n_g`` (its real nodes) or ``>= N`` (the padding node);
* PyG form (items along dim 0): ``edge_index [2, E]`` indexes ``x [N, F]``: ``0 <= v < N``;
  with a batch vector (an integer node input ``[N]``) both ends of an edge must lie in the
  same graph.
"""

from __future__ import annotations

from typing import Any, Sequence

from ...errors import AutoparError


class EdgeIndexError(AutoparError):
    """An edge index of a GNN batch points outside its graph (names graph, edge and value)."""


def _items(graph) -> dict[str, tuple[int, str]]:
    return {v: (int(d), k) for lay in graph.layers for op in lay.ops
            for v, (d, k) in (op.attrs.get("items") or {}).items()}


def _gather_source(graph) -> tuple[int, int] | None:
    """(item dim, node extent ``N_src``) of the message-passing gathers' source."""
    shapes = {gi.name: gi.shape for gi in graph.inputs}
    shapes.update({op.name: op.out_shape for lay in graph.layers for op in lay.ops})
    for lay in graph.layers:
        for op in lay.ops:
            if op.kind == "gather" and op.args and isinstance(op.args[0], dict) and "v" in op.args[0]:
                d = int(op.attrs.get("dim", 0))
                return d, int(shapes[op.args[0]["v"]][d])
    return None


def check_edge_indices(graph, inputs: Sequence[Any]) -> None:
    """Raise ``EdgeIndexError`` for the first edge index outside its graph (see the module
    docstring); nothing for a model without marked edge inputs."""
    items = _items(graph)
    named = {gi.name: x for gi, x in zip(graph.inputs, inputs)}
    edges = [(n, x, items[n][0]) for n, x in named.items()
             if n in items and items[n][1] == "edge" and not x.is_floating_point()]
    if not edges:
        return
    nodes = [(n, x, items[n][0]) for n, x in named.items() if n in items and items[n][1] == "node"]
    src = _gather_source(graph)
    dense = src[0] == 1 if src else all(d == 1 for _, _, d in nodes)
    n_src = src[1] if src else None
    for name, idx, d in edges:
        if dense and idx.dim() == 2:                          # dense padded form [B, E]
            limit = n_src if n_src is not None else max((int(x.shape[1]) for _, x, _ in nodes), default=None)
            mask = next((x for _, x, dd in nodes if x.is_floating_point() and x.dim() == 2 and dd == 1), None)
            n_pad = int(mask.shape[1]) if mask is not None else limit
            real = (mask != 0).sum(1) if mask is not None else None
            for g in range(idx.shape[0]):
                row = idx[g]
                hi = limit if limit is not None else None
                bad = (row < 0) | (row >= hi) if hi is not None else row < 0
                if real is not None:
                    bad |= (row >= int(real[g])) & (row < n_pad)
                if bool(bad.any()):
                    e = int(bad.nonzero()[0, 0])
                    n_g = int(real[g]) if real is not None else hi
                    raise EdgeIndexError(
                        f"{name}[{g}, {e}] = {int(row[e])}: edge {e} of graph {g} points outside the "
                        f"graph's {n_g} nodes (padding edges point at node {n_pad})",
                        "fix the batch's edge indices before training")
        else:                                                 # PyG form: [2, E] over x [N, F]
            n = n_src if n_src is not None else max((int(x.shape[0]) for _, x, _ in nodes), default=None)
            flat = idx.reshape(-1)
            bad = (flat < 0) | (flat >= n) if n is not None else flat < 0
            if bool(bad.any()):
                k = int(bad.nonzero()[0, 0])
                e = k % idx.shape[-1]
                raise EdgeIndexError(f"{name}: edge {e} points at node {int(flat[k])}, outside the batch's "
                                     f"{n} nodes", "fix the batch's edge indices before training")
            batch = next((x for _, x, dd in nodes if not x.is_floating_point() and x.dim() == 1), None)
            if batch is not None and idx.dim() == 2 and idx.shape[0] == 2:
                gs, gd = batch[idx[0]], batch[idx[1]]
                cross = gs != gd
                if bool(cross.any()):
                    e = int(cross.nonzero()[0, 0])
                    raise EdgeIndexError(
                        f"{name}: edge {e} ({int(idx[0, e])} -> {int(idx[1, e])}) joins graph "
                        f"{int(gs[e])} to graph {int(gd[e])}",
                        "every edge of a PyG batch must stay inside its graph; fix the edge indices")
