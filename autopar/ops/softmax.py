"""Softmax and log-softmax over one dim (kind ``softmax``)."""

from __future__ import annotations

from .registry import OpFamily, numel, register_family, same_index_dims


@register_family
class Softmax(OpFamily):
    """``aten.(_)(log_)softmax(x, dim, ...)``: FLOPs ``4 n`` forward (max, subtract-exp, sum,
    divide) and ``8 n`` backward. Kernel class ``softmax`` when a profile has it; the profiles
    so far do not, and the ``elementwise`` fit prices those ``4 n`` FLOPs with bytes in + out.
    Saves its output. Independent along every dim but ``dim``."""

    kind = "softmax"
    aten = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})
    n_act = (1,)
    kernel_class = "softmax"
    fallback_class = "elementwise"

    def attrs(self, op):
        return {"dim": int(op.args[1]) % max(1, len(op.out_shape))}

    def flops(self, op):
        n = float(numel(op.out_shape))
        return 4.0 * n, 8.0 * n

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return 4.0 * numel(out_shape)

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return float(numel(out_shape) * itemsize)

    def independent_dims(self, op):
        d = op.attrs.get("dim", len(op.out_shape) - 1)
        return same_index_dims(op, [i for i in range(len(op.out_shape)) if i != d])
