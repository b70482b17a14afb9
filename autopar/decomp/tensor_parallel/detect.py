"""Find attention blocks (and Conv1D MLPs) in a traced layer graph, to plan each as one
sub-graph unit.

A *projection* is an op that multiplies an activation by a 2-d weight parameter along its last
dim (``projection``): ``nn.Linear``'s ``aten.linear`` (weight ``w_FC``, output features first)
or Hugging Face's ``Conv1D``, traced as ``addmm(bias, x_MC, w_CF)`` between two views (weight
stored transposed: output features LAST).

An attention block is the module that encloses, for one SDPA op, the projections that make its
q, k and v and the projection that consumes its result: walking back from q, k and v (and
forward from the result) through views, permutations, slices, concatenations and elementwise
ops (rotary embeddings) to the nearest projections, the deepest module path that holds all of
those projections. Forward, the walk also passes a ``contiguous`` (unary) op, but only to a
Conv1D projection (GPT-2's ``c_proj``): Hugging Face Llama's ``o_proj`` is reached the same
way, and planning its attention as a unit is left for later (its explicit float32 RMSNorm turns
the float64 reordering of a head-parallel input gradient into a one-float32-ulp difference of
the embedding gradient, which float64 validation flags).

A Conv1D MLP (``mlp_modules``) is the module that encloses two Conv1D projections joined
through views and elementwise ops only (c_fc -> activation -> c_proj of GPT-2): its views and
its activation are separate traced layers, so the Megatron pair cannot be planned layer by
layer as ``filter`` -> ``row_parallel`` is for ``nn.Linear`` MLPs (whose activation folds into
the first layer); as one unit it takes ``mlp(s, p)`` (``heads.MlpParallel``).

``tests`` and the planner merge these modules with ``autopar.trace.units.merge_units`` (the
same merge a model file's ``PLANNING_UNITS`` gets). Pure: no torch, no tracer import.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import ATTENTION, BINARY, CAT, DROPOUT, EXPAND, FLATTEN, LINEAR, MATMUL, PERMUTE, SLICE, \
    SQUEEZE, UNARY, VIEW, LayerGraphData, OpSpec

_THROUGH = frozenset({VIEW, FLATTEN, SQUEEZE, EXPAND, PERMUTE, SLICE, UNARY, BINARY, CAT, DROPOUT})
_ELEMENTWISE = frozenset({VIEW, FLATTEN, SQUEEZE, UNARY, BINARY, DROPOUT})


@dataclass(frozen=True)
class Projection:
    """Where a projection op keeps its weight and bias: parameter roles, and the weight dims
    that hold the output features (``out_dim``) and the input features (``in_dim``)."""

    weight: str
    bias: str
    out_dim: int
    in_dim: int
    conv1d: bool = False


_LINEAR_PROJ = Projection("weight", "bias", 0, 1)
_CONV1D_PROJ = Projection("mat2", "self", 1, 0, conv1d=True)


def projection(op: OpSpec) -> Projection | None:
    """The projection ``op`` is (module docstring), or None: ``aten.linear`` with a 2-d weight,
    or ``aten.addmm(bias, x, w)`` with x the only activation, w a 2-d parameter and the bias a
    1-d parameter (or none) and no alpha/beta (Hugging Face's Conv1D)."""
    if op.kind == LINEAR:
        w = op.params.get("weight")
        return _LINEAR_PROJ if w and len(w) == 2 else None
    if op.kind != MATMUL or not op.target.startswith("aten.addmm") or len(op.inputs) != 1 or op.kwargs:
        return None
    a = op.args
    w, b = op.params.get("mat2"), op.params.get("self")
    if (len(a) != 3 or not isinstance(a[1], dict) or a[1].get("v") != op.inputs[0] or not w or len(w) != 2
            or (b is not None and (len(b) != 1 or int(b[0]) != int(w[1]))) or set(op.params) - {"mat2", "self"}):
        return None
    return _CONV1D_PROJ


def _common_module(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    out = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return ".".join(out)


def _op_index(graph: LayerGraphData) -> tuple[dict, dict, dict]:
    """(op by value name, layer by value name, the ops reading each value) of ``graph``."""
    ops = {op.name: op for lay in graph.layers for op in lay.ops}
    layer_of = {op.name: lay for lay in graph.layers for op in lay.ops}
    users: dict[str, list] = {}
    for op in ops.values():
        for v in op.inputs:
            users.setdefault(v, []).append(op)
    return ops, layer_of, users


def attention_modules(graph: LayerGraphData) -> list[str]:
    """Module paths of the attention blocks not yet planned as one unit (in graph order)."""
    ops, layer_of, users = _op_index(graph)
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
                if projection(src):
                    linears.append(src.module)
                elif src.kind in _THROUGH:
                    todo.extend(src.inputs[:1] if src.kind != BINARY else src.inputs)
        todo, seen = [(name, False)], set()  # forward to the output projection
        while todo:
            u, via_unary = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            for w in users.get(u, []):
                pw = projection(w)
                if pw and (pw.conv1d or not via_unary):
                    linears.append(w.module)
                elif w.kind in (VIEW, FLATTEN, PERMUTE, SQUEEZE, UNARY):
                    todo.append((w.name, via_unary or w.kind == UNARY))
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


def mlp_modules(graph: LayerGraphData, skip: list[str] = ()) -> list[str]:
    """Module paths of the Conv1D MLPs (module docstring) not yet planned as one unit and not
    inside a module of ``skip`` (the attention blocks), in graph order."""
    ops, layer_of, users = _op_index(graph)
    found: list[str] = []
    for name, op in ops.items():
        proj = projection(op)
        if proj is None or not proj.conv1d:
            continue
        todo, seen, ends = [name], set(), []
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            for w in users.get(u, []):
                pw = projection(w)
                if pw is not None:
                    ends.append(w)
                elif w.kind in _ELEMENTWISE:
                    todo.append(w.name)
        if len(ends) != 1 or not projection(ends[0]).conv1d:
            continue
        mod = _common_module([op.module, ends[0].module])
        if not mod or mod in found or any(mod == s or mod.startswith(s + ".") for s in skip):
            continue
        lay = layer_of[name]
        if lay.module == mod and len(lay.ops) > 1:
            continue                         # already a unit
        found.append(mod)
    return found
