"""Cost primitives shared by every decomposition: local op compute, memory, collectives.

Compute of one op on a local shape (the slowest rank holds block 0, the largest)::

    t_phase = profile.exact_time_s(shape_key, phase)                       if measured ("exact")
            = profile.kernel_time_s(class(op, phase), flops, bytes)        otherwise ("fit")
    t       = t_phase * profile.slowdown(ranks_on_node)

Stragglers (``StragglerCharge``, world > 1 only): ranks that synchronise wait for the slowest.
On shared cores the wait after t seconds of compute since the last synchronisation is::

    wait(t) = min(kappa * t, sigma * sqrt(t))

(``profile.straggler.Straggler``: linear over short segments, then growing as the square
root; with 4 ranks on 2 cores 3 ms after 15 ms of compute, 32 ms after 543 ms). A layer choice
pays ``wait`` of each phase in which it issues a blocking collective (``fwd_comm_s`` /
``bwd_comm_s`` > 0), added to that phase's comm. The compute of phases that synchronise nothing
runs on to the step's closing synchronisation (the last gradient all-reduce); that wait,
``wait(U)`` of the plan's unsynchronised compute U, is not linear in the layers' choices, so
it is priced by its tangent at U0, the unsynchronised compute of the pure data-parallel plan::

    wait(U) ~ wait(U0) + wait'(U0) (U - U0) = closing_s + rate * U

``rate`` multiplies each unsynchronised phase's compute and ``closing_s`` is paid once by every
plan: exact for data parallelism, at most ``wait(U0) / 2`` too high for a plan that
synchronises in every layer. A profile measured before sigma (no ``straggler_sigma``)
multiplies all compute by ``1 + kappa`` instead, as autopar did then. A profile refined from
runs (``calibrate.refine``) also multiplies compute by its ``compute_drift`` of that many ranks.

FLOPs, bytes and the kernel class of an op come from its op family (``autopar.ops``, the
formula in each family's docstring): e.g. convolution ``2 * N * F * prod(out_spatial) * C/g *
prod(k)`` for each of forward, backward-data and backward-filter; linear ``2 * M * K * O`` for
forward and each of the two backward matmuls; elementwise and norm by their output elements
and bytes moved, pooling by output elements x window size (as the calibrator counts them);
attention ``4 B H L S D``; gathers and scatters by elements moved. Backward is priced at twice
forward unless the family names backward classes (convolution) or the class's sweep timed the
family's own backward (``OpFamily.sweep_backward``) and the profile fitted it (``bwd_model``,
``profile.fit.add_backward_models``): matmul, whose memory-bound shapes, e.g. NNConv's
per-edge products, take 3-6x their forward backward; max pooling, whose backward scatters
into zeros at a tenth of its forward; batch norm. A family's class missing from an older
profile falls back to the family's ``fallback_class``. Views cost nothing.

Every op also pays the runtime's own per-op work when the profile measured it (pseudo class
``runtime_op``, ``calibrate.overhead``; ``runtime_overhead_s``): a third in forward, two thirds
in backward. It is measured per op family (``by_family``: unary, binary, view, linear, layer
norm, batch norm, attention, embedding, gather), so views, which the kernel model prices free,
pay their dispatch; profiles without the table charge every non-view op ``t0_s`` and views
nothing, as before. A plan that runs the user's module natively (``runtime.native``) pays the
natively measured table instead (``native_by_family``): ``runtime_overhead_applies`` says which
of the two a plan pays, ``plan_runtime_overhead_s`` what it adds to a plan's step. Ops other
than convolutions and linear layers are priced from exact measurements of their local shape
when the profile has them (``calibrate.exact_ops``), like convolutions.

Saved activations (what autograd keeps for backward, per op, ``OpFamily.saved_bytes``):
convolution, linear, batch norm, pooling and multiplications keep their inputs; activations
keep their output; additions, views and dropout with p = 0 keep nothing; unregistered ops are
assumed to keep their first input. This is the ``activation_bytes`` term of every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..decomp.ir import OpSpec, has_backward, not_data_parallel, takes_input_grad
from ..ops import family_of, kernel_class_for
from ..ops.conv import conv_flops  # noqa: F401  (kept importable here)
from ..profile.features import elementwise_features
from ..profile.keys import op_key, op_spec, shape_key
from ..profile.straggler import Straggler

PHASES = ("fwd", "bwd_data", "bwd_filter")


def conv_spec(op: OpSpec, x_shape: Sequence[int], w_shape: Sequence[int] | None = None) -> dict:
    """The calibrator's shape spec of a convolution on local input ``x_shape``."""
    return family_of(op.kind).shape_spec(op, [x_shape], w_shape)


