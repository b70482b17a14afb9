"""Fits of the profile's cost models, each with a held-out error.

Every model is linear in non-negative constants: ``t ~= X @ c`` with ``c >= 0``. Measured times
span four orders of magnitude, so the fit minimises the *relative* error,
``sum_i ((X_i @ c - t_i) / t_i)^2``, i.e. non-negative least squares on rows scaled by ``1/t_i``
(scipy's NNLS; columns are rescaled first for conditioning, which leaves the solution unchanged).

Held-out error: the samples (one per size) are split with a fixed seed into a random 70% for
fitting and 30% for testing; the median and max of ``|pred - t| / t`` on the test part are
stored. The stored coefficients are then refitted on all samples.

The model forms live in :mod:`autopar.calibrate.profile` (``collective_terms`` and
``Profile.kernel_time_s``) so that prediction and fit share one formula.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .profile import collective_terms

HELDOUT_SEED = 20261130
TRAIN_FRACTION = 0.7


def nnls_relative(X: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Non-negative ``c`` minimising ``sum(((X @ c - t) / t)^2)``."""
    from scipy.optimize import nnls

    X = np.asarray(X, dtype=float)
    t = np.asarray(t, dtype=float)
    if np.any(t <= 0):
        raise ValueError("times must be positive")
    A = X / t[:, None]
    scale = np.abs(A).max(axis=0)
    scale[scale == 0] = 1.0
    c_scaled, _ = nnls(A / scale, np.ones_like(t), maxiter=50 * X.shape[1] + 200)
    return c_scaled / scale


def relative_errors(X: np.ndarray, t: np.ndarray, c: np.ndarray) -> np.ndarray:
    t = np.asarray(t, dtype=float)
    return np.abs(np.asarray(X, dtype=float) @ c - t) / t


def split_indices(n: int, n_params: int, seed: int = HELDOUT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """Random 70/30 split of ``range(n)`` (fixed seed). The test part is empty when too few
    samples remain to fit ``n_params`` constants on the training part."""
    n_train = max(n_params, int(math.ceil(TRAIN_FRACTION * n)))
    if n - n_train < 1:
        return np.arange(n), np.arange(0)
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[:n_train]), np.sort(perm[n_train:])


def fit_with_heldout(X: Sequence, t: Sequence, seed: int = HELDOUT_SEED) -> dict:
    """Fit on 70%, test on 30%, refit on all. Returns coefficients and error statistics."""
    X = np.asarray(X, dtype=float)
    t = np.asarray(t, dtype=float)
    train, test = split_indices(len(t), X.shape[1], seed)
    heldout_med = heldout_max = None
    if len(test):
        c_train = nnls_relative(X[train], t[train])
        err = relative_errors(X[test], t[test], c_train)
        heldout_med, heldout_max = float(np.median(err)), float(err.max())
    c = nnls_relative(X, t)
    err_all = relative_errors(X, t, c)
    return {
        "coef": [float(v) for v in c],
        "heldout_median_rel_err": heldout_med,
        "heldout_max_rel_err": heldout_max,
        "insample_median_rel_err": float(np.median(err_all)),
        "insample_max_rel_err": float(err_all.max()),
        "n_samples": int(len(t)),
        "n_train": int(len(train)),
        "n_test": int(len(test)),
    }


def fit_kernel(flops: Sequence[float], bytes_moved: Sequence[float], times_s: Sequence[float],
               seed: int = HELDOUT_SEED) -> dict:
    """Fit ``t = t0 + flops*s_per_flop + bytes*s_per_byte`` (all constants >= 0)."""
    X = np.column_stack([np.ones(len(times_s)), np.asarray(flops, float), np.asarray(bytes_moved, float)])
    r = fit_with_heldout(X, times_s, seed)
    t0, spf, spb = r.pop("coef")
    return {"t0_s": t0, "s_per_flop": spf, "s_per_byte": spb,
            "flops_per_s": (1.0 / spf) if spf > 0 else None,
            "bytes_per_s": (1.0 / spb) if spb > 0 else None, **r}


def fit_collective(kind: str, group_size: int, nbytes: Sequence[float], times_s: Sequence[float],
                   seed: int = HELDOUT_SEED) -> dict:
    """Fit alpha, beta of ``kind``'s formula at one group size (``profile.collective_terms``)."""
    a, b = collective_terms(kind, group_size)
    if a == 0 or b == 0:
        raise ValueError(f"{kind} has no cost at group size {group_size}: nothing to fit")
    n = np.asarray(nbytes, float)
    X = np.column_stack([np.full(len(n), a), b * n])
    r = fit_with_heldout(X, times_s, seed)
    alpha, beta = r.pop("coef")
    return {"alpha_s": alpha, "beta_s_per_byte": beta, **r}
