"""Pooling: max/avg pooling over 1-3 spatial dims (kind ``pool``) and adaptive average
pooling (kind ``adaptive_pool``). Shape legend: x_NC* input, y_NC* output."""

from __future__ import annotations

import math

from .registry import (OpFamily, expand_ints, numel, register_family, register_multi_output,
                       same_index_dims)

POOL_OPS = frozenset({"max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d",
                      "avg_pool3d"})


@register_family
class Pool(OpFamily):
    """``max_poolNd(x, kernel, stride, padding, dilation, ceil_mode)`` and ``avg_poolNd(x,
    kernel, stride, padding, ceil_mode, count_include_pad)``. Trace FLOPs ``|x|`` forward,
    ``2 |x|`` backward; priced with the ``pool`` class at ``|y| * prod(kernel)`` FLOPs (the
    calibrator's count), bytes in + out. Saves its input. Independent per sample and channel."""

    kind = "pool"
    aten = POOL_OPS
    kernel_class = fallback_class = "pool"
    sweep_backward = True

    def attrs(self, op):
        a = op.args
        nsp = len(op.out_shape) - 2
        k = expand_ints(a[1], nsp)
        stride = expand_ints(a[2], nsp) or k
        attrs = {"pool": "max" if op.target.startswith("aten.max") else "avg", "kernel": k,
                 "stride": stride, "padding": expand_ints(a[3], nsp) if len(a) > 3 else [0] * nsp}
        if attrs["pool"] == "max":
            attrs["dilation"] = expand_ints(a[4], nsp) if len(a) > 4 else [1] * nsp
            attrs["ceil_mode"] = bool(a[5]) if len(a) > 5 else False
        else:
            attrs["dilation"] = [1] * nsp
            attrs["ceil_mode"] = bool(a[4]) if len(a) > 4 else False
            attrs["count_include_pad"] = bool(a[5]) if len(a) > 5 else True
        return attrs

    def flops(self, op):
        n = float(sum(numel(s) for s in op.in_shapes))
        return n, 2.0 * n

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return numel(out_shape) * math.prod(op.attrs.get("kernel", [1]))

    def independent_dims(self, op):
        return same_index_dims(op, [0, 1])


@register_family
class AdaptivePool(OpFamily):
    """``adaptive_avg_poolNd(x, output_size)``: FLOPs ``|x|`` forward and backward (``pool``
    class), bytes in + out. Saves its input. Independent per sample and channel."""

    kind = "adaptive_pool"
    aten = frozenset({"adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"})
    kernel_class = fallback_class = "pool"
    sweep_backward = True

    def attrs(self, op):
        a = op.args[1]
        return {"output_size": list(a) if isinstance(a, (list, tuple)) else [a], "pool": "avg"}

    def flops(self, op):
        n = float(sum(numel(s) for s in op.in_shapes))
        return n, n

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return float(sum(numel(s) for s in in_shapes))

    def independent_dims(self, op):
        return same_index_dims(op, [0, 1])


@register_multi_output("max_pool1d_with_indices", "max_pool2d_with_indices",
                       "max_pool3d_with_indices")
class MaxPoolWithIndices(OpFamily):
    """``max_poolNd_with_indices(...)[0]`` is ``max_poolNd`` of the same arguments; the indices
    are not expressible alone (a model that uses them does not trace)."""

    def getitem(self, base, args, kwargs, index, x_shape):
        if index != 0:
            return None
        return f"aten.{base.replace('_with_indices', '')}.default", list(args[:6]), {}