def linear_spec(x_shape: Sequence[int], w_shape: Sequence[int]) -> dict:
    """The calibrator's shape spec of a linear layer on local input ``x_shape``."""
    return family_of("linear").shape_spec(None, [x_shape], w_shape)


def _shape_key(spec: dict) -> str:
    return shape_key(spec)


def _kernel_s(prof, op_class: str, fl: float, by: float, spec: dict) -> float:
    """The profile's kernel model; with the op's shape ``spec`` where the class has a
    shape-aware model (``profile.features.conv_shape_features``)."""
    k = prof.kernels.get(op_class) if isinstance(getattr(prof, "kernels", None), dict) else None
    if isinstance(k, dict) and k.get("shape_model"):
        return prof.kernel_time_s(op_class, fl, by, spec=spec)
    return prof.kernel_time_s(op_class, fl, by)


def op_compute_s(op: OpSpec, in_shapes: Sequence[Sequence[int]], out_shape: Sequence[int],
                 ctx, w_shape: Sequence[int] | None = None, itemsize: int = 4) -> tuple[float, float, str]:
    """(forward s, backward s, source) of ``op`` on local shapes, on one rank.

    The op's family (``autopar.ops``) gives its local FLOPs and bytes, its calibration class
    and what may have measured it exactly: a ``shape_spec`` (convolution, linear: three phases
    measured by ``kernels.measure_exact``), a generic op spec (``exact_measured``:
    ``calibrate.exact_ops``), or nothing. Views (``free``) cost nothing. An op none of whose
    inputs carries a gradient (``attrs["input_grad"]`` False, ``decomp.ir.mark_input_grads``)
    has no data-gradient phase (a convolution's ``bwd_data``, half a linear layer's backward),
    and no backward at all without parameters."""
    fam = family_of(op.kind)
    prof = ctx.profile
    over = runtime_overhead_s(prof, op.kind, native=bool(getattr(ctx, "native_runtime", False)))
    if fam.free and over <= 0.0:
        return 0.0, 0.0, "fit"
    slow = _compute_slowdown(ctx)
    # no input carries a gradient (``decomp.ir.mark_input_grads``): no data-gradient phase, and
    # no backward at all without parameters
    f, b, src = _op_compute_s(fam, op, in_shapes, out_shape, ctx, w_shape, itemsize, over, slow,
                              takes_input_grad(op))
    return (f, b, src) if has_backward(op) else (f, 0.0, src)


