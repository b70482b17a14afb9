"""The profile's vocabulary: its schema, op classes, collectives, link levels, phases, and the
collective cost forms ``collective_terms`` (written once, here: ``Profile.collective_time_s``
prices with them and ``profile.fit`` fits with them). The forms (alpha: per-message latency in
s, beta: s per byte, p: group size, n: bytes by the conventions of ``Profile.collective_time_s``;
``L = ceil(log2 p)``)::

    p2p             t = alpha + n*beta
    allgather       t = L*alpha + (p-1)/p * n*beta
    reduce_scatter  t = L*alpha + (p-1)/p * n*beta
    allreduce       t = 2*L*alpha + 2*(p-1)/p * n*beta
    broadcast       t = L*(alpha + n*beta)
    all_to_all      t = (p-1)*alpha + (p-1)/p * n*beta

Standard library only.
"""

from __future__ import annotations

import math

from ..errors import CalibrationError

PROFILE_SCHEMA = "autopar.profile/1"
OP_CLASSES = ("conv_fwd", "conv_bwd_data", "conv_bwd_filter", "matmul", "elementwise", "norm",
              "pool", "gather_scatter", "attention")
COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
LEVELS = ("intra", "inter")
PHASES = ("fwd", "bwd_data", "bwd_filter")
SIMULATED = "simulated"   # ``measured`` value of an entry measured on a simulated multi-node layout


def collective_terms(kind: str, p: int) -> tuple[float, float]:
    """Coefficients ``(a, b)`` with ``t = a*alpha + b*n*beta`` for ``kind`` at group size ``p``.

    Broadcast, ``L*(alpha + n*beta)``, is ``a = b = L``. See the module docstring for all forms.
    """
    if kind == "p2p":
        return 1.0, 1.0
    p = int(p)
    if p <= 1:
        return 0.0, 0.0
    steps = math.ceil(math.log2(p))
    frac = (p - 1) / p
    if kind in ("allgather", "reduce_scatter"):
        return float(steps), frac          # L*alpha + (p-1)/p*n*beta
    if kind == "allreduce":
        return 2.0 * steps, 2.0 * frac     # 2L*alpha + 2(p-1)/p*n*beta
    if kind == "broadcast":
        return float(steps), float(steps)  # L*(alpha + n*beta)
    if kind == "all_to_all":
        return float(p - 1), frac          # (p-1)*alpha + (p-1)/p*n*beta
    raise CalibrationError(f"unknown collective {kind!r}", f"use one of {', '.join(COLLECTIVES)}")
