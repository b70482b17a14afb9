"""The kernel models' features: FLOPs and bytes of each op class, the shape-aware convolution
model's terms and its evaluation (``conv_model_time_s``). Pure Python, no torch; measured by
``calibrate.kernels`` (the sweeps and timing), fitted by ``profile.fit``, read by ``cost``.

FLOP and byte conventions (the cost model must count the same way; the helpers ``*_features``
here are the reference, all pure Python). Tensors are float32 (4 bytes per element) unless a
spec says otherwise; "bytes" is the sum of the sizes of the operands read and the result
written, not the hardware's real traffic (the fitted constants absorb the difference).

=================  ======================================  =====================================
op class           flops                                   bytes
=================  ======================================  =====================================
conv_fwd           2 * N * F * prod(out) * C/g * prod(k)   4 * (|x| + |w| + |y|)
conv_bwd_data      same as conv_fwd                         4 * (|dy| + |w| + |dx|)  (= fwd)
conv_bwd_filter    same as conv_fwd                         4 * (|x| + |dy| + |dw|)  (= fwd)
matmul             2 * M * K * O  (y[M,O] = x[M,K] w^T)     4 * (M*K + O*K + M*O)
  edge_bmm form    2 * E * Fi * Fo (y[E,1,Fo] = x[E,1,Fi]   4 * (E*Fi + E*Fi*Fo + E*Fo)
                   @ W[E,Fi,Fo], NNConv's messages)         (ops/linear.py's Matmul count)
elementwise        numel (relu: y = max(x,0); add: a+b)     4 * numel * (2 relu | 3 add)
norm               8 * numel (batch-norm fwd, training)     4 * (2 * numel + 4 * C)
pool               |y| * prod(k)  (max pool)                4 * (|x| + |y|)
gather_scatter     M * D  (rows moved x row width)          4 * 2 * M * D + 8 * |index|
                                                           (|index| = M for index_select /
                                                           index_add, M * D for gather /
                                                           scatter_add, as ops/gather.py and
                                                           ops/scatter.py count)
attention          4 * B * H * Lq * Lk * D  (QK^T, AV)      4 * B * H * (2*Lq*D + 2*Lk*D)
=================  ======================================  =====================================

(N batch, C input channels, F filters, g groups, k kernel extents, out output spatial extents,
|t| number of elements of tensor t). A linear layer's backward is two matmuls with the
forward's FLOPs; the cost model prices them with the "matmul" class.

Shape legend: x_NC* input (N, C, *spatial), w_FCk* filter (F, C/g, *k), y output.
"""

from __future__ import annotations

import math

from .keys import normalize_spec

F32 = 4
_INT64 = 8


def conv_out_shape(x, w, stride, padding, dilation) -> list[int]:
    d = len(x) - 2
    if isinstance(padding, str):
        if padding == "same":
            return [x[0], w[0], *x[2:]]
        padding = [0] * d
    return [x[0], w[0]] + [
        (x[2 + i] + 2 * padding[i] - dilation[i] * (w[2 + i] - 1) - 1) // stride[i] + 1
        for i in range(d)]


def conv_features(x, w, stride, padding, dilation, groups=1) -> tuple[float, float]:
    """(flops, bytes) of a convolution; the same for fwd, bwd_data and bwd_filter."""
    y = conv_out_shape(x, w, stride, padding, dilation)
    flops = 2.0 * y[0] * w[0] * math.prod(y[2:]) * w[1] * math.prod(w[2:])
    return flops, float(F32 * (math.prod(x) + math.prod(w) + math.prod(y)))


def matmul_features(m: int, k: int, o: int) -> tuple[float, float]:
    return 2.0 * m * k * o, float(F32 * (m * k + o * k + m * o))


def elementwise_features(numel: int, n_operands: int) -> tuple[float, float]:
    """n_operands: 2 for a unary op (read x, write y), 3 for a binary one."""
    return float(numel), float(F32 * numel * n_operands)


def norm_features(shape) -> tuple[float, float]:
    numel = math.prod(shape)
    return 8.0 * numel, float(F32 * (2 * numel + 4 * shape[1]))


def pool_features(x, y, k) -> tuple[float, float]:
    return float(math.prod(y) * math.prod(k)), float(F32 * (math.prod(x) + math.prod(y)))


def gather_scatter_features(m: int, d: int, full_index: bool = False) -> tuple[float, float]:
    """``full_index``: an index of the moved block's shape (gather, scatter_add) instead of
    one per row (index_select, index_add)."""
    return float(m * d), float(F32 * 2 * m * d + _INT64 * (m * d if full_index else m))


def edge_matmul_features(e: int, fin: int, fout: int) -> tuple[float, float]:
    """A batched vector-matrix product per edge (NNConv's messages ``x_j W(e_ji)``)."""
    return 2.0 * e * fin * fout, float(F32 * (e * fin + e * fin * fout + e * fout))


#: the forms of the gather_scatter class and whether each has a full index
GATHER_SCATTER_FORMS = {"index_select": False, "index_add": False, "gather": True, "scatter_add": True}


