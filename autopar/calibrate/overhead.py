"""The runtime's own cost per op: what kernel benchmarks do not see.

Every op of a generated module goes through ``DistModel.op`` -> ``Decomposition.run`` ->
``call_local`` in forward, and through the autograd engine in backward. On a CPU with small
layers that Python and engine work is a visible share of a step (a hand-written GPT at world 1:
1.1 ms predicted without it, 2.4 ms measured). It is measured here, once per calibration, per
op family (``measure_runtime_overhead_by_family``): a chain of ``N_OPS`` ops of one family
(tiny shapes, traced like a user's model, all replicated at world size 1) runs forward and
backward through a real ``DistModel``; what the fitted kernel model of the profile predicts for
the same ops is subtracted, and the rest divided by the number of ops::

    overhead(family) = (t_chain(fwd + bwd) - sum_ops kernel_model(op)) / N_OPS

The probes (``PROBES``): unary (ReLU), binary (add, two operands that need gradients), view
(view / transpose, priced free by the kernel model but dispatched like any op, with a backward
node), linear, layer norm, batch norm (local statistics, as plans run it), attention,
embedding (a sum of lookups: the adds' own overhead is subtracted) and gather (index_select).
The profile stores them in the pseudo op class ``runtime_op``: ``t0_s`` = the unary chain's
seconds per op (what older profiles hold, and what a family without a probe pays) and
``by_family`` = {probe family: seconds per op}; ``cost.primitives.runtime_overhead_s`` reads
them (views pay ``by_family["view"]``; a profile without ``by_family`` prices views free, as
before).

What it does not see: a pure data-parallel plan that runs the user's module natively
(``runtime.native``) pays module calls instead of this per-op dispatch:
``cost.primitives.runtime_overhead_applies`` says when the per-op overhead is charged, and
``plan_runtime_overhead_s`` how much of a plan's prediction it is.
"""

from __future__ import annotations

import statistics
import time
from ..artifacts import plan_from_decisions
from ..cost.primitives import op_compute_s
from ..decomp.ir import GraphInput, Layer, LayerGraphData, OpSpec
from ..modelfile import ModelFile
from ..runtime.comm import Comm
from ..runtime.model import DistModel
from ..runtime.native import _sum_hook
from ..trace.tracer import trace_model

N_OPS = 64
#: ops per probe chain (``PROBES``)
PROBE_OPS = 32


def _plan_for_chain(n_ops: int, shape: list[int]) -> dict:
    layers = []
    prev = "x"
    for i in range(n_ops):
        name = f"relu_{i}"
        op = OpSpec(name=name, kind="unary", target="aten.relu.default", args=[{"v": prev}], kwargs={},
                    out_shape=shape, dtype="float32", inputs=[prev], in_shapes=[shape], params={},
                    param_names={})
        layers.append(Layer(index=i, name=name, ops=[op], inputs=[prev], output=name))
        prev = name
    graph = LayerGraphData(layers=layers, inputs=[GraphInput("x", shape, "float32")], output=prev, batch_size=shape[0])
    return {"world_size": 1, "graph": graph.to_json(),
            "layers": [{"layer": i, "decomposition": {"kind": "replicate"}} for i in range(n_ops)]}


