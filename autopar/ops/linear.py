"""Matrix products: ``aten.linear`` with a weight (kind ``linear``) and products of
activations or of an activation with a parameter (kind ``matmul``: matmul, mm, bmm, einsum,
addmm, baddbmm, linear whose weight is an activation)."""

from __future__ import annotations

import math

from .registry import (OpFamily, is_act, numel, operand_shapes, register_family,
                       same_index_dims)


@register_family
class Linear(OpFamily):
    """``y[M,O] = x[M,K] w[O,K]^T (+ b)``, M = prod(x[:-1]): ``2 M K O`` FLOPs forward and for
    each of the two backward matmuls (backward priced at twice forward with ``matmul``, or
    exact shapes); bytes ``M K + M O + O K`` elements. Saves its input. Runs unchanged on
    blocks of every dim but the last."""

    kind = "linear"
    aten = frozenset({"linear"})
    n_act = (1,)
    kernel_class = fallback_class = "matmul"
    sweep_backward = True
    parametric = True
    exact_measured = False            # priced by ``shape_spec`` instead

    def flops(self, op):
        w = op.params["weight"]
        fl = 2.0 * math.prod(op.in_shapes[0][:-1]) * w[0] * w[1]
        return fl, 2 * fl

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        w = list(w_shape if w_shape is not None else op.params["weight"])
        return 2.0 * math.prod(in_shapes[0][:-1]) * w[0] * w[1]

    def local_bytes(self, op, in_shapes, out_shape, w_shape=None, itemsize=4):
        w = list(w_shape if w_shape is not None else op.params["weight"])
        m = math.prod(in_shapes[0][:-1])
        return float((m * w[1] + m * w[0] + w[0] * w[1]) * itemsize)

    def shape_spec(self, op, in_shapes, w_shape=None):
        w = list(w_shape if w_shape is not None else op.params["weight"])
        x = in_shapes[0]
        return {"op": "linear", "x": [int(math.prod(x[:-1])), int(x[-1])], "w": [int(s) for s in w]}

    def independent_dims(self, op):
        return same_index_dims(op, range(len(op.out_shape) - 1))


def _einsum_sizes(op, shapes) -> tuple[str, list[str], str, dict[str, int]] | None:
    """(equation lhs, operand subscripts, output subscripts, letter -> extent) of an einsum
    from the operands whose shapes are known; None for ellipses or implicit outputs."""
    eq = op.args[0]
    if not isinstance(eq, str) or "..." in eq or "->" not in eq:
        return None
    lhs, rhs = eq.replace(" ", "").split("->")
    subs = lhs.split(",")
    sizes: dict[str, int] = {}
    for sub, shp in zip(subs, shapes):
        if shp is not None:
            for c, n in zip(sub, shp):
                sizes[c] = int(n)
    return lhs, subs, rhs, sizes


@register_family
class Matmul(OpFamily):
    """Products whose both operands may be activations. FLOPs ``2 * |y| * K`` (K the
    contracted extent; einsum: ``2 * prod(extent of every letter)``), addmm/baddbmm add
    ``|y|``; backward twice forward (two products). Bytes: operands and output. Saves its
    activation operands. Independent dims: the batch dims both operands share (and the rows
    of ``a`` when only ``a`` is an activation); einsum: output letters at the same position
    in every activation operand and in no other operand."""

    kind = "matmul"
    aten = frozenset({"matmul", "mm", "bmm", "einsum", "addmm", "baddbmm", "linear"})
    kernel_class = fallback_class = "matmul"
    sweep_backward = True
    parametric = True

    def matches(self, base, n_act, node=None):
        if base == "linear":           # linear with an activation weight
            return n_act >= 2
        return base in self.aten

    def _operands(self, op, in_shapes=None):
        """(a shape, b shape, extra flops per output element) from the traced call."""
        shapes = operand_shapes(op, in_shapes)
        b = op.target.split(".")[1]
        if b in ("addmm", "baddbmm"):
            return shapes[1], shapes[2], 1.0
        return shapes[0], shapes[1], 0.0

    def _flops(self, op, in_shapes, out_shape) -> float:
        base = op.target.split(".")[1]
        if base == "einsum":
            tensors = op.args[1] if len(op.args) > 1 else []
            act = {v: s for v, s in zip(op.inputs, in_shapes)}
            shp = [act.get(t["v"]) if is_act(t) else None for t in tensors]
            parsed = _einsum_sizes(op, shp)
            if parsed is None:
                return 2.0 * numel(out_shape)
            _, _, rhs, sizes = parsed
            for c, n in zip(rhs, out_shape):
                sizes[c] = int(n)
            return 2.0 * math.prod(sizes.values())
        a, b, extra = self._operands(op, in_shapes)
        k = (a[-1] if a else None) or (b[-2] if b and len(b) > 1 else (b[0] if b else 1))
        return 2.0 * numel(out_shape) * int(k) + extra * numel(out_shape)

    def flops(self, op):
        fl = self._flops(op, op.in_shapes, op.out_shape)
        return fl, 2 * fl

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return self._flops(op, in_shapes, out_shape)

    def local_bytes(self, op, in_shapes, out_shape, w_shape=None, itemsize=4):
        """``w_shape``: the local weight of a Conv1D ``addmm(b, x, w_CF)`` split by a tensor-parallel
        decomposition (its local bias has ``w_shape[-1]`` entries)."""
        if w_shape is not None and "mat2" in op.params:
            pbytes = numel(w_shape) + (int(w_shape[-1]) if "self" in op.params else 0)
        else:
            pbytes = sum(numel(s) for s in op.params.values())
        return float((sum(numel(s) for s in in_shapes) + numel(out_shape) + pbytes) * itemsize)

    def local_params(self, op, in_shapes):
        """A Conv1D ``addmm(b, x, w_CF)`` on a block whose features are split (a row-parallel
        projection: x holds C/p features) has C/p weight rows; otherwise whole."""
        out = {r: list(s) for r, s in op.params.items()}
        w = op.params.get("mat2")
        if w is not None and len(w) == 2 and in_shapes and in_shapes[0]:
            out["mat2"] = [int(in_shapes[0][-1]), int(w[1])]
        return out

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return float(sum(numel(s) for s in in_shapes) * itemsize)

    def independent_dims(self, op):
        base = op.target.split(".")[1]
        rank = len(op.out_shape)
        if base == "einsum":
            tensors = op.args[1] if len(op.args) > 1 else []
            parsed = _einsum_sizes(op, [None] * len(tensors))
            if parsed is None:
                return frozenset()
            _, subs, rhs, _ = parsed
            keep = []
            for d, c in enumerate(rhs):
                ok = True
                for t, sub in zip(tensors, subs):
                    if is_act(t):
                        ok &= d < len(sub) and sub[d] == c
                    else:
                        ok &= c not in sub
                if ok:
                    keep.append(d)
            return same_index_dims(op, keep)
        first = 1 if base in ("addmm", "baddbmm") else 0
        ops = op.args[first:first + 2]
        if len(ops) < 2 or not all(isinstance(x, dict) for x in ops):
            return frozenset()
        dims = list(range(max(0, rank - 2)))
        if is_act(ops[0]) and not is_act(ops[1]) and rank >= 2:
            dims.append(rank - 2)          # rows of a, b a parameter: like a linear layer
        if not all(is_act(x) for x in ops):
            # a parameter operand must have no batch dims of its own (it is whole on blocks)
            par = [s for s, x in zip(operand_shapes(op)[first:first + 2], ops) if not is_act(x)]
            if any(s is None or len(s) > 2 for s in par):
                return frozenset()
        return same_index_dims(op, dims)
