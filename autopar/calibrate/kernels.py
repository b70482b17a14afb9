"""Kernel benchmarks: one sample per (op class, size) for the kernel fits, and exact shapes.

The FLOP and byte conventions of every op class, the shape keys and the convolution models'
features are the pure profile model's (``autopar.profile.features``, ``autopar.profile.keys``,
re-exported here for the measurement code); this module holds what measures: the size sweeps,
timing, and the benchmarks of each op class, run inside ranks.
"""

from __future__ import annotations

import collections
import math
import random
import statistics
import time
from typing import Callable, Iterable

from ..profile.features import (GATHER_SCATTER_FORMS, attention_features, conv_cpu_path, edge_matmul_features,
                                elementwise_features, gather_scatter_features, matmul_features, norm_features,
                                pool_features, spec_features)
from ..profile.keys import normalize_spec, shape_key
from ..profile.schema import OP_CLASSES

# --------------------------------------------------------------------------------------------
# Size sweeps (pure: lists of config dicts from a seed)
# --------------------------------------------------------------------------------------------


#: channel widths of the CNN-like sweep shapes: powers of two and the multiples of 4 that
#: mobile and scaled networks use (EfficientNet's 24, 40, 80, 112, 192...), which oneDNN blocks
#: unevenly (``conv_layout_features``)
CNN_WIDTHS_2D = (8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 256, 320, 384, 512)
CNN_WIDTHS_3D = (4, 8, 12, 16, 24, 32, 48, 64)