def _median_s(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure_runtime_overhead_s(repeats: int = 30, profile=None) -> float:
    """Seconds of runtime work per op (forward + backward) beyond what is priced elsewhere:
    beyond the fitted elementwise kernel model of ``profile`` when given (autograd-engine and
    dispatch work that kernel benchmarks miss), else beyond a plain torch chain."""
    import torch

    shape = [2, 8]
    plan = _plan_for_chain(N_OPS, shape)
    dm = DistModel(plan_from_decisions(plan), torch.nn.Module(), Comm(0, 1))
    names = [f"relu_{i}" for i in range(N_OPS)]

    def run_dist():
        x = torch.randn(shape, requires_grad=True)
        v = x
        for n in names:
            v = dm.op(n, v)
        v.sum().backward()

    def run_plain():
        x = torch.randn(shape, requires_grad=True)
        v = x
        for _ in names:
            v = torch.relu(v)
        v.sum().backward()

    per_op = _median_s(run_dist, repeats) / N_OPS
    if profile is not None and "elementwise" in profile.kernels:
        numel = shape[0] * shape[1]
        # what primitives.op_compute_s prices for one unary op: forward t, backward 2t
        t = profile.kernel_time_s("elementwise", float(numel), 2.0 * numel * 4)
        return max(0.0, per_op - 3.0 * t)
    return max(0.0, per_op - _median_s(run_plain, repeats) / N_OPS)


# ---- per-family probes ----------------------------------------------------------------------

def _probe_modules():
    """{family: (build_model, example_inputs(batch), ops of the family in the chain, other
    probed family whose ops the chain also holds and how many)}: tiny chains of ``PROBE_OPS``
    ops, shapes small enough that dispatch dominates."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    k = PROBE_OPS

    class Unary(nn.Module):
        def forward(self, x):
            for _ in range(k):
                x = torch.relu(x)
            return x

    class Binary(nn.Module):           # residual-style adds: both operands need gradients
        def forward(self, x):
            y = x
            for _ in range(k):
                y = y + x
            return y

    class Views(nn.Module):
        def forward(self, x):
            n, a, b = x.shape
            for _ in range(k // 4):
                x = x.view(n, a * b).view(n, a, b).transpose(1, 2).transpose(1, 2)
            return x

    class Linear(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(k))

        def forward(self, x):
            for m in self.layers:
                x = m(x)
            return x

    class LayerNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.LayerNorm(16) for _ in range(k))

        def forward(self, x):
            for m in self.layers:
                x = m(x)
            return x

    class BatchNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.BatchNorm2d(4) for _ in range(k))

        def forward(self, x):
            for m in self.layers:
                x = m(x)
            return x

    class Attention(nn.Module):
        def forward(self, x):
            for _ in range(k):
                x = F.scaled_dot_product_attention(x, x, x)
            return x

    class Embedding(nn.Module):        # k lookups summed by k - 1 adds
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Embedding(32, 16) for _ in range(k))

        def forward(self, idx):
            y = self.layers[0](idx)
            for m in self.layers[1:]:
                y = y + m(idx)
            return y

    class Gather(nn.Module):
        def forward(self, x, idx):
            for _ in range(k):
                x = x.index_select(0, idx)
            return x

    def randn(*shape):
        return lambda b: (torch.randn(*shape),)
    return {
        "unary": (Unary, randn(2, 8, 16), k, None),
        "binary": (Binary, randn(2, 8, 16), k, None),
        "view": (Views, randn(2, 8, 16), k, None),
        "linear": (Linear, randn(2, 8, 16), k, None),
        "layer_norm": (LayerNorm, randn(2, 8, 16), k, None),
        "batch_norm": (BatchNorm, randn(4, 4, 4, 4), k, None),
        "attention": (Attention, randn(2, 2, 8, 8), k, None),
        "embedding": (Embedding, lambda b: (torch.randint(0, 32, (2, 8)),), k, ("binary", k - 1)),
        "gather": (Gather, lambda b: (torch.randn(16, 8), torch.randperm(16)), k, None),
    }


#: the probed families, in measuring order (embedding subtracts binary's overhead)
PROBES = ("unary", "binary", "view", "linear", "layer_norm", "batch_norm", "attention", "embedding", "gather")


def _kernel_model_s(graph, profile) -> float:
    """What the profile's kernel models price for every op of ``graph`` at world size 1,
    forward + backward, without any runtime overhead (``cost.primitives.op_compute_s``)."""
    import copy
    from types import SimpleNamespace

    prof = copy.copy(profile)
    prof.kernels = {c: k for c, k in profile.kernels.items() if c != "runtime_op"}
    ctx = SimpleNamespace(profile=prof, world=1, ranks_on_node=1, prefer_exact=False,
                          spec_log=None, key_log=None)
    total = 0.0
    for lay in graph.layers:
        for op in lay.ops:
            f, b, _ = op_compute_s(op, op.in_shapes, op.out_shape, ctx)
            total += f + b
    return total


def _native_time_s(model, inputs, repeats: int) -> float:
    """Median seconds of one forward + backward of the probe module itself (what a plan that
    runs natively, ``runtime.native``, dispatches per op)."""
    model.train()

    def step():
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        model(*xs).sum().backward()
        for p in model.parameters():
            p.grad = None
    return _median_s(step, repeats)


def _chain_time_s(graph, model, inputs, repeats: int) -> float:
    """Median seconds of one forward + backward of ``graph`` run op by op through a
    ``DistModel`` at world size 1 (every layer replicated, local batch-norm statistics)."""
    import torch
    plan = {"world_size": 1, "graph": graph.to_json(),
            "layers": [{"layer": lay.index, "decomposition": {"kind": "replicate"}} for lay in graph.layers],
            "batch_norm": {"mode": "local", "group": int(graph.batch_size or 1)}}
    dm = DistModel(plan_from_decisions(plan), model, Comm(0, 1))
    dm.train()
    names = [gi.name for gi in graph.inputs]
    ops = [(op.name, tuple(op.inputs)) for lay in graph.layers for op in lay.ops]

    def step():
        env = {}
        for n, x in zip(names, inputs):
            env[n] = x.detach().requires_grad_(x.is_floating_point())
        for name, ins in ops:
            env[name] = dm.op(name, *[env[v] for v in ins])
        env[graph.output].sum().backward()
        dm.flush_batch_norm()
        for p in dm.parameters():
            p.grad = None
    return _median_s(step, repeats)


def measure_runtime_overhead_by_family(profile, repeats: int = 20) -> tuple[dict[str, float], dict[str, float]]:
    """({family: seconds of runtime work per op, forward + backward, beyond ``profile``'s
    kernel model, run op by op through ``DistModel``}, {family: the same for the probe module
    run natively}) for every probe of ``PROBES`` (module docstring). A probe that cannot be
    traced or run (an older torch) is left out: its ops pay ``t0_s``."""
    import types
    import warnings
    from pathlib import Path

    import torch
    probes = _probe_modules()
    out: dict[str, float] = {}
    native: dict[str, float] = {}
    for fam in PROBES:
        build, example, n_ops, other = probes[fam]
        torch.manual_seed(0)
        mf = ModelFile(Path(f"autopar_probe_{fam}.py"),
                       types.SimpleNamespace(build_model=build, example_inputs=example))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                inputs = example(2)
                graph = trace_model(mf, int(inputs[0].shape[0]))
            model = build()
            t = _chain_time_s(graph, model, inputs, repeats)
            t_native = _native_time_s(model, inputs, repeats)
        except Exception:  # noqa: BLE001 - a probe that does not run leaves its family on t0_s
            continue
        kernel_s = _kernel_model_s(graph, profile)
        rest, rest_native = t - kernel_s, t_native - kernel_s
        if other is not None:
            rest -= other[1] * out.get(other[0], 0.0)
            rest_native -= other[1] * native.get(other[0], 0.0)
        out[fam] = max(0.0, rest / n_ops)
        native[fam] = max(0.0, rest_native / n_ops)
    return out, native


def add_runtime_overhead(profile, seconds_per_op: float, by_family: dict[str, float] | None = None,
                         native_by_family: dict[str, float] | None = None) -> None:
    """Store the measurement in the profile as the pseudo op class ``runtime_op``."""
    k = {"t0_s": float(seconds_per_op), "s_per_flop": 0.0, "s_per_byte": 0.0, "measured": True,
         "note": "DistModel dispatch per op, forward + backward (autopar.calibrate.overhead)"}
    if by_family:
        k["by_family"] = {f: float(v) for f, v in sorted(by_family.items())}
    if native_by_family:
        k["native_by_family"] = {f: float(v) for f, v in sorted(native_by_family.items())}
    profile.kernels["runtime_op"] = k


# ---- torch DDP's reducer --------------------------------------------------------------------

#: (parameter tensors, elements per tensor) of the reducer probes (``measure_grad_reducer``):
#: few and many small tensors, and few large ones, so the fit can tell a step's fixed cost, the
#: per-tensor hook and the per-byte bucket copies apart
REDUCER_PROBES = ((4, 64), (16, 64), (64, 64), (16, 65536))
#: interleaved runs of each probe, plain and under DDP
REDUCER_REPEATS = 40


def _reducer_probe(n_tensors: int, numel: int):
    """A chain of ``n_tensors`` bias-free square linear layers of ``numel`` weights each, and
    its input (fixed seed)."""
    import math

    import torch
    width = int(math.isqrt(numel))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(n_tensors)])
    return model, torch.randn(2, width)


def measure_grad_reducer(repeats: int = REDUCER_REPEATS) -> dict | None:
    """What torch DDP's reducer costs a training step beyond its all-reduces, measured in a
    process group of one rank (the calibration's overhead launch): for each probe of
    ``REDUCER_PROBES`` one forward + backward of the module itself and of the same module under
    DDP as ``runtime.native`` builds it (SUM hook, no buffer broadcast), interleaved, the
    difference of the medians; then, by non-negative least squares over the probes::

        reducer(step) = fixed_s + per_tensor_s * parameter tensors + per_byte_s * gradient bytes

    (``fixed_s``: preparing the backward and finalising it, the all-reduce call of a group of
    one; ``per_tensor_s``: the autograd hook per parameter; ``per_byte_s``: copying each gradient
    into its bucket and back). ``cost.table.price_grad_reducer`` charges it to every plan that
    all-reduces gradients (``cost.primitives.grad_reducer_s``). Returns
    ``{"fixed_s", "per_tensor_s", "per_byte_s", "rows": [...]}``; the rows keep the medians.
    None outside a gloo process group (the probes run on the CPU; a GPU profile does not price
    the reducer)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from scipy.optimize import nnls
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return None
    group = dist.group.WORLD
    rows = []
    for n_tensors, numel in REDUCER_PROBES:
        plain, x = _reducer_probe(n_tensors, numel)
        wrapped, _ = _reducer_probe(n_tensors, numel)
        ddp = DDP(wrapped, forward_sync_buffers=False, init_sync=False)
        ddp.register_comm_hook(group, _sum_hook)

        def step(mod, params):
            mod(x).sum().backward()
            for p in params:
                p.grad = None
        runs = {"plain": (plain, list(plain.parameters())), "ddp": (ddp, list(wrapped.parameters()))}
        times: dict[str, list[float]] = {"plain": [], "ddp": []}
        for i in range(repeats + 2):
            for name in (("plain", "ddp") if i % 2 else ("ddp", "plain")):
                mod, params = runs[name]
                t = time.perf_counter()
                step(mod, params)
                if i >= 2:
                    times[name].append(time.perf_counter() - t)
        p_s, d_s = statistics.median(times["plain"]), statistics.median(times["ddp"])
        rows.append({"tensors": n_tensors, "elements": numel, "bytes": n_tensors * numel * 4,
                     "plain_s": p_s, "ddp_s": d_s, "reducer_s": max(0.0, d_s - p_s)})
        del ddp
    A = np.array([[1.0, r["tensors"], r["bytes"]] for r in rows])
    b = np.array([r["reducer_s"] for r in rows])
    scale = A.max(axis=0)
    coef, _ = nnls(A / scale, b)
    coef = coef / scale
    return {"fixed_s": float(coef[0]), "per_tensor_s": float(coef[1]), "per_byte_s": float(coef[2]),
            "rows": rows, "probe": "calibrate.overhead.measure_grad_reducer",
            "note": "torch DDP's reducer beyond its all-reduces, one rank; charged to every plan that "
                    "all-reduces gradients"}
