"""Dropout: ``aten.dropout(x, p, train)``, ``aten.feature_dropout``."""

from __future__ import annotations

from .registry import OpFamily, all_dims, numel, register_family, same_index_dims


@register_family
class Dropout(OpFamily):
    """FLOPs ``n`` forward and backward (``elementwise``). Saves its mask (one byte per
    element) when ``p > 0`` in training. Runs on any block (each block draws its own mask:
    the function is the same in distribution, not bit for bit); folds into its producer."""

    kind = "dropout"
    aten = frozenset({"dropout", "feature_dropout"})
    transparent = True

    def attrs(self, op):
        return {"p": float(op.args[1]), "train": bool(op.args[2])}

    def flops(self, op):
        n = float(numel(op.out_shape))
        return n, n

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        p = op.attrs.get("p", 0.0)
        return numel(out_shape) * 1.0 if p and op.attrs.get("train", True) else 0.0

    def independent_dims(self, op):
        return same_index_dims(op, all_dims(op))
