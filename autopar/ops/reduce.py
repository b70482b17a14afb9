"""Reductions over dims: mean (kind ``mean``), sum (kind ``sum``), variance and standard
deviation (kind ``var``); ``var_mean`` is read as its two halves."""

from __future__ import annotations

from .registry import (OpFamily, arg, dims_list, numel, register_family, register_multi_output,
                       same_index_dims)


class _Reduce(OpFamily):
    """``op(x, dims, keepdim)``. Independent along the output dims that precede every reduced
    dim (with ``keepdim``: every kept dim), since those keep their index."""

    def attrs(self, op):
        rank = len(op.in_shapes[0])
        a = op.args
        dims = a[1] if len(a) > 1 and a[1] is not None else list(range(rank))
        dims = [d % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
        return {"dims": dims, "keepdim": bool(a[2]) if len(a) > 2 else False}

    def flops(self, op):
        n = float(sum(numel(s) for s in op.in_shapes))
        return n, n

    def independent_dims(self, op):
        rank = len(op.in_shapes[0]) if op.in_shapes else 0
        red = set(dims_list(op.attrs.get("dims"), rank))
        if op.attrs.get("keepdim"):
            keep = [d for d in range(rank) if d not in red]
        else:
            keep = [d for d in range(rank) if d < min(red, default=rank)]
        return same_index_dims(op, keep)


@register_family
class Mean(_Reduce):
    """``aten.mean(x, dims, keepdim)``: FLOPs ``|x|`` forward and backward; priced with the
    ``elementwise`` class at ``|y|`` FLOPs, bytes in + out. Saves its input (as counted so
    far; the backward needs only its shape)."""

    kind = "mean"
    aten = frozenset({"mean"})


@register_family
class Sum(_Reduce):
    """``aten.sum(x, dims, keepdim)``: FLOPs ``|x|`` forward and backward (``elementwise``
    at ``|y|``). Saves nothing (the backward broadcasts the gradient)."""

    kind = "sum"
    aten = frozenset({"sum"})

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return 0.0


@register_family
class Var(_Reduce):
    """``aten.var/std(x, dims, *, correction, keepdim)``: FLOPs ``3 |x|`` forward (mean,
    centre, square-sum), ``3 |x|`` backward (``elementwise`` at ``|y|``). Saves its input."""

    kind = "var"
    aten = frozenset({"var", "std"})

    def attrs(self, op):
        rank = len(op.in_shapes[0])
        dims = arg(op, 1, "dim")
        if op.target.endswith(".dim"):          # var.dim(x, dim, unbiased, keepdim)
            keep = arg(op, 3, "keepdim", False)
        else:                                   # var.correction(x, dim, *, correction, keepdim)
            keep = (op.kwargs or {}).get("keepdim", False)
        return {"dims": dims_list(dims, rank), "keepdim": bool(keep)}

    def flops(self, op):
        n = 3.0 * sum(numel(s) for s in op.in_shapes)
        return n, n


@register_multi_output("var_mean")
class VarMean(OpFamily):
    """``var_mean.dim(x, dims, unbiased, keepdim)`` / ``var_mean.correction(x, dims, *,
    correction, keepdim) -> (var, mean)``: ``var`` and ``mean.dim`` of the same arguments."""

    def getitem(self, base, args, kwargs, index, x_shape):
        dims = args[1] if len(args) > 1 else None
        if len(args) >= 4:                                   # var_mean.dim
            keep = bool(args[3])
            var = ("aten.var.dim", [args[0], dims, args[2], keep], {})
        else:                                                # var_mean.correction
            keep = bool(kwargs.get("keepdim", False))
            var = ("aten.var.correction", [args[0], dims],
                   {"correction": kwargs.get("correction", 1), "keepdim": keep})
        if index == 0:
            return var
        if index == 1:
            return "aten.mean.dim", [args[0], dims if dims is not None else list(range(len(x_shape))), keep], {}
        return None
