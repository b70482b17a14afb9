"""The optimizer step, measured: what ``torch.optim.SGD(momentum=0.9).step()`` costs in a step.

On a CPU the step runs one small loop per parameter tensor (``foreach`` is the default only on
CUDA), so its cost is mostly per tensor, not per byte: ResNet-style layers with a convolution
and a batch norm (three tensors) pay tens of microseconds each however small they are. A
kernel fit per element misses that (0.1 ms predicted, 1 ms measured for the 2-D ResNet
example). Measured here on one rank, on a list of ``n`` tensors of ``e`` elements each, for
overhead-bound and bandwidth-bound sets, and fitted as::

    t = fixed_s + n_tensors * t0_s + param_bytes * s_per_byte

stored as the pseudo op class ``optimizer_step`` (``cost.table`` prices every layer's update
with the last two terms, and the step's ``fixed_s`` once, in the first layer:
``cost.table.price_optimizer_fixed``).

**Cold, as a training step meets it.** In a training loop the update runs right after
backward, which has pushed the parameters, their momentum buffers and the interpreter's and
dispatcher's own working set out of the caches, and on a multi-rank node the other ranks
share the last-level cache. On a CPU each step is therefore timed after writing a buffer of
twice the last-level cache (``cold_flush_bytes``); the hot times stay in every row
(``hot_median_s``). Measured on this 2-core VM for the nine benchmark models' own training
loops (``benchmarks/bench_optimizer_in_situ.py`` (removed; git 172578b^), ``reports/benchmarks/optimizer_in_situ.txt`` (removed; git 172578b^)):
against the update in two processes' loops at once, the cold fit priced it -9 % in the median
(11 % |error|), the hot fit without a fixed share, stored before, -55 %; on one process alone
+20 % and -40 %. On CUDA the step is timed as it comes (kernel launches; no flush).
"""

from __future__ import annotations

import statistics
import time

#: (tensors, elements per tensor): fixed-cost-bound, overhead-bound, mixed, bandwidth-bound
SETS = ((4, 16), (96, 16), (32, 256), (48, 4096), (16, 65536), (4, 1 << 20))
#: the sets judged but not fitted (held out), then fitted with the rest
HELD_OUT = (2, 4)
#: last-level cache assumed where the system does not say (bytes)
DEFAULT_LLC_BYTES = 32 << 20


def cold_flush_bytes() -> int:
    """Twice the largest CPU cache the system reports (``/sys/devices/system/cpu/cpu0/cache``),
    else twice ``DEFAULT_LLC_BYTES``: what is written before each cold step."""
    import glob
    sizes = []
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(f) as fh:
                txt = fh.read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
            sizes.append(int(txt.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return 2 * (max(sizes) if sizes else DEFAULT_LLC_BYTES)


def measure_optimizer_step(repeats: int = 15, device: str = "cpu") -> dict:
    """Time ``SGD(momentum=0.9).step()`` on each set of ``SETS``, cold on a CPU (module
    docstring), hot as well, and fit ``fixed_s``, ``t0_s`` and ``s_per_byte`` to the cold
    medians (relative least squares, non-negative), judged on ``HELD_OUT`` first."""
    import numpy as np
    import torch
    from scipy.optimize import nnls

    cold = device != "cuda"
    flush = torch.empty(cold_flush_bytes() // 4) if cold else None
    rows = []
    for n, e in SETS:
        params = [torch.nn.Parameter(torch.randn(e, device=device)) for _ in range(n)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        opt.step()   # creates the momentum buffers
        ts, hot = [], []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            for kind in (("cold", "hot") if cold else ("hot",)):
                if kind == "cold":
                    flush.fill_(1.0)
                t = time.perf_counter()
                opt.step()
                if device == "cuda":
                    torch.cuda.synchronize()
                (ts if kind == "cold" else hot).append(time.perf_counter() - t)
        rows.append({"tensors": n, "elements": e, "bytes": 4 * n * e,
                     "median_s": statistics.median(ts if cold else hot),
                     "hot_median_s": statistics.median(hot)})
    a = np.array([[1.0, r["tensors"], r["bytes"]] for r in rows], float)
    y = np.array([r["median_s"] for r in rows])

    def fit(idx):
        w = 1.0 / y[idx]                     # relative least squares
        coef, _ = nnls(a[idx] * w[:, None], y[idx] * w)
        return coef
    train = [i for i in range(len(rows)) if i not in HELD_OUT]
    held = list(HELD_OUT)
    err = np.abs(a[held] @ fit(train) - y[held]) / y[held]
    fixed, t0, sb = (float(c) for c in fit(list(range(len(rows)))))
    return {"fixed_s": fixed, "t0_s": t0, "s_per_flop": 0.0, "s_per_byte": sb, "measured": True,
            "per": "tensor", "cache": (f"cold: each step after writing {flush.numel() * 4 >> 20} MiB "
                                       "(twice the last-level cache)") if cold else "as it comes",
            "samples": rows, "n_samples": len(rows),
            "heldout_median_rel_err": float(np.median(err)), "heldout_max_rel_err": float(np.max(err))}


