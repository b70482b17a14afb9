"""Find the parallel branches of a planning unit and say how each op runs under them. Pure.

A unit (``autopar.trace.units``: a parallel GPT block, a multi-tower module) forks one value
into k independent sub-graphs and joins them. The *heavy* ops (those with parameters, matmuls,
attention) decide the branches: a heavy op comparable (ancestor or descendant) to every other
heavy op is *shared* (the block's layer norm before the fork, a head after the join); the
others, grouped by comparability (union-find), are the branches, in traced order. Every op
then gets a role from the branches it descends from (``S(op)``):

* ``shared``   S = {} : computed by every rank (before the fork, or independent of it);
* ``branch c`` S = {c}: computed only by the ranks of branch c's group; the other ranks hold
                zeros, so that the value is a *partial sum* over the branch axis (its sum over
                the groups is the single-process value);
* ``join``     |S| >= 2: combines branches. ``local`` when the op is linear in its partial
                inputs (add/sub/cat/stack with shared operands kept on group 0 only; views,
                permutes, slices of one partial value; mul/div of a partial by a shared value),
                else ``reduce``: each partial input is first summed over the branch axis (the
                all-reduce of grid translation's *sum*), and the op runs on the whole value;
                ``gather``: a concatenation of all branches (then ``split`` for elementwise ops
                after it) stays split along the concatenated dim, each group holding its
                branches' slices (``_gathers``; the transition after the unit all-gathers).

Each value is ``SHARED`` (whole on every rank of the branch axis), ``PARTIAL`` (addends over
it) or ``SPLIT`` (blocks of ``split_dim`` over it); a unit output that is partial or split
leaves with that layout and the transition after the unit resolves it (all-reduce /
reduce-scatter, all-gather).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Layer

SHARED, PARTIAL, SPLIT = "shared", "partial", "split"

#: ops linear in each operand separately, whose shared operands must count once (group 0)
_SUMS = ("aten.add.Tensor", "aten.sub.Tensor", "aten.cat.default", "aten.stack.default")
#: ops linear in their one partial operand (the others shared: scales, shapes)
_LINEAR_ONE = ("aten.mul.Tensor", "aten.div.Tensor", "aten.neg.default", "aten.clone.default")
_LINEAR_KINDS = ("view", "permute", "flatten", "squeeze", "slice", "expand")
_HEAVY_KINDS = ("linear", "matmul", "attention", "conv")


@dataclass
class BranchAnalysis:
    """The branches of a unit (op names of each heavy op set), each op's role, each value's
    state, and the join mode of join ops (``local`` or ``reduce``)."""

    branches: list[list[str]] = field(default_factory=list)   # heavy ops per branch
    role: dict[str, str] = field(default_factory=dict)        # op -> "shared" | "branch" | "join"
    branch_of: dict[str, int] = field(default_factory=dict)   # op of role "branch" -> branch
    join_mode: dict[str, str] = field(default_factory=dict)   # op of role "join" -> mode
    state: dict[str, str] = field(default_factory=dict)       # value -> SHARED | PARTIAL | SPLIT
    split_dim: dict[str, int] = field(default_factory=dict)   # SPLIT value -> its split dim
    problem: str | None = None                                # why the unit has no branches

    @property
    def count(self) -> int:
        return len(self.branches)


def _number_operand(op) -> bool:
    """A literal number added or subtracted (``x + 1``): it must count once, so the join
    cannot stay a partial sum."""
    return op.target in ("aten.add.Tensor", "aten.sub.Tensor") and any(
        isinstance(a, (int, float)) and not isinstance(a, bool) for a in op.args[:2])


def _heavy(op) -> bool:
    return bool(op.params) and op.kind not in ("layer_norm", "rms_norm", "batch_norm", "group_norm") \
        or op.kind in _HEAVY_KINDS


def ancestors(ops) -> dict[str, set[str]]:
    """op name -> the ops of ``ops`` (in graph order) it depends on, directly or not."""
    mine = {op.name for op in ops}
    anc: dict[str, set[str]] = {}
    for op in ops:
        a: set[str] = set()
        for v in op.inputs:
            if v in mine:
                a.add(v)
                a |= anc[v]
        anc[op.name] = a
    return anc


def refuse_batch_norm(layer: Layer) -> str | None:
    """Why a branch unit cannot hold batch norm: its statistics and running buffers would
    follow one group's samples only."""
    bn = next((op.name for op in layer.ops if op.kind == "batch_norm"), None)
    return f"{bn}: batch norm inside a branch unit is not supported" if bn else None


