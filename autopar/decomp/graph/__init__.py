"""Graph decompositions of message-passing networks (LBANN's distributed GNN, CCGrid 2022):
``edges`` (blocks of edges per rank, the scatter-add left as a partial sum), ``nodes``
(blocks of nodes for node-wise layers and sum pooling) and, with their graph axis, the 2-D
grids graphs x edges and graphs x nodes of the dense padded form. Graphs alone are ``sample``
(``autopar.decomp.sample``) in the padded form and ``graphs`` (whole graphs of a concatenated
PyG batch per rank, a plan-level alternative run natively: ``graphs``) in the PyG form; the edge MLP's wide output layer also takes ``filter``
(``autopar.decomp.channel_filter``). Which values are edges and which nodes is marked by the
tracer (``autopar.trace.graph_items``). ``inputs`` checks a batch's edge indices before
training."""

from . import edges, graphs, nodes  # noqa: F401  (registration)
from .edges import Edges
from .graphs import Graphs
from .nodes import Nodes

__all__ = ["Edges", "Graphs", "Nodes"]
