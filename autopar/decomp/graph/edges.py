"""Edge parallelism of message passing: the edges of the batch over ranks.

``Edges(sample, parts)``: each of the ``parts`` ranks of a graph group takes a block of the
edges (dim 1 of the dense padded tensors ``e [B, E, F]``, ``src [B, E]``; dim 0 of PyG's
``edge_attr [E, F]``, dim 1 of ``edge_index [2, E]``), gathers the source features of its
edges from the whole node tensor, computes their messages (the edge MLP and the batched
``x_src @ W(e)`` matmul) and scatter-adds them into a whole node tensor: a ``Partial`` sum
over the ``parts`` ranks, resolved by the consumer's transition (all-reduce or
reduce-scatter). It needs no knowledge of graph boundaries, so the untouched PyG model takes
it as well as the padded form. With ``sample > 1`` (dense form only) the graphs are split
too: the 2-D grid graphs x edges of LBANN's distributed GNN (mesh axis 0 graphs, axis 1
edges). Layouts, legality and runtime: ``common.ItemSplit``.

Cost (per rank, written once in ``ItemSplit.cost``): every op priced on its local block --
the gather moves ``|y| / parts`` elements and the scatter ``|src| / parts`` (``gather_scatter``
class), the edge MLP and the message matmul run on ``E / parts`` edges (``matmul`` class);
nothing sent inside the layer; the partial sum's resolution is the outgoing edge's
transition; weights whole, gradients all-reduced over the world.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import register
from .common import EDGE, ItemSplit


@register
@dataclass(frozen=True)
class Edges(ItemSplit):
    sample: int = 1
    parts: int = 2
    kind = "edges"
    axis = EDGE
