"""Padding graphs at run time, exactly: a list of graphs -> the dense padded batch of a padded
GNN (``strategies/examples/gnn_pcqm4m.py``, LBANN's CCGrid 2022 form).

Legend: ``n`` / ``e`` a graph's node / edge count, ``N`` / ``E`` the padded counts (a bucket's,
``autopar.cost.padding``), ``F`` node features, ``Fe`` edge features, ``B`` graphs in a batch.

A graph is ``(x, edge_index, edge_attr, y)`` (a tuple, a dict with those keys, or an object
with those attributes, e.g. a PyG ``Data``): ``x[n, F]``, ``edge_index[2, e]`` integer (row 0
the source, row 1 the destination, PyG's convention: messages flow source -> destination),
``edge_attr[e, Fe]``, ``y`` one value per graph.

The padded batch (``PaddedBatch``, what the dense model's ``forward(x, e, src, dst,
node_mask)`` takes): ``x[B, N, F]`` with zero rows for padded nodes, ``e[B, E, Fe]`` with zero
rows for padded edges, ``src[B, E]`` / ``dst[B, E]`` with padded edges pointing at index ``N``
(the model's extra zero node: they gather zeros and scatter into a row that is dropped),
``node_mask[B, N]`` 1 for real nodes, ``y[B]``. The function is unchanged: real nodes see the
same messages, padded nodes are zero and masked out of the pooling.

Errors, before any step runs: a graph larger than the padded size is ``GraphTooLarge`` (its
index and sizes; never truncated); an edge index outside its graph's nodes is
``EdgeIndexOutOfRange`` (graph index, edge column and value); a graph of the wrong form is
``MalformedGraph``. ``check_graphs`` scans a whole data set for these before training.

Graph parallelism of a concatenated PyG batch (the second half of this module,
``split_graph_batch``): every rank takes B / P whole graphs (``autopar.decomp.graph.graphs``),
its node range, the edges whose source is in it, ``edge_index`` and ``batch`` re-based; an
unsorted ``batch`` or B not divisible by P is ``GraphBatchError`` naming the graph.

Runtime side: imports torch, ``autopar.errors`` and the pure graph split
(``autopar.decomp.graph.split``) only (no solver, tracer or cost model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..decomp.graph.split import (GraphBatchError, GraphShard, check_graph_batch,  # noqa: F401  (re-exported)
                                   graph_shard, largest_shares)
from ..errors import AutoparError


class MalformedGraph(AutoparError):
    """A graph whose tensors do not have the shapes ``(x[n,F], edge_index[2,e], edge_attr[e,Fe], y)``."""


class GraphTooLarge(AutoparError):
    """A graph with more nodes or edges than the padded size it must fit (never truncated)."""


class EdgeIndexOutOfRange(AutoparError):
    """An edge index outside ``[0, n)`` for its graph."""


@dataclass(frozen=True)
class PaddedShape:
    """A padded size: ``nodes`` nodes and ``edges`` edges per graph."""
    nodes: int
    edges: int

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> "PaddedShape":
        return PaddedShape(int(obj["nodes"]), int(obj["edges"]))


@dataclass(frozen=True)
class PaddedBatch:
    """The dense batch (module legend)."""
    x: torch.Tensor          # [B, N, F]
    e: torch.Tensor          # [B, E, Fe]
    src: torch.Tensor        # [B, E] int64, padded edges = N
    dst: torch.Tensor        # [B, E] int64, padded edges = N
    node_mask: torch.Tensor  # [B, N]
    y: torch.Tensor          # [B]
    shape: PaddedShape

    def inputs(self) -> tuple:
        """The model's inputs in ``forward`` order."""
        return self.x, self.e, self.src, self.dst, self.node_mask


def graph_parts(g: Any, index: int = 0):
    """(x, edge_index, edge_attr, y) of a graph given as a tuple, a dict or an object."""
    if isinstance(g, Mapping):
        try:
            return g["x"], g["edge_index"], g["edge_attr"], g.get("y")
        except KeyError as k:
            raise MalformedGraph(f"graph {index} lacks {k}", "give x, edge_index, edge_attr and y") from None
    if isinstance(g, (tuple, list)):
        if len(g) != 4:
            raise MalformedGraph(f"graph {index} has {len(g)} parts", "give (x, edge_index, edge_attr, y)")
        return tuple(g)
    try:
        return g.x, g.edge_index, g.edge_attr, getattr(g, "y", None)
    except AttributeError as a:
        raise MalformedGraph(f"graph {index}: {a}", "give x, edge_index, edge_attr and y") from None