def _op_compute_s(fam, op: OpSpec, in_shapes, out_shape, ctx, w_shape, itemsize: int, over: float,
                  slow: float, data_grad: bool) -> tuple[float, float, str]:
    """``op_compute_s`` past its first checks; ``data_grad``: price the data-gradient phase."""
    prof = ctx.profile
    if fam.free:      # a view: no kernel, but dispatched (and a backward node) when run op by op
        return over / 3 * slow, 2 * over / 3 * slow, "fit"
    fl = fam.local_flops(op, in_shapes, out_shape, w_shape)
    by = fam.local_bytes(op, in_shapes, out_shape, w_shape, itemsize)
    kernels = prof.kernels if isinstance(getattr(prof, "kernels", None), dict) else None
    cls = kernel_class_for(fam, kernels)
    spec = fam.shape_spec(op, in_shapes, w_shape)
    if spec is not None:
        if getattr(ctx, "spec_log", None) is not None:
            ctx.spec_log.append(spec)
        key = _shape_key(spec) if ctx.prefer_exact else None
        if fam.bwd_classes:
            # every phase its own measurement or class (convolution)
            times, sources = [], []
            for phase, pcls in zip(PHASES, (cls, *fam.bwd_classes)):
                if phase == "bwd_data" and not data_grad:
                    times.append(0.0)
                    continue
                t = prof.exact_time_s(key, phase) if key else None
                if t is None:
                    t, src = _kernel_s(prof, pcls, fl, by, spec), "fit"
                else:
                    src = "exact"
                times.append(t)
                sources.append(src)
            src = sources[0] if len(set(sources)) == 1 else "mixed"
            if src != "fit":
                _note_key(ctx, key)
            return (times[0] + over / 3) * slow, (times[1] + times[2] + 2 * over / 3) * slow, src
        # forward measured: backward phases measured too, or as long as forward (linear)
        tf = prof.exact_time_s(key, "fwd") if key else None
        if tf is not None:
            tbd = (prof.exact_time_s(key, "bwd_data") or tf) if data_grad else 0.0
            tbf = prof.exact_time_s(key, "bwd_filter") or tf
            _note_key(ctx, key)
            return (tf + over / 3) * slow, (tbd + tbf + 2 * over / 3) * slow, "exact"
    elif fam.exact_measured:
        gspec = op_spec(op, in_shapes, out_shape)
        if gspec is not None:
            if getattr(ctx, "spec_log", None) is not None:
                ctx.spec_log.append(gspec)
            if ctx.prefer_exact and getattr(prof, "exact", None):
                key = op_key(gspec)
                tf, tb = prof.exact_time_s(key, "fwd"), prof.exact_time_s(key, "bwd_data")
                if tf is not None and tb is not None:
                    _note_key(ctx, key)
                    return (tf + over / 3) * slow, (tb + 2 * over / 3) * slow, "exact"
    t = prof.kernel_time_s(cls, fl, by)
    tb = _kernel_bwd_s(prof, cls, fl, by) if fam.sweep_backward else None
    tb = 2 * t if tb is None else tb
    if not data_grad and spec is not None:   # a linear layer on the data: the weight gradient only
        tb /= 2
    return (t + over / 3) * slow, (tb + 2 * over / 3) * slow, "fit"


def _kernel_bwd_s(prof, op_class: str, fl: float, by: float) -> float | None:
    """The class's measured backward model (``Profile.kernel_bwd_time_s``), or None (stand-ins
    and profiles without it: backward = 2 x forward)."""
    fn = getattr(prof, "kernel_bwd_time_s", None)
    return fn(op_class, fl, by) if fn is not None else None


def _note_key(ctx, key: str) -> None:
    """Record which exact measurement priced an op (``ctx.key_log``: the table keeps them per
    layer choice, plan.json per layer, and refinement corrects exactly those entries)."""
    log = getattr(ctx, "key_log", None)
    if log is not None:
        log.append(key)


#: op kinds without a probe of their own (``calibrate.overhead.PROBES``) that pay a probed
#: family's per-op overhead (same arity and runtime path); other kinds pay ``t0_s``
OVERHEAD_ALIASES = {"scatter": "gather", "rms_norm": "layer_norm", "group_norm": "layer_norm",
                    "matmul": "binary"}


def runtime_overhead_s(prof, kind: str, native: bool = False) -> float:
    """The runtime's own work per op of ``kind``, forward + backward (``calibrate.overhead``),
    0 when the profile has none::

        overhead(kind) = table[kind]                  (table = by_family, or native_by_family)
                       = table[OVERHEAD_ALIASES[kind]]
                       = table["view"]                if kind is a view (0 without the table)
                       = t0_s                          otherwise

    ``native``: the op runs inside the user's module (``runtime.native``), not ``DistModel.op``;
    a profile without ``native_by_family`` charges native ops as traced ones."""
    k = prof.kernels.get("runtime_op") if isinstance(getattr(prof, "kernels", None), dict) else None
    if not k:
        return 0.0
    table = (k.get("native_by_family") if native else None) or k.get("by_family") or {}
    fam = family_of(kind)
    if fam.free:
        return float(table.get("view", 0.0))
    name = kind if kind in table else OVERHEAD_ALIASES.get(kind)
    if name in table:
        return float(table[name])
    return float(k["t0_s"])


