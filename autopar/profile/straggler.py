"""The straggler model: how long a synchronisation of w ranks waits for the slowest after some
compute (``Straggler``), and its fit from measured (compute, wait) points (``fit_straggler``).
Measured by ``calibrate.insitu``; priced by ``cost.primitives.StragglerCharge``. Pure."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Straggler:
    """How long a synchronisation of w ranks waits for the slowest after ``t`` seconds of
    compute since the previous one: ``min(kappa t, sigma sqrt(t))``.

    Each round of w ranks lasts as long as its slowest rank's compute, and the others wait.
    Measured within the same rounds (``straggler_point``), the wait grows linearly over short
    segments (whole time slices lost to the other ranks) and as the square root of the compute
    over long ones (the ranks' compute times drift apart like sums of independent jitters). On
    the 2-core machine, 4 ranks: 3.2, 12.6, 21.7, 32.1 ms of wait after 15, 56, 243, 543 ms of
    convolutions (0.21 t, then about 1.4 ms x sqrt(t / 1 ms)); 2 ranks about a third of that.
    Fitted by ``fit_straggler`` (``measure_in_situ``). On dedicated devices both are about 0; on
    a CPU whose cores the ranks (and gloo's threads) share they are the step's straggler tax
    (``cost.primitives.StragglerCharge``)."""
    kappa: float           # wait per second of compute, short segments
    sigma: float           # s^0.5: the spread of long segments, which grows as sqrt(t)

    def wait_s(self, compute_s: float) -> float:
        t = max(0.0, compute_s)
        return min(self.kappa * t, self.sigma * math.sqrt(t))


def fit_straggler(points) -> Straggler:
    """The ``Straggler`` fitted from (compute seconds, wait seconds) per segment length,
    shortest first: kappa the median of wait / compute over all but the longest (clipped to
    [0, 2]), sigma the longest's wait / sqrt(compute) (>= 0)."""
    *short, (t_long, d_long) = points
    ratios = [d / t for t, d in short if t > 0]
    kappa = float(min(2.0, max(0.0, statistics.median(ratios)))) if ratios else 0.0
    sigma = max(0.0, d_long) / math.sqrt(t_long) if t_long > 0 else 0.0
    return Straggler(kappa, float(sigma))