def attention_features(b: int, h: int, lq: int, lk: int, d: int) -> tuple[float, float]:
    return 4.0 * b * h * lq * lk * d, float(F32 * b * h * (2 * lq * d + 2 * lk * d))


def spec_features(spec: dict) -> tuple[str, float, float]:
    """(op class of the forward, flops, bytes) of a shape spec, by the conventions above."""
    s = normalize_spec(spec)
    if s["op"] == "conv":
        f, b = conv_features(s["x"], s["w"], s["stride"], s["padding"], s["dilation"], s["groups"])
        return "conv_fwd", f, b
    m = math.prod(s["x"][:-1])
    f, b = matmul_features(m, s["x"][-1], s["w"][0])
    return "matmul", f, b


#: the shape-aware convolution model (``conv_shape_features``; ``conv_shape/2`` adds a sub-model
#: of torch's native CPU path, ``conv_native_features``; ``conv_shape/3`` adds the terms of
#: ``conv_layout_features``), stored per conv class as ``kernels[cls]["shape_model"]`` and used
#: by ``Profile.kernel_time_s`` (``conv_model_time_s``) when an op's spec is known; profiles of
#: the earlier forms keep loading and pricing as before.
CONV_SHAPE_FORM = "conv_shape/3"
CONV_SHAPE_FORMS = ("conv_shape/1", "conv_shape/2", CONV_SHAPE_FORM)

#: float32 channels per 512-bit vector: oneDNN blocks channels by it (by 8 on AVX2), so a layer
#: whose channel counts are not multiples of it runs a slower kernel (``conv_layout_features``)
CONV_CHANNEL_BLOCK = 16
#: a convolution whose input or output is larger than this (bytes) no longer fits the caches
#: of one core and writes memory the step has just been given (``conv_layout_features``)
CONV_LARGE_TENSOR_BYTES = 2 << 20

#: torch's CPU convolution leaves oneDNN (mkldnn) for its own im2col + GEMM kernels
#: (``slow_conv2d`` / ``slow_conv3d``) below this many elements in ``N * C * D1 * D2`` of a
#: single-sample input (``conv_cpu_path``)
MKLDNN_MIN_SINGLE_SAMPLE_NUMEL = 20480


def conv_cpu_path(spec: dict, num_threads: int = 1) -> str:
    """Which kernel family torch runs a float32 CPU convolution of ``spec`` with: "mkldnn"
    (oneDNN) or "native" (im2col + GEMM: ``thnn_conv2d`` / ``slow_conv3d``). The rule of
    ``ConvParams::use_mkldnn`` (aten/src/ATen/native/Convolution.cpp, torch 2.x)::

        mkldnn  iff  (strided or dilated or N >= 16 or kernel not 1x1 in its last two dims
                      or num_threads > 1)
                 and (groups > 1 or both last kernel dims > 3 or N > 1
                      or N * C * D1 * D2 > 20480)

    Both conditions matter to data parallelism: a 3x3 layer run on one sample per rank
    (a batch of 4 over 4 ranks) takes the native path, whose time per sample is several times
    oneDNN's, and 1x1 convolutions below 16 samples run natively on one thread (the runtime's
    setting). The calibration sweep holds both paths; ``conv_shape/2`` fits them apart."""
    s = normalize_spec(spec)
    x, w = s["x"], s["w"]
    x4 = (list(x) + [1, 1])[:4]
    strided = any(v != 1 for v in s["stride"])
    dilated = any(v != 1 for v in s["dilation"])
    one_by_one = w[-1] == 1 and (len(w) < 4 or w[-2] == 1)
    first = strided or dilated or x[0] >= 16 or not one_by_one or num_threads > 1
    second = (s["groups"] > 1 or (w[-1] > 3 and len(w) >= 4 and w[-2] > 3) or x[0] > 1
              or math.prod(x4) > MKLDNN_MIN_SINGLE_SAMPLE_NUMEL)
    return "mkldnn" if first and second else "native"


def conv_shape_features(spec: dict) -> list[float]:
    """Features of the shape-aware convolution model, each a non-negative term of
    ``t = sum_i c_i * feature_i`` (``c >= 0``, fitted by ``fit.fit_conv_shape``)::

        1, flops, bytes                 the roofline of the flat model (t0, 1/peak, 1/bandwidth)
        flops / C_in_per_group          efficiency lost to short reductions (few input channels)
        flops / F                       ... to few filters (narrow output tiles)
        flops / (N * prod(out))         ... to small images (few output pixels to vectorise over)
        flops * [prod(k) == 1]          1x1 convolutions run as a matrix product (another kernel)
        N * F * prod(out)               per output element (writes, epilogue)
        N * C * prod(in)                per input element (layout transforms, padding copies)

    Measured on the CPU profile's own samples (2 cores, CNN-like shapes held out): median error
    11 / 20 / 12 % (fwd / bwd-data / bwd-filter) against 13 / 34 / 17 % for the flat roofline."""
    return _shape_terms(normalize_spec(spec))