def _compute_slowdown(ctx) -> float:
    """The factor every local compute time is multiplied by (module docstring); ``1 + kappa``
    only for profiles measured before sigma."""
    prof = ctx.profile
    legacy = ctx.world > 1 and straggler_sigma(prof, ctx.ranks_on_node) is None
    return prof.slowdown(ctx.ranks_on_node) * (1.0 + straggler(prof, ctx.ranks_on_node) if legacy else 1.0) \
        * compute_drift(prof, ctx.ranks_on_node) * getattr(ctx, "speed_factor", 1.0)


def grad_reducer_s(ctx, n_tensors: int, grad_bytes: float) -> float:
    """Main-thread work of the gradient reducer for one layer's gradients (beyond the all-reduce
    itself), on the slowest rank::

        reducer(layer) = slowdown * (per_tensor_s * n_tensors + per_byte_s * grad_bytes)

    ``n_tensors`` parameter tensors (an autograd hook each), ``grad_bytes`` the rank's gradient
    bytes the layer all-reduces (each copied into its bucket and back). The figures are
    torch DDP's reducer measured on one rank (``calibrate.overhead.measure_grad_reducer``,
    ``samples["grad_reducer"]``); autopar's ``GradSync`` does the same work per tensor and per
    byte in Python and is charged the same. 0 for a profile that did not measure it."""
    red = _samples(ctx.profile).get("grad_reducer")
    if not red or n_tensors <= 0:
        return 0.0
    return _compute_slowdown(ctx) * (float(red.get("per_tensor_s", 0.0)) * n_tensors
                                     + float(red.get("per_byte_s", 0.0)) * grad_bytes)


def grad_reducer_fixed_s(ctx) -> float:
    """The reducer's work once a step when any gradient is all-reduced (preparing the backward,
    finishing it), at the slowdown: ``slowdown * fixed_s``; 0 when not measured."""
    red = _samples(ctx.profile).get("grad_reducer")
    return _compute_slowdown(ctx) * float(red.get("fixed_s", 0.0)) if red else 0.0


def copy_s(ctx, numel: int, itemsize: int = 4) -> float:
    """One elementwise pass that reads and writes ``numel`` elements (a layout copy: a
    transpose made contiguous), by the profile's elementwise kernel model, slowed down like all
    local compute."""
    fl, by = elementwise_features(int(numel), 2)
    return ctx.profile.kernel_time_s("elementwise", fl, by * itemsize / 4) * _compute_slowdown(ctx)


def unsynced_compute_s(cost) -> float:
    """Compute of the phases of ``cost`` (a ``LayerCost``) that issue no blocking collective."""
    return (cost.fwd_compute_s if cost.fwd_comm_s <= 0 else 0.0) + (cost.bwd_compute_s if cost.bwd_comm_s <= 0 else 0.0)


@dataclass(frozen=True)
class StragglerCharge:
    """The straggler wait as a table prices it (module docstring)."""
    model: Straggler                   # the measured wait(t)
    rate: float                        # per second of unsynchronised compute
    closing_s: float                   # paid once by every plan
    reference_s: float                 # U0

    def wait_s(self, compute_s: float) -> float:
        return self.model.wait_s(compute_s)

    def apply(self, cost):
        """``cost`` with its phases' waits: added to the comm of a phase that synchronises,
        ``rate`` times the compute of one that does not."""
        from dataclasses import replace
        f_sync, b_sync = cost.fwd_comm_s > 0, cost.bwd_comm_s > 0
        return replace(cost,
                       fwd_compute_s=cost.fwd_compute_s * (1.0 if f_sync else 1.0 + self.rate),
                       bwd_compute_s=cost.bwd_compute_s * (1.0 if b_sync else 1.0 + self.rate),
                       fwd_comm_s=cost.fwd_comm_s + (self.wait_s(cost.fwd_compute_s) if f_sync else 0.0),
                       bwd_comm_s=cost.bwd_comm_s + (self.wait_s(cost.bwd_compute_s) if b_sync else 0.0))


