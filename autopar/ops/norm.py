"""Normalisations: batch norm, layer norm, group norm, RMS norm (``n`` = output elements)."""

from __future__ import annotations

from .registry import (OpFamily, all_dims, numel, register_family, register_multi_output,
                       same_index_dims)


@register_family
class BatchNorm(OpFamily):
    """``aten.batch_norm(x, w, b, running_mean, running_var, training, momentum, eps)``.
    FLOPs ``8 n`` forward (``norm`` class convention), ``12 n`` backward; bytes in + out. Saves
    its input. Per channel (dim 1) it is independent; in training the statistics run over
    every other dim, which a decomposition may split only through ``runtime.ops.
    sync_batch_norm`` (``synced_dims``)."""

    kind = "batch_norm"
    aten = frozenset({"batch_norm"})
    kernel_class = fallback_class = "norm"
    sweep_backward = True          # the norm sweep is batch norm in training
    transparent = True
    parametric = True

    def attrs(self, op):
        a = op.args
        return {"training": bool(a[5]), "momentum": float(a[6]) if a[6] is not None else 0.1,
                "eps": float(a[7])}

    def flops(self, op):
        n = float(numel(op.out_shape))
        return 8.0 * n, 12.0 * n

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return 8.0 * numel(out_shape)

    def local_params(self, op, in_shapes):
        return {r: [int(in_shapes[0][1])] for r in op.params}

    def independent_dims(self, op):
        if op.attrs.get("training", True):
            return same_index_dims(op, [1])
        return same_index_dims(op, all_dims(op))

    def synced_dims(self, op):
        if not op.attrs.get("training", True):
            return frozenset()
        return same_index_dims(op, [d for d in all_dims(op) if d != 1])


class _LastDimsNorm(OpFamily):
    """Normalised over the last ``len(normalized_shape)`` dims: independent along the others."""

    kernel_class = fallback_class = "norm"
    parametric = True
    eps_arg = 4                       # position of eps in the aten call
    #: kept as its own layer: a layer's ops share one decomposition, and folding a norm into
    #: the preceding linear layer would take the linear's channel/filter choices away
    transparent = False

    def attrs(self, op):
        shape = op.args[1] if len(op.args) > 1 else [op.out_shape[-1]]
        shape = [int(s) for s in (shape if isinstance(shape, (list, tuple)) else [shape])]
        eps = op.args[self.eps_arg] if len(op.args) > self.eps_arg else None
        return {"normalized_shape": shape, "eps": float(eps) if eps is not None else None}

    def independent_dims(self, op):
        k = len(op.attrs.get("normalized_shape", [])) or 1
        return same_index_dims(op, range(len(op.out_shape) - k))


@register_family
class LayerNorm(_LastDimsNorm):
    """``aten.layer_norm(x, normalized_shape, w, b, eps)``: FLOPs ``8 n`` forward (mean,
    variance, normalise, affine: the ``norm`` convention), ``12 n`` backward; bytes in + out.
    Saves its input (and per-row statistics, not counted)."""

    kind = "layer_norm"
    aten = frozenset({"layer_norm"})

    def flops(self, op):
        n = float(numel(op.out_shape))
        return 8.0 * n, 12.0 * n

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return 8.0 * numel(out_shape)


@register_family
class RMSNorm(_LastDimsNorm):
    """``aten.rms_norm(x, normalized_shape, w, eps)``: FLOPs ``4 n`` forward (square, mean,
    scale, weight), ``8 n`` backward; bytes in + out. Saves its input."""

    kind = "rms_norm"
    aten = frozenset({"rms_norm"})
    eps_arg = 3

    def flops(self, op):
        n = float(numel(op.out_shape))
        return 4.0 * n, 8.0 * n

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return 4.0 * numel(out_shape)


@register_family
class GroupNorm(OpFamily):
    """``aten.group_norm(x, num_groups, w, b, eps)``, x (N, C, *): statistics per sample and
    group; FLOPs ``8 n`` forward, ``12 n`` backward; bytes in + out. Saves its input.
    Independent along the samples only."""

    kind = "group_norm"
    aten = frozenset({"group_norm"})
    kernel_class = fallback_class = "norm"
    parametric = True

    def attrs(self, op):
        eps = op.args[4] if len(op.args) > 4 else None
        return {"num_groups": int(op.args[1]), "eps": float(eps) if eps is not None else None}

    def flops(self, op):
        n = float(numel(op.out_shape))
        return 8.0 * n, 12.0 * n

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return 8.0 * numel(out_shape)

    def independent_dims(self, op):
        return same_index_dims(op, [0])


@register_multi_output("native_layer_norm")
class NativeLayerNorm(OpFamily):
    """``native_layer_norm(x, shape, w, b, eps) -> (y, mean, rstd)``: ``y`` is ``layer_norm``
    of the same arguments; the statistics are not expressible alone."""

    def getitem(self, base, args, kwargs, index, x_shape):
        if index != 0:
            return None
        return "aten.layer_norm.default", list(args[:5]), {}
