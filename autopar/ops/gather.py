"""Gathers along one dim: ``aten.gather(x, dim, index)`` (index of the output's shape) and
``aten.index_select(x, dim, index)`` (1-D index) (kind ``gather``)."""

from __future__ import annotations

from .registry import OpFamily, is_act, numel, register_family, same_index_dims

INDEX_BYTES = 8   # int64 indices


def _index_numel(op, out_shape) -> int:
    """Elements of the index: the output's for gather, ``|y|[dim]`` for index_select."""
    if op.target.startswith("aten.index_select"):
        return int(out_shape[op.attrs["dim"]]) if out_shape else 1
    return numel(out_shape)


@register_family
class Gather(OpFamily):
    """M D = |y| elements moved: FLOPs ``|y|`` forward, ``|y|`` backward (a scatter-add of
    the gradient), ``gather_scatter`` class (``elementwise`` if absent), bytes ``2 |y|``
    elements plus ``8 |index|``. Saves the index. Independent along every dim but ``dim``
    when the index lines up with the blocks: gather's index has the output's shape; an
    index_select whose index is an activation is independent nowhere (a block would get a
    slice of the index list). Not measured exactly (``exact_ops`` draws float inputs)."""

    kind = "gather"
    aten = frozenset({"gather", "index_select"})
    kernel_class = "gather_scatter"
    fallback_class = "elementwise"
    exact_measured = False

    def attrs(self, op):
        rank = len(op.out_shape)
        return {"dim": int(op.args[1]) % max(1, rank)}

    def flops(self, op):
        n = float(numel(op.out_shape))
        return n, n

    def local_bytes(self, op, in_shapes, out_shape, w_shape=None, itemsize=4):
        return float(2 * numel(out_shape) * itemsize + INDEX_BYTES * _index_numel(op, out_shape))

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return float(INDEX_BYTES * _index_numel(op, out_shape))

    def independent_dims(self, op):
        if op.target.startswith("aten.index_select") and is_act(op.args[2]):
            return frozenset()
        d = op.attrs.get("dim", 0)
        return same_index_dims(op, [i for i in range(len(op.out_shape)) if i != d])