def straggler_charge(ctx, reference_s: float) -> StragglerCharge | None:
    """The charge of ``ctx``'s world, linearised at ``reference_s`` of unsynchronised compute
    (module docstring); None on one rank and for profiles measured before sigma (their compute
    carries ``1 + kappa``)."""
    if ctx.world < 2:
        return None
    sigma = straggler_sigma(ctx.profile, ctx.ranks_on_node)
    if sigma is None:
        return None
    kappa = straggler(ctx.profile, ctx.ranks_on_node)
    u0 = max(0.0, reference_s)
    if kappa * u0 <= sigma * math.sqrt(u0):       # still in the linear regime at U0
        rate, closing = kappa, 0.0
    else:
        rate = sigma / (2.0 * math.sqrt(u0))
        closing = sigma * math.sqrt(u0) - rate * u0
    return StragglerCharge(Straggler(kappa, sigma), rate, closing, u0)


def runtime_overhead_applies(graph, decisions, world: int, batch_norm=None, batch_size: int | None = None) -> bool:
    """Whether a plan pays the traced runtime's per-op overhead (``DistModel.op`` for every
    op), i.e. whether it can NOT run the user's module natively (``runtime.native``).

    Contract: ``decisions`` maps every layer index of ``graph`` to its ``Decomposition``
    (a dict, or a sequence indexed by layer); ``batch_norm`` is the plan's
    ``decomp.bn.BatchNormStats`` (None = global statistics). Returns False exactly when the
    plan is pure data parallelism over the whole mesh as ``runtime.native.why_not_native``
    checks it from the plan alone: every layer ``sample(world)`` (layers no input reaches,
    ``decomp.ir.batch_free_layers``, may be replicated), every input and the output split into ``world`` equal sample
    blocks, and, when the graph has batch norms, local statistics in groups of the samples of
    one rank. What only the module can tell (a buffer forward updates, a module that does not
    run on a block) is not checked: such a plan runs traced although this says False, so a
    caller pricing it natively under-prices it by ``plan_runtime_overhead_s``. At world 1 the
    same holds with ``sample(1)``. Imports no runtime module."""
    if not_data_parallel(graph, decisions, world) is not None:
        return True
    for gi in graph.inputs:
        if not gi.shape or gi.shape[0] % world:
            return True
    out = list(graph.value_shape(graph.output))
    if not out or out[0] % world:
        return True
    if any(op.kind == "batch_norm" for lay in graph.layers for op in lay.ops):
        n = int(batch_size or graph.batch_size or 0)
        if batch_norm is None or not getattr(batch_norm, "local", False) or not n or n % world \
                or getattr(batch_norm, "group", None) != n // world:
            return True
    return False


def overhead_shares(op: OpSpec) -> tuple[float, float]:
    """(forward, backward) shares of an op's per-op runtime work as ``op_compute_s`` charges it:
    a third forward, two thirds backward; no backward share for a parameter-free op none of
    whose inputs carries a gradient (it has no backward node)."""
    return (1.0 / 3.0, 2.0 / 3.0) if has_backward(op) else (1.0 / 3.0, 0.0)


def plan_runtime_overhead_s(graph, ctx, native: bool = False) -> float:
    """Seconds of per-op runtime overhead (forward + backward, on the slowest rank) that the
    per-op prices of every op of ``graph`` hold (``op_compute_s``), traced or ``native``: a
    plan's prediction priced traced becomes the native one by
    ``t - plan_runtime_overhead_s(g, ctx) + plan_runtime_overhead_s(g, ctx, native=True)``."""
    prof = ctx.profile
    slow = _compute_slowdown(ctx)
    return sum(runtime_overhead_s(prof, op.kind, native) * sum(overhead_shares(op))
               for lay in graph.layers for op in lay.ops) * slow


