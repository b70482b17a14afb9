"""The networkx view of a layer graph: one node per layer (shapes, dtype, parameter count,
FLOPs, bytes, module), one edge per activation passed between layers (residual and skip edges
included), for topological orders, drawing and diagnostics."""

from __future__ import annotations

import math

import networkx as nx

from ..decomp.ir import LayerGraphData


def to_networkx(graph: LayerGraphData) -> nx.DiGraph:
    g = nx.DiGraph(model=graph.model_name, batch_size=graph.batch_size)
    for lay in graph.layers:
        item = lay.itemsize
        g.add_node(lay.index, name=lay.name, module=lay.module, kinds=[op.kind for op in lay.ops],
                   out_shape=tuple(lay.out_shape), dtype=lay.dtype, param_numel=lay.param_numel,
                   flops_fwd=lay.flops_fwd, flops_bwd=lay.flops_bwd,
                   bytes_out=math.prod(lay.out_shape) * item,
                   bytes_in=sum(math.prod(s) for op in lay.ops for s in op.in_shapes) * item)
    for u, v, value in graph.edges():
        g.add_edge(u, v, value=value, shape=tuple(graph.value_shape(value)))
    return g