def _cnn_like_conv(rng: random.Random) -> dict:
    """A convolution as CNNs have them: channels (``CNN_WIDTHS_*``) that grow as the image
    shrinks, 1x1 and 3x3 kernels (sometimes 7x7), strides 1 and 2, ImageNet-like image sizes."""
    d = 2 if rng.random() < 0.8 else 3
    c = rng.choice(CNN_WIDTHS_2D if d == 2 else CNN_WIDTHS_3D)
    f = max(4, int(round(c * rng.choice([0.25, 0.5, 1, 1, 2, 4]))))
    k = rng.choice([1, 3, 3, 1, 3, 7] if d == 2 else [1, 3, 3])
    s = rng.choice([1, 1, 1, 2])
    sp = rng.choice([7, 8, 14, 16, 28, 32, 56, 64] if d == 2 else [4, 8, 12, 16, 24, 32])
    n = rng.choice([1, 2, 4, 8, 16] if d == 2 else [1, 2, 4])
    return {"op": "conv", "x": [n, c] + [sp] * d, "w": [f, c] + [k] * d,
            "stride": [s] * d, "padding": [k // 2] * d, "dilation": [1] * d, "groups": 1}


def _native_path_conv(rng: random.Random) -> dict:
    """A convolution torch runs on its native CPU path (``conv_cpu_path``): one sample of a
    small image (2-D or 3-D, as a data-parallel rank of a small batch holds it), or a 1x1
    kernel below 16 samples."""
    if rng.random() < 0.3:
        d = 2
        n, c, sp = rng.choice([1, 2, 4, 8]), 2 ** rng.randint(3, 8), rng.choice([7, 8, 14, 16, 28, 32])
        f, k = max(8, int(c * rng.choice([0.25, 0.5, 1, 2, 4]))), 1
    else:
        d = 2 if rng.random() < 0.5 else 3
        n, k = 1, 3
        c = rng.choice([1, 3, 4, 8, 16, 32] if d == 3 else [1, 3, 8, 16, 32, 64])
        sp = rng.choice([8, 10, 16, 20, 24] if d == 3 else [8, 14, 16, 28, 32, 56])
        f = rng.choice([8, 12, 16, 24, 32, 64])
    s = rng.choice([1, 1, 2]) if k > 1 else 1
    return {"op": "conv", "x": [n, c] + [sp] * d, "w": [f, c] + [k] * d,
            "stride": [s] * d, "padding": [k // 2] * d, "dilation": [1] * d, "groups": 1}


def _conv_config(rng: random.Random, max_flops: float, min_flops: float) -> dict | None:
    """Half the sweep CNN-like shapes (``_cnn_like_conv``: what models are made of, so that the
    shape-aware model generalises to unseen CNNs), about one in seven on torch's native CPU path
    (``_native_path_conv``: ``conv_shape/2`` fits that path apart, which needs rows of it), the
    rest random sizes (the corners)."""
    u = rng.random()
    if u >= 0.85:
        spec = _native_path_conv(rng)
        if conv_cpu_path(spec) != "native":
            return None
        flops, _ = spec_features(spec)[1:]
        return spec if min_flops <= flops <= max_flops else None
    if u < 0.5:
        spec = _cnn_like_conv(rng)
        if spec["x"][2] < spec["w"][2]:
            return None
        flops, _ = spec_features(spec)[1:]
        return spec if min_flops <= flops <= max_flops else None
    d = 2 if rng.random() < 0.7 else 3
    n = rng.choice([1, 2, 4, 8, 16] if d == 2 else [1, 2, 4])
    c = rng.choice([1, 3, 8, 16, 32, 64, 128] if d == 2 else [1, 4, 8, 16, 32])
    f = rng.choice([8, 16, 32, 64, 128] if d == 2 else [4, 8, 16, 32])
    k = rng.choice([1, 3, 5])
    s = rng.choice([1, 2])
    sp = rng.choice([4, 8, 16, 32, 64, 128] if d == 2 else [4, 8, 16, 32])
    if sp < k:
        return None
    spec = {"op": "conv", "x": [n, c] + [sp] * d, "w": [f, c] + [k] * d,
            "stride": [s] * d, "padding": [k // 2] * d, "dilation": [1] * d, "groups": 1}
    flops, _ = spec_features(spec)[1:]
    return spec if min_flops <= flops <= max_flops else None


def sweep_configs(op_class: str, n_configs: int, max_flops: float, max_numel: int,
                  seed: int = 0, conv_min_flops: float = 0.0) -> list[dict]:
    """``n_configs`` random, distinct sizes for ``op_class`` below the FLOP/element caps.

    The conv classes share one sweep (same seed gives the same shapes for fwd and both bwds).
    ``conv_min_flops`` drops tiny convolutions (microseconds of fixed overhead whose odd
    efficiencies would dominate a relative-error fit meant for real layers).
    """
    if op_class not in OP_CLASSES:
        raise ValueError(f"unknown op class {op_class!r}")
    base = op_class if not op_class.startswith("conv") else "conv"
    rng = random.Random(f"{base}:{seed}")
    pow2 = lambda lo, hi: 2 ** rng.randint(lo, hi)  # noqa: E731
    out, seen = [], set()
    for _ in range(200 * n_configs):
        if len(out) >= n_configs:
            break
        cfg = None
        if base == "conv":
            cfg = _conv_config(rng, max_flops, conv_min_flops)
        elif base == "matmul" and len(out) % 3 == 2:
            # one size in three: NNConv's per-edge products, PCQM4M-like (E 100..100k edges,
            # 16..100 features in and out): memory-bound, unlike the square GEMMs
            fi, fo = rng.randint(16, 100), rng.randint(16, 100)
            e_hi = min(1e5, 4 * max_numel / (fi * fo))     # W[E,Fi,Fo] is the big operand
            e = round(10 ** rng.uniform(2, math.log10(max(e_hi, 101))))
            if edge_matmul_features(e, fi, fo)[0] <= max_flops and e * fi * fo <= 4 * max_numel:
                cfg = {"kind": "edge_bmm", "e": e, "fin": fi, "fout": fo}
        elif base == "matmul":
            m, k, o = pow2(3, 11), pow2(3, 11), pow2(3, 11)
            if matmul_features(m, k, o)[0] <= max_flops and m * k + k * o + m * o <= max_numel:
                cfg = {"m": m, "k": k, "o": o}
        elif base == "gather_scatter" and len(out) % 2 == 1:
            # every other size: message passing on PCQM4M-like graphs (E 100..100k edges moved,
            # 16..128 features, about half as many nodes as edges), in all four forms
            width = rng.randint(16, 128)
            m_hi = min(1e5, max_numel / (4 * width))
            m = round(10 ** rng.uniform(2, math.log10(max(m_hi, 101))))
            rows = max(2, round(m * rng.uniform(0.35, 0.6)))
            kind = sorted(GATHER_SCATTER_FORMS)[(len(out) // 2) % len(GATHER_SCATTER_FORMS)]
            if (rows + 3 * m) * width <= max_numel:
                cfg = {"kind": kind, "rows": rows, "width": width, "m": m}
        elif base == "elementwise":
            # log-uniform from 16K elements (below that it is all t0) to the cap; not only
            # powers of two, so that the sweep has as many distinct sizes as asked for
            numel = min(1024 * round(2 ** rng.uniform(4, 15)), max_numel)
            cfg = {"kind": rng.choice(["relu", "add"]), "numel": numel}
        elif base == "norm":
            n, c, h = pow2(0, 4), pow2(1, 7), pow2(2, 7)
            if n * c * h * h <= max_numel:
                cfg = {"shape": [n, c, h, h]}
        elif base == "pool":
            d = 2 if rng.random() < 0.75 else 3
            n, c, h, k = pow2(0, 4), pow2(0, 6), pow2(3, 7 if d == 2 else 5), rng.choice([2, 3])
            if n * c * h ** d <= max_numel:
                cfg = {"x": [n, c] + [h] * d, "k": k, "stride": rng.choice([1, k])}
        elif base == "gather_scatter":
            rows, width, m = pow2(6, 16), pow2(3, 9), pow2(4, 16)
            if (rows + m) * width <= max_numel:
                cfg = {"kind": rng.choice(["index_select", "index_add"]), "rows": rows,
                       "width": width, "m": m}
        elif base == "attention":
            b, h, lq, d = pow2(0, 2), pow2(0, 3), pow2(4, 10), rng.choice([16, 32, 64, 128])
            if attention_features(b, h, lq, lq, d)[0] <= max_flops and b * h * lq * lq <= max_numel:
                cfg = {"b": b, "h": h, "lq": lq, "lk": lq, "d": d}
        if cfg is not None:
            key = repr(sorted(cfg.items()))
            if key not in seen:
                seen.add(key)
                out.append(cfg)
    return out


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def time_fn(fn: Callable[[], object], device: str = "cpu", repeats: int = 10, warmup: int = 2,
            min_sample_s: float = 2e-4, budget_s: float | None = None) -> list[float]:
    """Per-call times (s) of ``fn``: ``warmup`` untimed calls, then ``repeats`` samples.

    Each sample runs ``fn`` ``inner`` times back to back and divides, with ``inner`` chosen so a
    sample lasts at least ``min_sample_s`` (timer resolution and jitter). With ``budget_s``, a
    slow kernel gets fewer samples (at least 3) so that it takes about that long in all. CPU
    uses ``time.perf_counter``; CUDA uses ``torch.cuda.Event`` pairs around the calls.
    """
    if device == "cuda":
        import torch

        def run(inner: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
    else:
        def run(inner: int) -> float:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - t0) / inner

    for _ in range(max(warmup, 1)):
        first = run(1)
    inner = max(1, min(10000, math.ceil(min_sample_s / max(first, 1e-9))))
    if budget_s is not None:
        repeats = max(3, min(repeats, int(budget_s / max(first * inner, 1e-9))))
    return [run(inner) for _ in range(repeats)]


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _conv_fns(spec: dict, device: str):
    """Zero-arg callables for fwd, bwd_data and bwd_filter of a conv or linear spec."""
    import torch
    import torch.nn.functional as F

    s = normalize_spec(spec)
    dt = _dtype(s["dtype"])
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(s["x"], generator=g, dtype=torch.float32).to(device=device, dtype=dt)
    w = torch.randn(s["w"], generator=g, dtype=torch.float32).to(device=device, dtype=dt)
    if s["op"] == "linear":
        x2 = x.reshape(-1, s["x"][-1])
        dy = torch.randn(x2.shape[0], s["w"][0], generator=g).to(device=device, dtype=dt)
        ring_l: collections.deque = collections.deque(maxlen=8)
        return {"fwd": lambda: ring_l.append(F.linear(x2, w)),
                "bwd_data": lambda: ring_l.append(dy @ w),
                "bwd_filter": lambda: ring_l.append(dy.t() @ x2)}
    d = len(s["x"]) - 2
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[d]
    gin = {1: torch.nn.grad.conv1d_input, 2: torch.nn.grad.conv2d_input,
           3: torch.nn.grad.conv3d_input}[d]
    gw = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight,
          3: torch.nn.grad.conv3d_weight}[d]
    kw = dict(stride=s["stride"], padding=s["padding"], dilation=s["dilation"], groups=s["groups"])
    y = conv(x, w, **kw)
    dy = torch.randn(y.shape, generator=g).to(device=device, dtype=dt)
    # Results are kept alive in a short ring, as a training step keeps its activations: each
    # call then writes fresh memory (allocation, page and cache misses) instead of recycling
    # the buffer it freed a moment ago, which made forward look ~1.5x faster than in a step.
    ring: collections.deque = collections.deque(maxlen=8)
    return {"fwd": lambda: ring.append(conv(x, w, **kw)),
            "bwd_data": lambda: ring.append(gin(x.shape, w, dy, **kw)),
            "bwd_filter": lambda: ring.append(gw(x, w.shape, dy, **kw))}


def _runner(op_class: str, cfg: dict, device: str) -> tuple[Callable[[], object], float, float]:
    """(callable, flops, bytes) for one sweep config of ``op_class``."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    if op_class.startswith("conv"):
        phase = {"conv_fwd": "fwd", "conv_bwd_data": "bwd_data",
                 "conv_bwd_filter": "bwd_filter"}[op_class]
        _, flops, nbytes = spec_features(cfg)
        return _conv_fns(cfg, device)[phase], flops, nbytes
    if op_class == "matmul" and cfg.get("kind") == "edge_bmm":
        e, fi, fo = cfg["e"], cfg["fin"], cfg["fout"]
        xe, we = rand(e, 1, fi), rand(e, fi, fo)
        return (lambda: torch.bmm(xe, we)), *edge_matmul_features(e, fi, fo)
    if op_class == "matmul":
        m, k, o = cfg["m"], cfg["k"], cfg["o"]
        x, w = rand(m, k), rand(o, k)
        return (lambda: F.linear(x, w)), *matmul_features(m, k, o)
    if op_class == "elementwise":
        a, b = rand(cfg["numel"]), rand(cfg["numel"])
        nxt = _written_ring(cfg["numel"], device)
        if cfg["kind"] == "relu":      # torch.relu is clamp_min(x, 0) on CPU, as its profile shows
            return (lambda: torch.clamp_min(a, 0.0, out=nxt())), *elementwise_features(cfg["numel"], 2)
        return (lambda: torch.add(a, b, out=nxt())), *elementwise_features(cfg["numel"], 3)
    if op_class == "norm":
        shape = cfg["shape"]
        x = rand(*shape)
        c = shape[1]
        rm, rv = torch.zeros(c, device=device), torch.ones(c, device=device)
        wt, bs = torch.ones(c, device=device), torch.zeros(c, device=device)
        return (lambda: F.batch_norm(x, rm, rv, wt, bs, training=True)), *norm_features(shape)
    if op_class == "pool":
        x = rand(*cfg["x"])
        d = len(cfg["x"]) - 2
        pool = F.max_pool2d if d == 2 else F.max_pool3d
        k, s = cfg["k"], cfg["stride"]
        y_shape = list(pool(x, k, s).shape)
        return (lambda: pool(x, k, s)), *pool_features(cfg["x"], y_shape, [k] * d)
    if op_class == "gather_scatter":
        src = rand(cfg["rows"], cfg["width"])
        idx = torch.randint(0, cfg["rows"], (cfg["m"],), generator=g).to(device)
        feats = gather_scatter_features(cfg["m"], cfg["width"], GATHER_SCATTER_FORMS[cfg["kind"]])
        if cfg["kind"] == "index_select":
            return (lambda: src.index_select(0, idx)), *feats
        vals = rand(cfg["m"], cfg["width"])
        if cfg["kind"] == "index_add":
            return (lambda: src.index_add_(0, idx, vals)), *feats
        full = idx.unsqueeze(1).expand(cfg["m"], cfg["width"]).contiguous()
        if cfg["kind"] == "gather":
            return (lambda: torch.gather(src, 0, full)), *feats
        return (lambda: src.scatter_add_(0, full, vals)), *feats
    if op_class == "attention":
        b, h, lq, lk, d = cfg["b"], cfg["h"], cfg["lq"], cfg["lk"], cfg["d"]
        q, k_, v = rand(b, h, lq, d), rand(b, h, lk, d), rand(b, h, lk, d)
        return (lambda: F.scaled_dot_product_attention(q, k_, v)), *attention_features(b, h, lq, lk, d)
    raise ValueError(f"unknown op class {op_class!r}")


def _written_ring(numel: int, device: str) -> Callable[[], object]:
    """The elementwise sweep's results: ``KEPT_RESULTS`` buffers of ``numel`` floats, written
    once here and then in turn by the timed calls (each call writes memory other than the one
    it wrote last, as a step's activations are, but memory already mapped).

    Allocating each result instead left the time to glibc's state at that moment of the
    sweep: a relu or add of 0.2-2.7 M elements took 0.2-0.5 ns per element, or 2-3 ns with a
    page fault per 4 KiB page of the result (counted with ``getrusage``), by the process's
    allocation history and not by the size, and a quick profile's elementwise fit had a
    held-out error of 145 %. Inside a CNN's training step these kernels run at the faultless
    speed (torch's profiler, held-out bottleneck ResNet, batch 16: add 0.33 ns and threshold
    backward 0.52 ns per element on [16, 40, 36, 36])."""
    import itertools

    import torch
    bufs = [torch.zeros(numel, device=device) for _ in range(KEPT_RESULTS)]
    return itertools.cycle(bufs).__next__


#: results of a timed kernel kept alive (``_kept``; ``_conv_fns`` keeps its own ring alike)
KEPT_RESULTS = 8


def _kept(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` with its last ``KEPT_RESULTS`` results kept alive, as a training step keeps its
    activations: each call then writes fresh memory (allocation and, under glibc's defaults
    that the runtime keeps, a page fault per 4 KiB page of a large result) instead of
    recycling the block it freed a moment ago. Without it the matmul sweep timed NNConv's
    edge-weight layer (a [472, 3200] result) at 1.3 ms where a step (and the exact-shape
    measurement) takes 3.4 ms, and every held-out GNN and Transformer plan was under-predicted."""
    ring: collections.deque = collections.deque(maxlen=KEPT_RESULTS)
    return lambda: ring.append(fn())


def _round(t: float) -> float:
    return float(f"{t:.6g}")


#: classes timed in the steady state of their ring of kept results (``benchmark_op_class``
#: warms up until the ring is full): batch norm timed on the first calls of a fresh process,
#: each writing memory never touched before, took 2.3x (forward) and 2.9x (backward) what it
#: takes inside a CNN's training step (torch's profiler, held-out bottleneck ResNet, batch 16:
#: 1.57 ms forward for [16, 40, 36, 36]; 3.75 ms cold, 1.64 ms steady); pooling reads the
#: same either way; elementwise kernels write a ring of buffers made up front
#: (``_written_ring``). The matmul sweep stays cold: NNConv's per-edge products in a GNN step
#: run as slowly as its first calls (``_kept``).
STEADY_STATE_CLASSES = ("norm",)


def benchmark_op_class(op_class: str, configs: Iterable[dict], device: str = "cpu",
                       repeats: int = 10, warmup: int = 2, min_sample_s: float = 2e-4,
                       budget_s: float | None = None, track=None) -> list[dict]:
    """One sample per config: ``{"config", "flops", "bytes", "median_s", "times_s"}``, as
    measured; with a ``speed.SpeedTrack``, also the machine's probe time around each
    (``"probe_s"``, for ``speed.normalize_rows``)."""
    import torch

    if op_class in STEADY_STATE_CLASSES:
        warmup = max(warmup, KEPT_RESULTS + 1)
    out = []
    with torch.no_grad():
        for i, cfg in enumerate(configs):
            if track is not None:
                track.mark(i)
            fn, flops, nbytes = _runner(op_class, cfg, device)
            fn = _kept(fn)
            times = time_fn(fn, device, repeats, warmup, min_sample_s, budget_s)
            row = {"config": cfg, "flops": flops, "bytes": nbytes,
                   "median_s": _round(statistics.median(times)),
                   "times_s": [_round(t) for t in times]}
            bwd = _backward_runner(op_class, cfg, device)
            if bwd is not None:
                bwd = _kept(bwd)
                row["bwd_median_s"] = _round(statistics.median(
                    time_fn(bwd, device, repeats, warmup, min_sample_s, budget_s)))
            out.append(row)
    if track is not None:
        track.close()
        probes = track.probes()
        for i, row in enumerate(out):
            row["probe_s"] = _round(probes[i])
    return out


#: kernel classes whose sweep also times the backward (``_backward_runner``): the cost model
#: prices their backward with the fitted ``bwd_model`` instead of twice the forward
BACKWARD_CLASSES = ("matmul", "norm", "pool")


def _backward_runner(op_class: str, cfg: dict, device: str) -> Callable[[], object] | None:
    """The backward of a sweep config as autograd runs it (``BACKWARD_CLASSES``), or None.

    matmul: ``y = x w^T`` backward is ``dx = dy w`` and ``dw = dy^T x`` (``mm`` on a transposed
    view, as ``LinearBackward`` / ``MmBackward`` run it); the per-edge product ``y = x @ W``
    (``edge_bmm``) is ``dx = dy @ W^T`` and ``dW = x^T @ dy``: an outer product per edge
    (inner extent 1), which on the 2-core CPU takes several times the forward.

    norm: batch norm in training, ``native_batch_norm_backward`` with the saved statistics
    (input, weight and bias gradients). pool: max pooling, ``max_poolNd_with_indices_backward``
    (zeros the input's gradient and scatters the output's into it: on the 2-core CPU a tenth of
    the forward, not twice it)."""
    if op_class not in BACKWARD_CLASSES:
        return None
    import torch

    def rand(*shape):
        return torch.randn(*shape, device=device)
    aten = torch.ops.aten
    if op_class == "norm":
        x = rand(*cfg["shape"])
        c = cfg["shape"][1]
        rm, rv = torch.zeros(c, device=device), torch.ones(c, device=device)
        wt, bs = torch.ones(c, device=device), torch.zeros(c, device=device)
        y, mean, invstd = aten.native_batch_norm(x, wt, bs, rm, rv, True, 0.1, 1e-5)
        g = rand(*y.shape)
        return lambda: aten.native_batch_norm_backward(g, x, wt, rm, rv, mean, invstd, True, 1e-5,
                                                       [True, True, True])
    if op_class == "pool":
        x = rand(*cfg["x"])
        d = len(cfg["x"]) - 2
        k, s = [cfg["k"]] * d, [cfg["stride"]] * d
        fwd = aten.max_pool2d_with_indices if d == 2 else aten.max_pool3d_with_indices
        bwd = (aten.max_pool2d_with_indices_backward if d == 2
               else aten.max_pool3d_with_indices_backward)
        y, idx = fwd(x, k, s)
        g = rand(*y.shape)
        return lambda: bwd(g, x, k, s, [0] * d, [1] * d, False, idx)
    if cfg.get("kind") == "edge_bmm":
        e, fi, fo = cfg["e"], cfg["fin"], cfg["fout"]
        xe, we, g = rand(e, 1, fi), rand(e, fi, fo), rand(e, 1, fo)
        return lambda: (torch.bmm(g, we.transpose(1, 2)), torch.bmm(xe.transpose(1, 2), g))
    m, k, o = cfg["m"], cfg["k"], cfg["o"]
    x, w, g = rand(m, k), rand(o, k), rand(m, o)
    return lambda: (g.mm(w), g.t().mm(x))


def measure_exact(shape_specs: Iterable[dict], device: str = "cpu", repeats: int = 10,
                  warmup: int = 2, return_samples: bool = False, track=None):
    """Median time of fwd, bwd_data and bwd_filter of each exact shape, keyed by ``shape_key``.

    Returns ``{shape_key: {"fwd": s, "bwd_data": s, "bwd_filter": s}}``; with
    ``return_samples=True`` also ``{shape_key: {phase: [all repeats]}}``. With a
    ``speed.SpeedTrack`` the samples of each key also hold the machine's probe time around its
    measurement (``"probe_s"``; the medians stay as measured: ``speed.normalize_exact``).
    """
    import torch

    result, samples = {}, {}
    with torch.no_grad():
        for spec in shape_specs:
            key = shape_key(spec)
            if key in result:
                continue
            if track is not None:
                track.mark(key)
            fns = _conv_fns(spec, device)
            result[key], samples[key] = {}, {}
            for phase, fn in fns.items():
                times = time_fn(fn, device, repeats, warmup)
                result[key][phase] = _round(statistics.median(times))
                samples[key][phase] = [_round(t) for t in times]
    if track is not None:
        track.close()
        for key, probe_s in track.probes().items():
            samples[key]["probe_s"] = _round(probe_s)
    return (result, samples) if return_samples else result


def slowdown_kernel_set(device: str = "cpu") -> Callable[[], None]:
    """A fixed mix (conv fwd + bwd_filter, matmul, relu, batch-norm), ~5 ms on one core here."""
    import torch
    import torch.nn.functional as F

    fwd = _conv_fns({"op": "conv", "x": [4, 32, 32, 32], "w": [32, 32, 3, 3], "padding": 1}, device)
    g = torch.Generator(device="cpu").manual_seed(2)
    a = torch.randn(384, 384, generator=g).to(device)
    e = torch.randn(1 << 20, generator=g).to(device)
    bn = torch.randn(8, 32, 32, 32, generator=g).to(device)
    ones, zeros = torch.ones(32, device=device), torch.zeros(32, device=device)

    def run() -> None:
        with torch.no_grad():
            fwd["fwd"]()
            fwd["bwd_filter"]()
            a @ a
            torch.relu(e)
            F.batch_norm(bn, zeros, ones, ones, zeros, training=True)
    return run