def saved_bytes(op: OpSpec, in_shapes: Sequence[Sequence[int]], out_shape: Sequence[int],
                itemsize: int = 4) -> float:
    """Bytes autograd keeps for backward: the op family's ``saved_bytes`` (module docstring)."""
    return family_of(op.kind).saved_bytes(op, in_shapes, out_shape, itemsize)


def _samples(prof) -> dict:
    """The profile's measured extras (``Profile.samples``); empty for stand-ins without them."""
    samples = getattr(prof, "samples", None)
    return samples if isinstance(samples, dict) else {}


def compute_drift(prof, ranks_on_node: int) -> float:
    """The compute factor learned from runs with ``ranks_on_node`` ranks on a node
    (``calibrate.refine``, ``samples["corrections"]["compute_drift"]``); 1.0 for other counts:
    a drift seen at 2 ranks says nothing about 8."""
    drift = (_samples(prof).get("corrections") or {}).get("compute_drift") or {}
    return float(drift.get(str(int(ranks_on_node)), 1.0))


def _nearest_measured(table: dict, ranks_on_node: int) -> float:
    """The value of ``table`` (``{str(ranks running): value}``) for the measured count nearest
    ``ranks_on_node``, the larger on a tie."""
    w = min((int(k) for k in table), key=lambda x: (abs(x - ranks_on_node), -x))
    return float(table[str(w)])


def straggler(prof, ranks_on_node: int) -> float:
    """kappa of ``profile.straggler.Straggler`` for the nearest measured number of ranks
    running: ranks that synchronise wait for the slowest, about kappa seconds per second of
    compute between synchronisations; 0 when not measured (dedicated devices)."""
    table = _samples(prof).get("straggler_kappa")
    if not table or ranks_on_node < 2:
        return 0.0
    return _nearest_measured(table, ranks_on_node)


def comm_interference(prof, ranks_on_node: int) -> float:
    """The share of a gradient all-reduce's time that compute running beside it does not
    hide (``calibrate.insitu.comm_interference``), for the nearest measured number of ranks
    running; 0 when not measured (a device computes while the network moves gradients)."""
    table = _samples(prof).get("comm_interference")
    if not table or ranks_on_node < 2:
        return 0.0
    return _nearest_measured(table, ranks_on_node)


def straggler_sigma(prof, ranks_on_node: int) -> float | None:
    """sigma (s^0.5) of ``profile.straggler.Straggler`` for the nearest measured number
    of ranks running: the wait for the slowest grows as ``sigma sqrt(t)`` over long stretches of
    compute; None when the profile was measured before sigma (or measured no straggler)."""
    table = _samples(prof).get("straggler_sigma")
    if not table or ranks_on_node < 2:
        return None
    return _nearest_measured(table, ranks_on_node)


def insitu_latency_s(prof, p: int, ranks_on_node: int | None = None, kind: str = "allreduce") -> float:
    """Measured latency of a blocking collective of ``kind`` among p ranks inside a step, with
    ``ranks_on_node`` ranks running on the node (``calibrate.insitu``): the nearest measured
    world, then the nearest measured group size; 0 when not measured. all_to_all and p2p have
    tables of their own when measured (``insitu_latency_by_kind_s``); other kinds, and profiles
    without them, use the all-reduce's. Profiles measured before the per-world table have the
    p = w diagonal only (``insitu_latency_s``)."""
    samples = _samples(prof)
    if p < 2:
        return 0.0
    by_world = (samples.get("insitu_latency_by_kind_s") or {}).get(kind) if kind != "allreduce" else None
    by_world = by_world or samples.get("insitu_latency_by_world_s")
    if by_world and ranks_on_node is not None:
        worlds = sorted(int(w) for w in by_world)
        w = min(worlds, key=lambda x: (abs(x - max(ranks_on_node, p)), -x))
        table = by_world[str(w)]
    else:
        table = samples.get("insitu_latency_s")
    if not table:
        return 0.0
    sizes = sorted(int(k) for k in table)
    near = min(sizes, key=lambda s: (abs(s - p), -s))
    return float(table[str(near)])


