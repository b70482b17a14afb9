"""Which values of a traced graph are indexed by graph *edges* and which by graph *nodes*.

Message passing reads node features along edges with a gather (``x[src]``: ``index_select``
in PyTorch Geometric, ``gather`` along the padded edge dim in the dense form) and adds the
messages into the nodes with a scatter (``scatter_add`` / ``index_add``). These ops fix two
extents along one tensor dim ``d`` (0 in PyG, 1 in the dense padded form, where dim 0 holds the
graphs):

* edge extent E: the gather's output (and index) and the scatter's source, ``shape[d]``;
* node extent N: the gather's source and the scatter's output, ``shape[d]``; a constant
  ``pad`` or a slice along ``d`` of a node value (the padded form's extra zero node) gives
  another node extent.

A scatter whose source is already node-indexed is a pooling (PyG's ``global_add_pool``), its
output graph-level. Only message passing marks anything: a gather from and a scatter into the
same node extent (a lone gather, such as a loss picking each sample's target class, does not);
extents of 1 are ignored. Every value whose shape has the edge (node) extent at ``d`` -- or, for an
index tensor such as ``edge_index [2, E]``, at exactly one other dim -- is marked edge (node)
in the attributes of the ops that read or write it: ``op.attrs["items"] = {value: [dim,
"edge" | "node"]}``. An extent that is both is left unmarked (nothing is split along it).
The graph decompositions (``autopar.decomp.graph``) read these marks. Pure: no torch.
"""

from __future__ import annotations

from ..decomp.ir import GATHER, SCATTER, LayerGraphData
from ..ops.registry import is_act

EDGE, NODE = "edge", "node"


def _arg_value(op, i: int) -> str | None:
    a = op.args[i] if i < len(op.args) else None
    return a["v"] if is_act(a) else None


def graph_extents(data: LayerGraphData) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """((dim, edge extent), ...), ((dim, node extent), ...) found from the gathers and scatters."""
    ops = [op for lay in data.layers for op in lay.ops]
    shapes = {gi.name: list(gi.shape) for gi in data.inputs}
    shapes.update({op.name: list(op.out_shape) for op in ops})
    edge: set[tuple[int, int]] = set()
    g_node: set[tuple[int, int]] = set()          # node extents of the gathers' sources
    s_node: set[tuple[int, int]] = set()          # node extents of the scatters' outputs
    for op in ops:
        if op.kind == GATHER:
            src, idx = _arg_value(op, 0), _arg_value(op, 2)
            if src and idx:
                d = int(op.attrs.get("dim", 0))
                if int(op.out_shape[d]) > 1:
                    edge.add((d, int(op.out_shape[d])))
                    g_node.add((d, int(shapes[src][d])))
    for op in ops:
        if op.kind == SCATTER:
            idx, src = _arg_value(op, 2), _arg_value(op, 3)
            if idx and src:
                d = int(op.attrs.get("dim", 0))
                if (d, int(shapes[src][d])) in g_node or int(shapes[src][d]) <= 1:
                    continue                      # a pooling: nodes -> graphs
                edge.add((d, int(shapes[src][d])))
                s_node.add((d, int(op.out_shape[d])))
    node = _with_pads(ops, g_node | s_node)
    # message passing: a gather from and a scatter into the same nodes (a lone gather, e.g. a
    # loss picking the target class, marks nothing)
    if not (_with_pads(ops, g_node) & _with_pads(ops, s_node)):
        return set(), set()
    both = {x[1] for x in edge} & {x[1] for x in node}
    return ({x for x in edge if x[1] not in both}, {x for x in node if x[1] not in both})


def _with_pads(ops, node: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """``node`` and the extents a constant pad or a slice along ``d`` makes of them (the
    padded form's extra zero node, and dropping it after the scatter)."""
    node = set(node)
    for _ in range(3):
        for op in ops:
            if op.kind in ("pad", "slice") and op.in_shapes and not op.attrs.get("select"):
                for d, n in list(node):
                    a, b = op.in_shapes[0], op.out_shape
                    if len(a) > d and len(b) > d and (op.kind == "pad" or op.attrs.get("dim") == d):
                        if int(a[d]) == n:
                            node.add((d, int(b[d])))
                        elif int(b[d]) == n:
                            node.add((d, int(a[d])))
    return node


def classify(shape, edge: set, node: set) -> tuple[int, str] | None:
    """(dim, "edge" | "node") of a value of ``shape``, None when it is neither."""
    for kinds, name in ((edge, EDGE), (node, NODE)):
        for d, n in sorted(kinds):
            if len(shape) > d and int(shape[d]) == n:
                return d, name
    for kinds, name in ((edge, EDGE), (node, NODE)):
        for d, n in sorted(kinds):
            hits = [j for j, s in enumerate(shape) if int(s) == n]
            if len(hits) == 1 and len(shape) > 1:
                return hits[0], name
    return None


def mark_graph_items(data: LayerGraphData) -> LayerGraphData:
    """Set ``op.attrs["items"]`` on every op that reads or writes an edge or node value (see
    the module docstring); graphs without message passing are left unchanged."""
    edge, node = graph_extents(data)
    if not edge and not node:
        return data
    for lay in data.layers:
        for op in lay.ops:
            items = {}
            for v, s in list(zip(op.inputs, op.in_shapes)) + [(op.name, op.out_shape)]:
                c = classify(s, edge, node)
                if c is not None:
                    items[v] = [c[0], c[1]]
            if items:
                op.attrs = {**op.attrs, "items": items}
            elif "items" in op.attrs:
                op.attrs = {k: v for k, v in op.attrs.items() if k != "items"}
    return data
