"""Node parallelism of node-wise layers: the nodes of the batch over ranks.

``Nodes(sample, parts)``: each of the ``parts`` ranks of a graph group holds a block of the
nodes (dim 1 of the dense ``x [B, N, F]``, dim 0 of PyG's ``x [N, F]``) and runs the
node-wise layers on it: the node embedding, the root weight ``Theta x``, the residual adds
and activations, the node mask, the MLP before pooling. Sum pooling of the nodes into graphs
(``sum`` over the node dim in the dense form, PyG's ``global_add_pool`` scatter) leaves a
``Partial`` sum over the ``parts`` ranks, resolved by the consumer's transition. In the PyG
form a node-wise layer split along dim 0 is also what ``sample`` runs (its blocks of "samples"
are blocks of nodes); ``Nodes`` adds the pooling and says what is split. With ``sample > 1``
(dense form) graphs x nodes form a 2-D grid. Layouts, legality and runtime:
``common.ItemSplit``.

Cost (per rank, written once in ``ItemSplit.cost``): every op priced on ``N / parts`` nodes
(linears in the ``matmul`` class, elementwise ops and the pooling scatter in theirs); nothing
sent inside the layer; the pooled partial sum's resolution is the outgoing edge's transition;
weights whole, gradients all-reduced over the world.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..base import register
from .common import NODE, ItemSplit


@register
@dataclass(frozen=True)
class Nodes(ItemSplit):
    sample: int = 1
    parts: int = 2
    kind = "nodes"
    axis = NODE
