"""Find attention blocks in a traced layer graph, to plan each as one sub-graph unit.

An attention block is the module that encloses, for one SDPA op, the projections that make its
q, k and v and the projection that consumes its result: walking back from q, k and v (and
forward from the result) through views, permutations, slices and elementwise ops (rotary
embeddings) to the nearest linear ops, the deepest module path that holds all of those
linears. ``tests`` and the planner merge these modules with ``autopar.trace.units.merge_units``
(the same merge a model file's ``PLANNING_UNITS`` gets). Pure: no torch, no tracer import.
"""

from __future__ import annotations

from ..ir import ATTENTION, BINARY, CAT, DROPOUT, EXPAND, FLATTEN, LINEAR, PERMUTE, SLICE, SQUEEZE, \
    UNARY, VIEW, LayerGraphData

_THROUGH = frozenset({VIEW, FLATTEN, SQUEEZE, EXPAND, PERMUTE, SLICE, UNARY, BINARY, CAT, DROPOUT})


def _common_module(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    out = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return ".".join(out)


def attention_modules(graph: LayerGraphData) -> list[str]:
    """Module paths of the attention blocks not yet planned as one unit (in graph order)."""
    ops = {op.name: op for lay in graph.layers for op in lay.ops}
    layer_of = {op.name: lay for lay in graph.layers for op in lay.ops}
    users: dict[str, list] = {}
    for op in ops.values():
        for v in op.inputs:
            users.setdefault(v, []).append(op)
    found: list[str] = []
    for name, op in ops.items():
        if op.kind != ATTENTION:
            continue
        linears: list[str] = []
        for v in op.inputs[:3]:              # back from q, k, v to their projections
            todo, seen = [v], set()
            while todo:
                u = todo.pop()
                if u in seen or u not in ops:
                    continue
                seen.add(u)
                src = ops[u]
                if src.kind == LINEAR:
                    linears.append(src.module)
                elif src.kind in _THROUGH:
                    todo.extend(src.inputs[:1] if src.kind != BINARY else src.inputs)
        todo, seen = [name], set()           # forward to the output projection
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            for w in users.get(u, []):
                if w.kind == LINEAR:
                    linears.append(w.module)
                elif w.kind in (VIEW, FLATTEN, PERMUTE, SQUEEZE):
                    todo.append(w.name)
        if len(linears) < 2:
            continue
        mod = _common_module(linears)
        if not mod or mod in found:
            continue
        lay = layer_of[name]
        if lay.module == mod and len(lay.ops) > 1:
            continue                         # already a unit (PLANNING_UNITS)
        found.append(mod)
    return found
