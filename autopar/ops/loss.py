"""Losses: cross entropy and negative log-likelihood (kind ``cross_entropy``), mean squared
and absolute errors (kind ``mse_loss``). Shape legend: x_NC* logits, t_N* targets."""

from __future__ import annotations

from .registry import OpFamily, arg, numel, register_family

REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


class _Loss(OpFamily):
    """Independent along the samples (dim 0 of every input): with ``reduction="none"`` the
    output's dim 0 too; with mean or sum a block gives a partial loss, which the runtime's
    loss-share scaling (``runtime.model.local_loss``: ``* n_r / N``) must turn into the
    single-process value before a decomposition may run it split."""

    reduction_arg = 2

    def attrs(self, op):
        r = arg(op, self.reduction_arg, "reduction", 1)
        return {"reduction": REDUCTIONS.get(r, r) if isinstance(r, int) else r}

    def independent_dims(self, op):
        shapes = list(op.in_shapes) + ([op.out_shape] if op.out_shape else [])
        if not shapes or any(not s for s in shapes) or len({int(s[0]) for s in shapes}) != 1:
            return frozenset()
        return frozenset({0})


@register_family
class CrossEntropy(_Loss):
    """``cross_entropy_loss(x, t, weight, reduction, ignore_index, label_smoothing)`` and
    ``nll_loss(x, t, weight, reduction, ignore_index)``: FLOPs ``4 |x|`` forward for cross
    entropy (log-softmax, then a pick per sample), ``|x|`` for nll; backward twice forward.
    Priced with ``elementwise`` (bytes in + out). Saves the logits (log-probabilities).
    Not measured exactly (class-index targets are integers)."""

    kind = "cross_entropy"
    aten = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"})
    exact_measured = False
    reduction_arg = 3

    def _flops(self, op, in_shapes) -> float:
        per = 4.0 if op.target.startswith("aten.cross_entropy") else 1.0
        return per * numel(in_shapes[0]) if in_shapes else 0.0

    def flops(self, op):
        fl = self._flops(op, op.in_shapes)
        return fl, 2 * fl

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return self._flops(op, in_shapes)


@register_family
class MSELoss(_Loss):
    """``mse_loss/l1_loss/smooth_l1_loss/huber_loss(x, t, reduction, ...)``: FLOPs ``3 |x|``
    forward (difference, square, sum), backward twice that (``elementwise``). Saves both
    inputs."""

    kind = "mse_loss"
    aten = frozenset({"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"})

    def flops(self, op):
        fl = 3.0 * numel(op.in_shapes[0])
        return fl, 2 * fl

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return 3.0 * numel(in_shapes[0])

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return float(sum(numel(s) for s in in_shapes) * itemsize)