def _shape_terms(s: dict) -> list[float]:
    """``conv_shape_features`` of a normalised spec."""
    x, w = s["x"], s["w"]
    fl, by = conv_features(x, w, s["stride"], s["padding"], s["dilation"], s["groups"])
    n, f, c_g = x[0], w[0], w[1]
    k = math.prod(w[2:])
    out_pix = fl / (2.0 * n * f * c_g * k) if n * f * c_g * k else 0.0   # prod(out spatial)
    return [1.0, fl, by, fl / max(c_g, 1), fl / max(f, 1), fl / max(n * out_pix, 1.0),
            fl if k == 1 else 0.0, n * f * out_pix, float(math.prod(x))]


def conv_layout_features(spec: dict) -> list[float]:
    """The terms ``conv_shape/3`` adds to ``conv_shape_features`` (each >= 0, its constant
    fitted >= 0, so the fit decides whether it matters on a machine)::

        flops * [C/g % CONV_CHANNEL_BLOCK != 0]   input channels oneDNN cannot block evenly
        flops * [F % CONV_CHANNEL_BLOCK != 0]     ... output channels
        flops * [any stride > 1]                  strided: backward-data scatters (a strided
                                                  layer's bwd_data ran 2-3x its forward here)
        N * F * prod(out) * [|y| > CONV_LARGE_TENSOR_BYTES]   per output element of a large output
        N * C * prod(in) * [|x| > CONV_LARGE_TENSOR_BYTES]    per input element of a large input

    Judged on the exact shapes of the shipped CNN examples (resnet2d, wide_resnet, cnn3d_large,
    ResNet-50; never part of the sweep's fit) against ``conv_shape/2`` on the same sweep: the
    per-shape median error of bwd_data 24 % -> 20 % (its bias -16 % -> -4 %), fwd 13 -> 11 %."""
    s = normalize_spec(spec)
    return _layout_terms(s, _shape_terms(s))


def _layout_terms(s: dict, base: list[float]) -> list[float]:
    """``conv_layout_features`` of a normalised spec from its ``_shape_terms`` (FLOPs, output
    and input elements are among them)."""
    w = s["w"]
    fl, out_el, in_el = base[1], base[7], base[8]
    return [fl if w[1] % CONV_CHANNEL_BLOCK else 0.0, fl if w[0] % CONV_CHANNEL_BLOCK else 0.0,
            fl if any(v != 1 for v in s["stride"]) else 0.0,
            out_el if F32 * out_el > CONV_LARGE_TENSOR_BYTES else 0.0,
            in_el if F32 * in_el > CONV_LARGE_TENSOR_BYTES else 0.0]


def conv_model_features(spec: dict, form: str = CONV_SHAPE_FORM) -> list[float]:
    """The features of the oneDNN-path model of a shape-aware ``form``: ``conv_shape_features``
    (``conv_shape/1``, ``/2``), and ``conv_layout_features`` after them (``/3``); the spec is
    normalised and counted once (pricing calls this for every convolution it meets)."""
    s = normalize_spec(spec)
    base = _shape_terms(s)
    return base + _layout_terms(s, base) if form == CONV_SHAPE_FORM else base


def conv_native_features(spec: dict) -> list[float]:
    """Features of the native-path sub-model of ``conv_shape/2`` (``conv_cpu_path``: torch's
    im2col + GEMM kernels, fitted on the native rows alone; their time per FLOP is set by the
    im2col / col2im copies, which oneDNN does not make: measured on the 2-core CPU, a 3x3x3
    layer on one sample is 3-40x what the oneDNN rows' model says)::

        1, flops                          the GEMM (t0, 1/rate)
        N * C/g * prod(k) * prod(out)     elements of the im2col matrix (0 for 1x1 kernels)
        N * C * prod(in), N * F * prod(out)   input and output elements"""
    s = normalize_spec(spec)
    x, w = s["x"], s["w"]
    fl, _ = conv_features(x, w, s["stride"], s["padding"], s["dilation"], s["groups"])
    n, f, c_g = x[0], w[0], w[1]
    k = math.prod(w[2:])
    out_pix = fl / (2.0 * n * f * c_g * k) if n * f * c_g * k else 0.0
    return [1.0, fl, float(n * c_g * k * out_pix) if k > 1 else 0.0, float(math.prod(x)), n * f * out_pix]


def conv_model_time_s(model: dict, spec: dict) -> float | None:
    """Seconds the shape-aware model ``model`` (a ``kernels[cls]["shape_model"]``) prices a
    convolution of ``spec`` at; None for a form this autopar does not know. ``conv_shape/2``
    prices a convolution on torch's native CPU path (``conv_cpu_path``) with its ``native``
    sub-model when it has one; ``conv_shape/1`` (older profiles) and the rest with ``coef``
    over ``conv_shape_features``."""
    form = model.get("form")
    if form not in CONV_SHAPE_FORMS:
        return None
    nat = model.get("native") if form != "conv_shape/1" else None
    if nat and conv_cpu_path(spec) == "native":
        return float(sum(c * f for c, f in zip(nat["coef"], conv_native_features(spec))))
    return float(sum(c * f for c, f in zip(model["coef"], conv_model_features(spec, form))))