def analyse(layer: Layer) -> BranchAnalysis:
    """Branches, roles and states of ``layer``'s ops (see the module docstring)."""
    ops = layer.ops
    anc = ancestors(ops)
    heavy = [op.name for op in ops if _heavy(op)]

    def comparable(x: str, y: str) -> bool:
        return x in anc[y] or y in anc[x]

    branchy = [h for h in heavy if not all(comparable(h, o) for o in heavy if o != h)]
    parent = {h: h for h in branchy}

    def find(h: str) -> str:
        while parent[h] != h:
            parent[h] = parent[parent[h]]
            h = parent[h]
        return h

    for i, x in enumerate(branchy):
        for y in branchy[i + 1:]:
            if comparable(x, y):
                parent[find(y)] = find(x)
    comps: dict[str, list[str]] = {}
    for h in branchy:
        comps.setdefault(find(h), []).append(h)
    out = BranchAnalysis(branches=list(comps.values()))
    if out.count < 2:
        out.problem = (f"unit {layer.module or layer.name} has no parallel branches "
                       f"(its parametric ops form one chain)")
        return out
    comp_of = {h: i for i, hs in enumerate(out.branches) for h in hs}
    for v in layer.inputs:
        out.state[v] = SHARED
    for op in ops:
        srcs = {comp_of[a] for a in anc[op.name] if a in comp_of}
        if op.name in comp_of:
            srcs.add(comp_of[op.name])
        if not srcs:
            out.role[op.name] = "shared"
            out.state[op.name] = SHARED
        elif len(srcs) == 1:
            out.role[op.name] = "branch"
            out.branch_of[op.name] = srcs.pop()
            out.state[op.name] = PARTIAL
        else:
            out.role[op.name] = "join"
            parts = [out.state.get(v, SHARED) == PARTIAL for v in op.inputs]
            if op.target in _SUMS and not _number_operand(op):
                mode = "local"
            elif op.target in _LINEAR_ONE and sum(parts) == 1 and not (
                    op.target == "aten.div.Tensor" and len(parts) > 1 and parts[1]):
                mode = "local"
            elif op.kind in _LINEAR_KINDS and sum(parts) == 1 and not op.params:
                mode = "local"
            else:
                mode = "reduce"
            out.join_mode[op.name] = mode
            out.state[op.name] = PARTIAL if mode == "local" else SHARED
    _gathers(out, ops)
    return out


def _gathers(out: BranchAnalysis, ops) -> None:
    """A concatenation of every branch's output, in branch order, equal widths, along a dim
    other than the samples', followed only by elementwise unary ops: the result can stay split
    along that dim over the branch axis (each group holds its branches' slices: LBANN's slice /
    gather grid translation), instead of a zero-padded partial sum."""
    users: dict[str, list] = {}
    for op in ops:
        for v in op.inputs:
            users.setdefault(v, []).append(op)
    for op in ops:
        if op.target != "aten.cat.default" or out.join_mode.get(op.name) != "local":
            continue
        rank = len(op.out_shape)
        dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0)
        dim = int(dim) % rank
        if dim == 0 or [out.branch_of.get(v) for v in op.inputs] != list(range(out.count)):
            continue
        if len({tuple(s) for s in op.in_shapes}) != 1:
            continue
        chain, ok, frontier = [op], True, [op.name]
        while frontier and ok:
            v = frontier.pop()
            for u in users.get(v, []):
                if u.kind == "unary" and len(u.inputs) == 1:
                    chain.append(u)
                    frontier.append(u.name)
                else:
                    ok = False
        if not ok:
            continue
        for i, o in enumerate(chain):
            out.join_mode[o.name] = "gather" if i == 0 else "split"
            out.state[o.name] = SPLIT
            out.split_dim[o.name] = dim


_CACHE: dict[int, tuple[Layer, BranchAnalysis]] = {}


def analysis(layer: Layer) -> BranchAnalysis:
    """``analyse`` once per layer object (the runtime asks on every op of every step)."""
    hit = _CACHE.get(id(layer))
    if hit is not None and hit[0] is layer:
        return hit[1]
    a = analyse(layer)
    _CACHE[id(layer)] = (layer, a)
    return a
