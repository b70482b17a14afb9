"""The graph split of a concatenated PyG batch, whole graphs per rank, as pure functions of
the batch's tensors: shared by the runtime (``autopar.runtime.graphs.split_graph_batch``) and
the planner (``largest_shares``: the largest rank's share of nodes and edges, which it prices).
Below both, so that the planner never imports the runtime; torch is imported only when a batch
is split.

Legend: B graphs in the batch, P ranks, N nodes and E edges of the concatenated batch; rank r
holds graphs [g0, g1) = [r B / P, (r + 1) B / P), nodes [n0, n1) (contiguous when ``batch``
is sorted) and the edges whose source node is in [n0, n1). Which input is which comes from
``autopar.decomp.graph.graphs.GraphRoles`` (the tracer's marks), not from the model file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ...errors import AutoparError

if TYPE_CHECKING:
    import torch


class GraphBatchError(AutoparError):
    """A PyG batch that cannot be split into whole graphs per rank (graphs not contiguous in
    ``batch``, a graph id out of range, or B not divisible by the ranks)."""


@dataclass(frozen=True)
class GraphShard:
    """Rank ``rank``'s part of a PyG batch: graphs [g0, g1), nodes [n0, n1), and the edge
    mask (edges whose source node is in [n0, n1)) of the batch it was cut from."""
    g0: int
    g1: int
    n0: int
    n1: int
    edges: torch.Tensor          # bool [E]


def check_graph_batch(batch: torch.Tensor, graphs: int, world: int) -> None:
    """``GraphBatchError`` unless ``world`` divides ``graphs`` and ``batch`` (graph id per node)
    is sorted, within [0, graphs), so that every graph's nodes are one contiguous range."""
    if world < 1 or graphs % world:
        raise GraphBatchError(f"{graphs} graphs in the batch do not split evenly over {world} ranks",
                              f"use a batch of a multiple of {world} graphs (graph parallelism gives "
                              f"every rank the same number of whole graphs)")
    if batch.numel() == 0:
        return
    lo, hi = int(batch.min()), int(batch.max())
    if lo < 0 or hi >= graphs:
        bad = int(((batch < 0) | (batch >= graphs)).nonzero()[0, 0])
        raise GraphBatchError(f"node {bad} belongs to graph {int(batch[bad])}, outside the batch's "
                              f"{graphs} graphs [0, {graphs})", "batch must hold graph ids 0..B-1")
    step = batch[1:] - batch[:-1]
    if bool((step < 0).any()):
        i = int((step < 0).nonzero()[0, 0])
        g = int(batch[i + 1])
        raise GraphBatchError(
            f"graph {g}'s nodes are not contiguous in batch: node {i + 1} (graph {g}) follows node {i} "
            f"(graph {int(batch[i])})",
            "sort the batch's nodes by graph (a PyG DataLoader / Batch.from_data_list does)")


def graph_shard(batch: torch.Tensor, edge_src: torch.Tensor | None, graphs: int, rank: int,
                world: int) -> GraphShard:
    """Rank ``rank``'s graphs, node range and edge mask (legend above); checks the batch."""
    check_graph_batch(batch, graphs, world)
    g0, g1 = rank * graphs // world, (rank + 1) * graphs // world
    import torch   # only when a batch is split: the module stays importable without torch
    n0 = int(torch.searchsorted(batch, torch.tensor(g0, dtype=batch.dtype, device=batch.device)))
    n1 = int(torch.searchsorted(batch, torch.tensor(g1, dtype=batch.dtype, device=batch.device)))
    if edge_src is None:
        edges = torch.zeros(0, dtype=torch.bool, device=batch.device)
    else:
        edges = (edge_src >= n0) & (edge_src < n1)
    return GraphShard(g0, g1, n0, n1, edges)


def largest_shares(roles, inputs: Sequence[torch.Tensor], world: int) -> dict[str, float]:
    """The largest rank's fraction of the batch's nodes and of its edges under the graph split
    (the planner prices that rank: whole graphs of different sizes do not split evenly)."""
    batch = inputs[roles.batch]
    src = inputs[roles.edge_index][0] if roles.edge_index is not None else None
    n, e = max(1, int(batch.numel())), max(1, int(src.numel())) if src is not None else 1
    node = edge = 0.0
    for r in range(world):
        sh = graph_shard(batch, src, roles.graphs, r, world)
        node = max(node, (sh.n1 - sh.n0) / n)
        edge = max(edge, int(sh.edges.sum()) / e if src is not None else 1.0 / world)
    return {"node": node, "edge": edge}