def blocking_s(ctx, kind: str, p: int, nbytes: float, level: str) -> float:
    """A collective the ranks wait on inside the step (statistics, halos, transitions)::

        t = T_kind(p, n) + max(0, latency_insitu(p) - T_kind(p, 0))

    i.e. the isolated fit, with its latency raised to what the runtime meets between kernels."""
    t = ctx.profile.collective_time_s(kind, p, nbytes, level)
    lat = insitu_latency_s(ctx.profile, p, ctx.ranks_on_node, kind)
    if lat > 0:
        t += max(0.0, lat - ctx.profile.collective_time_s(kind, p, 0.0, level))
    return t * correction(ctx.profile, "blocking_comm_scale")


def correction(prof, name: str) -> float:
    """A factor learned from measured runs (``calibrate.refine``), 1.0 when the profile was
    never refined. ``blocking_comm_scale`` multiplies every collective the ranks wait on inside
    the step (``blocking_s``, halo exchange); ``grad_sync_scale`` the gradient all-reduce
    (``grad_allreduce_s``). Kept apart because they fail apart: on the 2-core machine blocking
    statistics were under-priced while the large asynchronous all-reduce was over-priced."""
    return float((_samples(prof).get("corrections") or {}).get(name, 1.0))


def allreduce_s(ctx, nbytes: float, ranks: Sequence[int], blocking: bool = True) -> float:
    """All-reduce of ``nbytes`` per rank among ``ranks``, on the link those ranks use
    (``blocking_s`` unless it runs asynchronously, as the gradient sync does)."""
    ranks = list(ranks)
    if len(ranks) <= 1 or nbytes <= 0:
        return 0.0
    if blocking:
        return blocking_s(ctx, "allreduce", len(ranks), nbytes, ctx.level(ranks))
    return ctx.profile.collective_time_s("allreduce", len(ranks), nbytes, ctx.level(ranks))


def grad_sync_time_s(ctx, param_bytes: float, group: Sequence[int]) -> float:
    """Gradient SUM-allreduce of a layer's ``param_bytes`` over its gradient ``group``
    (the runtime twin is ``autopar.runtime.gradsync.GradSync``)."""
    group = list(group)
    if len(group) <= 1 or param_bytes <= 0:
        return 0.0
    return grad_allreduce_s(ctx, param_bytes, len(group), ctx.level(group))


def grad_sync_latency(ctx, group: Sequence[int], signature: str | None = None) -> tuple:
    """``LayerCost.grad_sync_latency`` of a layer whose gradients all-reduce over ``group``:
    one (signature, latency, final latency) triple (``grad_latencies_s``); the signature names
    the group (the runtime's bucket key)."""
    group = list(group)
    if len(group) <= 1:
        return ()
    sig = signature or f"allreduce {len(group)} {ctx.level(group)} {min(group)}..{max(group)}"
    return ((sig, *grad_latencies_s(ctx, len(group), ctx.level(group))),)


def grad_latencies_s(ctx, p: int, level: str) -> tuple[float, float]:
    """(latency of a gradient all-reduce running behind backward, latency of the LAST bucket's,
    which the step waits for right after backward: a blocking collective, priced with the
    in-situ latency of p ranks as ``blocking_s`` prices one)."""
    lat = grad_allreduce_s(ctx, 0.0, p, level)
    final = max(lat, insitu_latency_s(ctx.profile, p, ctx.ranks_on_node) * correction(ctx.profile, "grad_sync_scale"))
    return lat, final


def grad_allreduce_s(ctx, nbytes: float, p: int, level: str) -> float:
    """The asynchronous gradient all-reduce of ``nbytes`` among ``p`` ranks on ``level``:
    the isolated fit, times the learned ``grad_sync_scale`` (``correction``)."""
    return (ctx.profile.collective_time_s("allreduce", p, nbytes, level)
            * correction(ctx.profile, "grad_sync_scale"))


def optimizer_bytes(ctx, param_bytes: float) -> float:
    return ctx.optimizer_state_per_param * param_bytes
