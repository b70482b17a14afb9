"""A toy op family added by this one file (plus one import line where it is wanted):
``aten.logit(x, eps) = log(x / (1 - x))``, which ``autopar.ops`` does not register."""

from autopar.ops.registry import OpFamily, numel, register_family, same_index_dims


@register_family
class ToyLogit(OpFamily):
    """FLOPs ``3 n`` forward (clamp, divide, log) and ``4 n`` backward; priced with the
    ``elementwise`` class at ``3 n`` FLOPs and bytes in + out. Saves its input. Runs unchanged
    on any block."""

    kind = "toy_logit"
    aten = frozenset({"logit"})
    n_act = (1,)

    def flops(self, op):
        n = float(numel(op.out_shape))
        return 3.0 * n, 4.0 * n

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return 3.0 * numel(out_shape)

    def independent_dims(self, op):
        return same_index_dims(op, range(len(op.out_shape)))