def check_graph(g: Any, index: int, shape: PaddedShape | None = None) -> tuple[int, int]:
    """Check one graph (module docstring); returns its (nodes, edges)."""
    x, ei, ea, _ = graph_parts(g, index)
    if x.dim() != 2:
        raise MalformedGraph(f"graph {index}: x has shape {tuple(x.shape)}", "x must be [nodes, features]")
    if ei.dim() != 2 or ei.shape[0] != 2 or ei.dtype.is_floating_point:
        raise MalformedGraph(f"graph {index}: edge_index has shape {tuple(ei.shape)} and dtype {ei.dtype}",
                             "edge_index must be an integer tensor [2, edges]")
    n, e = int(x.shape[0]), int(ei.shape[1])
    if ea.dim() != 2 or ea.shape[0] != e:
        raise MalformedGraph(f"graph {index}: edge_attr has shape {tuple(ea.shape)} for {e} edges",
                             "edge_attr must be [edges, edge features]")
    if shape is not None and (n > shape.nodes or e > shape.edges):
        raise GraphTooLarge(f"graph {index} has {n} nodes and {e} edges, more than the padded size "
                            f"{shape.nodes} nodes / {shape.edges} edges",
                            "re-plan with --graph-sizes listing this data set's graphs (the largest "
                            "bucket is the data set's maximum), or drop the graph")
    if e:
        bad = (ei < 0) | (ei >= n)
        if bool(bad.any()):
            r, c = (int(v) for v in bad.nonzero()[0])
            raise EdgeIndexOutOfRange(
                f"graph {index}: edge {c} has {'source' if r == 0 else 'destination'} {int(ei[r, c])}, "
                f"outside its {n} nodes [0, {n})", "edge indices are per graph, 0-based, below its node count")
    return n, e


def check_graphs(graphs: Iterable[Any], shapes: Sequence[PaddedShape] | None = None) -> list[tuple[int, int]]:
    """Check every graph of a data set before training (module docstring): each against the
    largest of ``shapes`` (if given). Returns the (nodes, edges) of each graph."""
    top = None
    if shapes:
        top = PaddedShape(max(s.nodes for s in shapes), max(s.edges for s in shapes))
    return [check_graph(g, i, top) for i, g in enumerate(graphs)]


def choose_shape(sizes: Sequence[tuple[int, int]], shapes: Sequence[PaddedShape],
                 indices: Sequence[int] | None = None) -> PaddedShape:
    """The smallest padded shape (in the order given, smallest first) that holds every graph of a
    batch; ``GraphTooLarge`` naming the largest graph if none does."""
    nmax = max(n for n, _ in sizes)
    emax = max(e for _, e in sizes)
    for s in shapes:
        if nmax <= s.nodes and emax <= s.edges:
            return s
    i = max(range(len(sizes)), key=lambda j: (sizes[j][0] > shapes[-1].nodes or sizes[j][1] > shapes[-1].edges,
                                              sizes[j]))
    idx = indices[i] if indices is not None else i
    raise GraphTooLarge(f"graph {idx} has {sizes[i][0]} nodes and {sizes[i][1]} edges, more than the largest "
                        f"padded size {shapes[-1].nodes} nodes / {shapes[-1].edges} edges",
                        "re-plan with --graph-sizes listing this data set's graphs, or drop the graph")


def pad_graphs(graphs: Sequence[Any], nodes: int, edges: int, indices: Sequence[int] | None = None,
               dtype: torch.dtype | None = None) -> PaddedBatch:
    """Pad ``graphs`` to ``nodes`` nodes and ``edges`` edges each (module legend). ``indices``
    name the graphs in errors (default: their positions)."""
    shape = PaddedShape(int(nodes), int(edges))
    if not graphs:
        raise MalformedGraph("no graphs to pad", "give at least one graph")
    parts = [graph_parts(g, indices[i] if indices is not None else i) for i, g in enumerate(graphs)]
    for i, g in enumerate(graphs):
        check_graph(g, indices[i] if indices is not None else i, shape)
    x0, _, ea0, _ = parts[0]
    dtype = dtype or x0.dtype
    b, f, fe = len(parts), int(x0.shape[1]), int(ea0.shape[1])
    x = torch.zeros(b, shape.nodes, f, dtype=dtype)
    e = torch.zeros(b, shape.edges, fe, dtype=dtype)
    src = torch.full((b, shape.edges), shape.nodes, dtype=torch.long)
    dst = torch.full((b, shape.edges), shape.nodes, dtype=torch.long)
    mask = torch.zeros(b, shape.nodes, dtype=dtype)
    ys = []
    for i, (xi, ei, ai, yi) in enumerate(parts):
        if xi.shape[1] != f or ai.shape[1] != fe:
            raise MalformedGraph(f"graph {indices[i] if indices is not None else i} has {xi.shape[1]} node / "
                                 f"{ai.shape[1]} edge features, the first graph {f} / {fe}",
                                 "every graph of a data set needs the same feature sizes")
        n, m = xi.shape[0], ei.shape[1]
        x[i, :n] = xi.to(dtype)
        e[i, :m] = ai.to(dtype)
        src[i, :m] = ei[0].long()
        dst[i, :m] = ei[1].long()
        mask[i, :n] = 1
        ys.append(torch.as_tensor(yi if yi is not None else 0.0, dtype=dtype).reshape(()))
    return PaddedBatch(x, e, src, dst, mask, torch.stack(ys), shape)


