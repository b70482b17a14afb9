"""Elementwise ops: activations and other one-operand ops (kind ``unary``) and two-operand
ops, possibly with a scalar (kind ``binary``). ``n`` = output elements."""

from __future__ import annotations

from .registry import OpFamily, all_dims, numel, register_family, same_index_dims

UNARY_OPS = frozenset({
    "relu", "relu_", "gelu", "gelu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "silu", "silu_",
    "hardtanh", "hardtanh_", "leaky_relu", "leaky_relu_", "elu", "elu_", "selu", "celu",
    "hardswish", "hardsigmoid", "softplus", "softsign", "mish", "relu6", "log_sigmoid",
    "clone", "contiguous", "alias", "detach", "detach_", "_to_copy", "to",
    "neg", "exp", "abs", "sqrt", "rsqrt", "square", "sin", "cos", "tan", "log", "log2", "log10",
    "log1p", "expm1", "reciprocal", "erf", "erfc", "sign", "floor", "ceil", "round", "trunc",
    "clamp", "clamp_", "clamp_min", "clamp_max", "nan_to_num", "logical_not", "bitwise_not",
    "zeros_like", "ones_like", "full_like", "empty_like"})
BINARY_OPS = frozenset({
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "maximum", "minimum", "pow",
    "rsub", "remainder", "fmod", "floor_divide", "true_divide", "atan2", "masked_fill",
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
    "bitwise_and", "bitwise_or", "bitwise_xor"})


@register_family
class Unary(OpFamily):
    """One activation operand: FLOPs ``n`` forward, ``2 n`` backward (``elementwise`` class:
    read x, write y). Saves its output (what an activation's backward reads). Runs unchanged
    on any block; folds into its producer's layer."""

    kind = "unary"
    aten = UNARY_OPS
    n_act = (1,)
    transparent = True

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return numel(out_shape) * itemsize

    def independent_dims(self, op):
        return same_index_dims(op, all_dims(op))


@register_family
class Binary(OpFamily):
    """Two operands, one or two of them activations: FLOPs ``n`` forward, ``2 n`` backward
    (``elementwise``). Multiplications and divisions save both operands, others nothing.
    Runs unchanged on blocks that split every activation operand alike (broadcast operands
    of another extent are caught by ``same_index_dims``); folds into its producer's layer
    when its one activation operand has the output's shape."""

    kind = "binary"
    aten = BINARY_OPS
    n_act = (1, 2)
    transparent = True
    broadcasts = True

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        if op.target.startswith(("aten.mul", "aten.div")):
            return sum(numel(s) for s in in_shapes) * itemsize
        return 0.0

    def is_transparent(self, op):
        return len(op.inputs) == 1 and list(op.in_shapes[0]) == list(op.out_shape)

    def independent_dims(self, op):
        return same_index_dims(op, all_dims(op))


@register_family
class Triangular(OpFamily):
    """``aten.triu/tril(x, diagonal)`` (a causal mask from ``generate_square_subsequent_mask``):
    FLOPs ``n`` forward and backward (``elementwise``). Which elements it keeps depends on
    their row and column, so it is independent only along the dims before the last two;
    saves nothing."""

    kind = "triangular"
    aten = frozenset({"triu", "tril"})
    n_act = (1,)

    def attrs(self, op):
        return {"diagonal": int(op.args[1]) if len(op.args) > 1 else 0}

    def flops(self, op):
        n = float(numel(op.out_shape))
        return n, n

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return 0.0

    def independent_dims(self, op):
        return same_index_dims(op, range(len(op.out_shape) - 2))
