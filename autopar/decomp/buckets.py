"""Gradient buckets: which layers' gradients are all-reduced together. Pure arithmetic.

The runtime (``autopar.runtime.gradsync``) packs gradients into these buckets and the cost model
(``autopar.cost.table``) prices one all-reduce per bucket and gradient group, so both import
the rule from here (neither imports the other).
"""

from __future__ import annotations

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024


def layer_buckets(layer_bytes: list[tuple[int, float]], cap_bytes: float = DEFAULT_BUCKET_CAP_BYTES) -> dict[int, int]:
    """Bucket id of each layer that owns parameters. ``layer_bytes``: (layer index, parameter
    bytes as traced) in forward order; buckets fill in backward order, whole layers only, and
    close before a layer that would overflow the cap. Pure: the planner calls it too."""
    out: dict[int, int] = {}
    bucket, filled = 0, 0.0
    for li, nbytes in reversed([lb for lb in layer_bytes if lb[1] > 0]):
        if filled and filled + nbytes > cap_bytes:
            bucket += 1
            filled = 0.0
        out[li] = bucket
        filled += nbytes
    return out