class PaddedCollate:
    """A ``DataLoader`` collate function: pads each batch to the smallest of ``shapes`` (a
    plan's buckets, smallest first; one shape = one global maximum) that holds all its graphs.
    Every rank that collates the same global batch picks the same shape."""

    def __init__(self, shapes: Sequence[PaddedShape], dtype: torch.dtype | None = None) -> None:
        if not shapes:
            raise MalformedGraph("no padded shapes", "give the plan's padded shapes (plan.json padding.buckets)")
        self.shapes = tuple(sorted(shapes, key=lambda s: (s.nodes, s.edges)))
        self.dtype = dtype

    @staticmethod
    def from_plan_padding(padding: Mapping[str, Any], dtype: torch.dtype | None = None) -> "PaddedCollate":
        """From plan.json's ``padding`` record (``autopar.artifacts.PaddingInfo`` JSON)."""
        return PaddedCollate([PaddedShape.from_json(b) for b in padding["buckets"]], dtype)

    def __call__(self, graphs: Sequence[Any]) -> PaddedBatch:
        sizes = [check_graph(g, i) for i, g in enumerate(graphs)]
        s = choose_shape(sizes, self.shapes)
        return pad_graphs(graphs, s.nodes, s.edges, dtype=self.dtype)


# ---- graph parallelism of a PyG batch: whole graphs per rank -------------------------------
#
# Legend: B graphs in the batch, P ranks, N nodes and E edges of the concatenated batch; rank r
# holds graphs [g0, g1) = [r B / P, (r + 1) B / P), nodes [n0, n1) (contiguous when ``batch``
# is sorted) and the edges whose source node is in [n0, n1). Which input is which comes from
# ``autopar.decomp.graph.graphs.GraphRoles`` (the tracer's marks), not from the model file.

def split_graph_batch(roles, inputs: Sequence[torch.Tensor], targets: torch.Tensor | None,
                      rank: int, world: int) -> tuple[list[torch.Tensor], torch.Tensor | None, GraphShard]:
    """Rank ``rank``'s whole graphs of a PyG batch (legend above): node inputs rows [n0, n1),
    edge inputs the edges of the mask (``edge_index`` re-based by n0), ``batch`` re-based by
    g0, targets rows [g0, g1). ``roles``: ``autopar.decomp.graph.graphs.GraphRoles``."""
    xs = list(inputs)
    batch = xs[roles.batch]
    src = xs[roles.edge_index][0] if roles.edge_index is not None else None
    sh = graph_shard(batch, src, roles.graphs, rank, world)
    out = list(xs)
    for i in roles.node:
        out[i] = xs[i][sh.n0:sh.n1]
    out[roles.batch] = batch[sh.n0:sh.n1] - sh.g0
    for i, d in roles.edge:
        t = xs[i].index_select(d, sh.edges.nonzero().reshape(-1)) if src is not None else xs[i]
        out[i] = t - sh.n0 if i == roles.edge_index else t
    y = targets[sh.g0:sh.g1] if targets is not None else None
    return out, y, sh


def assemble_graph_grad(roles, i: int, grad: torch.Tensor, full_shape: Sequence[int],
                        sh: GraphShard) -> torch.Tensor:
    """The full-size tensor holding this rank's gradient block of input ``i`` (zeros
    elsewhere): summed over the ranks it is the whole input gradient."""
    full = grad.new_zeros(tuple(int(n) for n in full_shape))
    if i in roles.node or i == roles.batch:
        full[sh.n0:sh.n1] = grad
        return full
    for j, d in roles.edge:
        if j == i:
            full.index_copy_(d, sh.edges.nonzero().reshape(-1), grad)
            return full
    return grad


def graph_rows(out: torch.Tensor, graphs: int, world: int) -> torch.Tensor:
    """A rank's output rows: the module returns one row per graph of its sub-batch (B / P), or
    -- with a pooling size fixed to the whole batch (``global_add_pool(..., size=B)``) -- B
    rows of which the first B / P are its graphs (``batch`` is re-based to 0)."""
    mine = graphs // world
    n = int(out.shape[0]) if out.dim() else -1
    if n == mine:
        return out
    if n == graphs:
        return out[:mine]
    raise GraphBatchError(f"the module returned {n} rows for a sub-batch of {mine} graphs (batch of {graphs})",
                          "return one row per graph of the batch it is given (graph-level output)")
