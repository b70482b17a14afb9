"""The optimizer step, measured: what ``torch.optim.SGD(momentum=0.9).step()`` costs.

On a CPU the step runs one small loop per parameter tensor (``foreach`` is the default only on
CUDA), so its cost is mostly per tensor, not per byte: ResNet-style layers with a convolution
and a batch norm (three tensors) pay tens of microseconds each however small they are. A
kernel fit per element misses that (0.1 ms predicted, 1 ms measured for the 2-D ResNet
example). Measured here on one rank, on a list of ``n`` tensors of ``e`` elements each, for an
overhead-bound and a bandwidth-bound set, and fitted as::

    t = n_tensors * t0_s + param_bytes * s_per_byte

stored as the pseudo op class ``optimizer_step`` (``cost.table`` prices every layer's update
with it when present).
"""

from __future__ import annotations

import statistics
import time

#: (tensors, elements per tensor): overhead-bound, mixed, bandwidth-bound
SETS = ((96, 16), (32, 256), (48, 4096), (16, 65536), (4, 1 << 20))
#: the sets judged but not fitted (held out), then fitted with the rest
HELD_OUT = (1, 3)


def measure_optimizer_step(repeats: int = 15, device: str = "cpu") -> dict:
    import numpy as np
    import torch

    rows = []
    for n, e in SETS:
        params = [torch.nn.Parameter(torch.randn(e, device=device)) for _ in range(n)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        opt.step()   # creates the momentum buffers
        ts = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
        rows.append({"tensors": n, "elements": e, "bytes": 4 * n * e, "median_s": statistics.median(ts)})
    a = np.array([[r["tensors"], r["bytes"]] for r in rows], float)
    y = np.array([r["median_s"] for r in rows])

    def fit(idx):
        w = 1.0 / y[idx]                     # relative least squares
        coef, *_ = np.linalg.lstsq(a[idx] * w[:, None], y[idx] * w, rcond=None)
        return np.array([max(0.0, float(c)) for c in coef])
    train = [i for i in range(len(rows)) if i not in HELD_OUT]
    held = list(HELD_OUT)
    err = np.abs(a[held] @ fit(train) - y[held]) / y[held]
    t0, sb = fit(list(range(len(rows))))
    return {"t0_s": float(t0), "s_per_flop": 0.0, "s_per_byte": float(sb), "measured": True,
            "per": "tensor", "samples": rows, "n_samples": len(rows),
            "heldout_median_rel_err": float(np.median(err)), "heldout_max_rel_err": float(np.max(err))}


def add_optimizer_step(profile, model: dict) -> None:
    profile.kernels["optimizer_step"] = dict(model)


def optimizer_step_s(profile, n_tensors: int, param_bytes: float) -> float | None:
    """Measured step time of ``n_tensors`` tensors of ``param_bytes`` in all; None when the
    profile has no measurement."""
    k = profile.kernels.get("optimizer_step") if isinstance(getattr(profile, "kernels", None), dict) else None
    if not k:
        return None
    return n_tensors * float(k["t0_s"]) + float(param_bytes) * float(k["s_per_byte"])
