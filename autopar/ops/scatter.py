"""Scatters along one dim (kind ``scatter``): ``aten.scatter_add(x, dim, index, src)``,
``aten.scatter_reduce(x, dim, index, src, reduce, include_self)`` (index of src's shape) and
``aten.index_add(x, dim, index, src, alpha)`` (1-D index), and their in-place forms."""

from __future__ import annotations

from .registry import OpFamily, is_act, numel, operand_shapes, register_family, same_index_dims

INDEX_BYTES = 8   # int64 indices


def _src_index(op, in_shapes=None):
    """(|src|, |index|) of the call (from the local shapes when given)."""
    s = operand_shapes(op, in_shapes)
    src = s[3] if len(s) > 3 and s[3] is not None else None
    idx = s[2] if len(s) > 2 and s[2] is not None else None
    n_src = numel(src) if src is not None else numel(op.out_shape)
    if idx is None:
        n_idx = n_src if not op.target.startswith("aten.index_") else (src[op.attrs.get("dim", 0)] if src else 1)
    else:
        n_idx = numel(idx)
    return n_src, n_idx


@register_family
class Scatter(OpFamily):
    """M D = |src| elements moved: FLOPs ``|src|`` forward (the adds), ``|src|`` backward (a
    gather of the gradient), ``gather_scatter`` class (``elementwise`` if absent), bytes
    ``2 |src|`` elements plus ``8 |index|``. Saves the index (scatter_reduce also its input
    and source, for amax/amin/prod). Independent along every dim but ``dim`` when index and
    source line up with the output's blocks; index_add with an activation index, nowhere.
    Not measured exactly (``exact_ops`` draws float inputs)."""

    kind = "scatter"
    aten = frozenset({"scatter_add", "scatter_add_", "index_add", "index_add_", "scatter_reduce",
                      "scatter_reduce_"})
    kernel_class = "gather_scatter"
    fallback_class = "elementwise"
    exact_measured = False

    def attrs(self, op):
        a = {"dim": int(op.args[1]) % max(1, len(op.out_shape))}
        if "scatter_reduce" in op.target:
            a["reduce"] = op.args[4]
        return a

    def flops(self, op):
        n = float(_src_index(op)[0])
        return n, n

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return float(_src_index(op, in_shapes)[0])

    def local_bytes(self, op, in_shapes, out_shape, w_shape=None, itemsize=4):
        n_src, n_idx = _src_index(op, in_shapes)
        return float(2 * n_src * itemsize + INDEX_BYTES * n_idx)

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        n_src, n_idx = _src_index(op, in_shapes)
        extra = (numel(out_shape) + n_src) * itemsize if "scatter_reduce" in op.target else 0
        return float(INDEX_BYTES * n_idx + extra)

    def independent_dims(self, op):
        if op.target.startswith("aten.index_") and is_act(op.args[2]):
            return frozenset()
        d = op.attrs.get("dim", 0)
        return same_index_dims(op, [i for i in range(len(op.out_shape)) if i != d])
