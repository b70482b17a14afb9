"""Scaled dot-product attention as one op (kind ``attention``).

Shape legend: q_BHLD (batch, heads, query length, head dim), k_BHSD and v_BHSE (key length S),
y_BHLE. ``torch.export`` keeps ``aten.scaled_dot_product_attention.default`` whole.
"""

from __future__ import annotations

from .registry import OpFamily, arg, numel, operand_shapes, register_family, same_index_dims


def attention_flops(q, k, v) -> float:
    """``2 B H L S (D + E)``: Q K^T and P V (``4 B H L S D`` when E = D, the calibrator's
    ``attention`` convention); softmax and masking are not counted."""
    if q is None or k is None or v is None:     # an operand that is a buffer: shape unknown
        return 0.0
    b_h = numel(q[:-2])
    return 2.0 * b_h * q[-2] * k[-2] * (q[-1] + v[-1])


@register_family
class Attention(OpFamily):
    """``sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)``: FLOPs ``attention_flops``
    forward, twice that backward (dQ, dK, dV, dP); kernel class ``attention`` (``matmul`` when
    the profile lacks it); bytes q + k + v + y. Saves q, k, v and y, and the attention weights
    when not fused (``saved_bytes``). Independent along batch
    and heads (blocks of q, k, v and the mask line up); a causal mask is positional, so the
    sequence dims are not independent."""

    kind = "attention"
    aten = frozenset({"scaled_dot_product_attention"})
    kernel_class = "attention"
    fallback_class = "matmul"

    def attrs(self, op):
        return {"dropout_p": float(arg(op, 4, "dropout_p", 0.0) or 0.0),
                "is_causal": bool(arg(op, 5, "is_causal", False)),
                "scale": arg(op, 6, "scale", None)}

    def _qkv(self, op, in_shapes):
        s = operand_shapes(op, in_shapes)
        return s[0], s[1], s[2]

    def flops(self, op):
        fl = attention_flops(*self._qkv(op, op.in_shapes))
        return fl, 2 * fl

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return attention_flops(*self._qkv(op, in_shapes))

    def fused(self, op) -> bool:
        """A fused kernel (flash / memory-efficient) runs unless an explicit ``attn_mask``
        tensor or dropout sends SDPA to the math path, which materialises the attention
        weights."""
        mask = arg(op, 3, "attn_mask", None)
        return not isinstance(mask, dict) and not self.attrs(op)["dropout_p"]

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        """Fused: q, k, v (the KV included) and y (and a mask operand). Not fused
        (``fused``): also the B x H x L x S attention weights (and the dropout mask of the
        same size when dropout is on)."""
        saved = sum(numel(s) for s in in_shapes) + numel(out_shape)
        q, k, _ = self._qkv(op, in_shapes)
        if not self.fused(op) and q is not None and k is not None:
            scores = numel(q[:-1]) * k[-2]
            saved += scores * (2 if self.attrs(op)["dropout_p"] else 1)
        return float(saved * itemsize)

    def independent_dims(self, op):
        return same_index_dims(op, [d for d in (0, 1) if d < len(op.out_shape) - 2])
