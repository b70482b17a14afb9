"""Embedding lookup: ``aten.embedding(weight, indices, padding_idx, ...)`` (kind
``embedding``). Shape legend: w_VD (vocabulary, width), indices i_* (any shape), y_*D."""

from __future__ import annotations

from .registry import OpFamily, numel, register_family, same_index_dims

INDEX_BYTES = 8   # int64 indices


@register_family
class Embedding(OpFamily):
    """Rows moved: M = |indices|, each of width D. FLOPs ``M D`` forward (a gather) and
    ``M D`` backward (an index-add into the weight gradient), the ``gather_scatter`` class's
    convention (``elementwise`` when the profile lacks it): bytes ``2 M D`` elements plus
    ``8 M`` for the indices. Saves the indices. Independent along every index dim (the
    weight is whole on each block). Not measured exactly (``exact_ops`` draws float inputs)."""

    kind = "embedding"
    aten = frozenset({"embedding"})
    n_act = (1,)
    kernel_class = "gather_scatter"
    fallback_class = "elementwise"
    parametric = True
    exact_measured = False

    def flops(self, op):
        n = float(numel(op.out_shape))
        return n, n

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return float(numel(out_shape))

    def local_bytes(self, op, in_shapes, out_shape, w_shape=None, itemsize=4):
        m = numel(in_shapes[0]) if in_shapes else 0
        return float(2 * numel(out_shape) * itemsize + INDEX_BYTES * m)

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return float(INDEX_BYTES * numel(in_shapes[0])) if in_shapes else 0.0

    def independent_dims(self, op):
        return same_index_dims(op, range(len(op.out_shape) - 1))
