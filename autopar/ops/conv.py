"""Convolution (1-3 spatial dims, not transposed): ``aten.conv{1,2,3}d``, ``aten.convolution``.

Shape legend: x_NC* input (N, C, *spatial), w_FCk* filter (F, C/g, *k), y_NF* output.
"""

from __future__ import annotations

import math

from .registry import OpFamily, expand_ints, numel, register_family, same_index_dims


def conv_padding(pad, k, dil, nsp):
    """Padding as a list per spatial dim; ``"same"`` stays a string when it is asymmetric."""
    if isinstance(pad, str):
        if pad == "valid":
            return [0] * nsp
        if pad == "same":
            eff = [d * (kk - 1) for kk, d in zip(k, dil)]
            if all(e % 2 == 0 for e in eff):
                return [e // 2 for e in eff]
            return "same"
    return expand_ints(pad, nsp)


def conv_flops(x_shape, w_shape, out_shape) -> float:
    """``2 * N * F * prod(out_spatial) * C/g * prod(k)`` (multiply-add = 2), per phase."""
    return 2.0 * x_shape[0] * w_shape[0] * math.prod(out_shape[2:]) * w_shape[1] * math.prod(w_shape[2:])


@register_family
class Convolution(OpFamily):
    """Forward, backward-data and backward-filter each ``conv_flops``; bytes ``|x| + |w| +
    |y|``; priced per phase with ``conv_fwd``/``conv_bwd_data``/``conv_bwd_filter`` or exact
    shapes (``kernels.measure_exact``). Saves its input. Runs unchanged on sample blocks."""

    kind = "conv"
    aten = frozenset({"conv1d", "conv2d", "conv3d", "convolution"})
    n_act = (1,)
    kernel_class = fallback_class = "conv_fwd"
    bwd_classes = ("conv_bwd_data", "conv_bwd_filter")
    parametric = True
    exact_measured = False            # priced by ``shape_spec`` instead

    def matches(self, base, n_act, node=None):
        if not super().matches(base, n_act, node):
            return False
        # aten.convolution(x, w, b, stride, padding, dilation, transposed, ...): not transposed
        return base != "convolution" or node is None or not node.args[6]

    def attrs(self, op):
        w = op.params["weight"]
        nsp = len(w) - 2
        a = op.args
        groups = a[8] if op.target.startswith("aten.convolution") else a[6]
        dil = expand_ints(a[5], nsp)
        return {"stride": expand_ints(a[3], nsp), "dilation": dil,
                "padding": conv_padding(a[4], w[2:], dil, nsp), "groups": int(groups),
                "transposed": False}

    def flops(self, op):
        fl = conv_flops(op.in_shapes[0], op.params["weight"], op.out_shape)
        return fl, 2 * fl

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        w = list(w_shape if w_shape is not None else op.params["weight"])
        return conv_flops(in_shapes[0], w, out_shape)

    def local_bytes(self, op, in_shapes, out_shape, w_shape=None, itemsize=4):
        w = list(w_shape if w_shape is not None else op.params["weight"])
        return super().local_bytes(op, in_shapes, out_shape, w, itemsize) + numel(w) * itemsize

    def shape_spec(self, op, in_shapes, w_shape=None):
        """The calibrator's shape spec of the convolution on local input ``in_shapes[0]``."""
        a = op.attrs
        w = list(w_shape if w_shape is not None else op.params["weight"])
        return {"op": "conv", "x": [int(s) for s in in_shapes[0]], "w": [int(s) for s in w],
                "stride": list(a["stride"]),
                "padding": list(a["padding"]) if not isinstance(a["padding"], str) else a["padding"],
                "dilation": list(a["dilation"]), "groups": int(a["groups"])}

    def independent_dims(self, op):
        return same_index_dims(op, [0])
