"""Keep freed memory in the process between training steps (glibc's malloc).

A training step frees and re-allocates the same large tensors every step. glibc's defaults
give them back to the operating system: a block above ``M_MMAP_THRESHOLD`` (128 KiB, rising
with what is freed up to 32 MiB) is its own ``mmap`` and is unmapped when freed, and the top of
the heap is trimmed once ``M_TRIM_THRESHOLD`` of it is free. The next step then takes a page
fault for every 4 KiB page it touches again: the padded GNN example's step took ~4,300 minor
faults and 24 ms on one process, 13 ms with freed memory kept (PyTorch keeps a caching
allocator on CUDA, none on CPU). ``keep_freed_memory`` raises both thresholds with
``mallopt`` so that the heap serves repeated steps from memory already mapped.

It is called in every rank that ``runtime.launch.run_ranks`` starts (and under torchrun), but
only acts with ``AUTOPAR_MALLOC=keep``: glibc's defaults stay the default. Measured on the
2-core machine (``benchmarks/bench_freed_memory.py`` (removed; git 172578b^), ``bench_prediction.py``): one process
steps 0.58-0.60x faster on the GNNs with it, but the multi-rank steps of ``autopar execute``
measured the same either way, while the calibration's kernel loops got faster under it, so a
profile measured with it under-predicted every plan (prediction benchmark: in-sample 15.4 /
17.4 % against 6.1 % without). Calibrate and run with the same setting.
Elsewhere than glibc (macOS, musl) it does nothing and says so by returning False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1     # glibc's malloc.h parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX_BYTES = 32 * 2**20   # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 2**30            # keep up to 1 GiB of free heap top mapped


def keep_freed_memory() -> bool:
    """With ``AUTOPAR_MALLOC=keep``, raise glibc's mmap and trim thresholds in this process;
    True when both were set. Unset or anything else leaves glibc's defaults (False)."""
    if os.environ.get("AUTOPAR_MALLOC", "system").strip().lower() != "keep":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX_BYTES)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
