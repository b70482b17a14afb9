"""Ops that message-passing code (PyTorch Geometric, padded dense GNNs) writes around its
gathers and scatters: constant padding (``F.pad`` of the node tensor by the extra zero node),
``expand_as`` (PyG broadcasts the scatter index to the messages' shape) and ``new_zeros`` /
``new_ones`` / ``new_full`` / ``new_empty`` (the scatter's output buffer, made from the
messages' dtype and device only)."""

from __future__ import annotations

from .registry import OpFamily, arg, numel, register_family, same_index_dims
from .shape import _View


@register_family
class Pad(OpFamily):
    """``aten.pad(x, pad, "constant", value)`` / ``constant_pad_nd(x, pad, value)``: FLOPs
    ``|y|`` forward (a copy), ``|x|`` backward (a slice of the gradient), ``elementwise``
    class. Saves nothing. Independent along every dim it does not pad (``pad`` lists
    (before, after) pairs from the last dim backwards); other modes (reflect...) nowhere."""

    kind = "pad"
    aten = frozenset({"pad", "constant_pad_nd"})
    n_act = (1,)

    def flops(self, op):
        return float(numel(op.out_shape)), float(numel(op.in_shapes[0]) if op.in_shapes else 0)

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return 0.0

    def padded_dims(self, op) -> set[int] | None:
        pad = arg(op, 1, "pad", [])
        mode = arg(op, 2, "mode", "constant") if op.target.startswith("aten.pad") else "constant"
        if mode != "constant" or not isinstance(pad, (list, tuple)):
            return None
        rank = len(op.out_shape)
        return {rank - 1 - i // 2 for i, p in enumerate(pad) if int(p) != 0}

    def independent_dims(self, op):
        padded = self.padded_dims(op)
        if padded is None:
            return frozenset()
        return same_index_dims(op, [d for d in range(len(op.out_shape)) if d not in padded])


@register_family
class ExpandAs(_View):
    """``aten.expand_as(x, other)``: a view (free), independent along every dim where ``x``
    is not broadcast (both operands then have the output's extent there)."""

    kind = "expand_as"
    aten = frozenset({"expand_as"})
    n_act = (2,)

    def independent_dims(self, op):
        return same_index_dims(op, range(len(op.out_shape)))


@register_family
class NewTensor(OpFamily):
    """``x.new_zeros(size)`` and its kin: a fresh tensor of the given (global) size that reads
    only ``x``'s dtype and device. FLOPs ``|y|`` forward (a fill), none backward; saves
    nothing. Independent nowhere (the size names global extents); a decomposition that knows
    the output's layout may run it with local sizes (``autopar.decomp.graph``)."""

    kind = "new_tensor"
    aten = frozenset({"new_zeros", "new_ones", "new_full", "new_empty"})
    n_act = (1,)
    exact_measured = False

    def flops(self, op):
        return float(numel(op.out_shape)), 0.0

    def local_bytes(self, op, in_shapes, out_shape, w_shape=None, itemsize=4):
        return float(numel(out_shape) * itemsize)

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return 0.0
