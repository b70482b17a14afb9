"""Cost primitives shared by every decomposition: local op compute, memory, collectives.

Compute of one op on a local shape (the slowest rank holds block 0, the largest)::

    t_phase = profile.exact_time_s(shape_key, phase)                       if measured ("exact")
            = profile.kernel_time_s(class(op, phase), flops, bytes)        otherwise ("fit")
    t       = t_phase * profile.slowdown(ranks_on_node) * (1 + kappa(ranks_on_node))

``kappa`` (``straggler``, world > 1 only): ranks that synchronise wait for the slowest, which on
shared cores costs a measured share of the compute between synchronisations. A profile refined
from runs (``calibrate.refine``) also multiplies by its ``compute_drift`` of that many ranks.

FLOPs (per phase, multiply-add = 2): convolution ``2 * N * F * prod(out_spatial) * C/g *
prod(k)`` for each of forward, backward-data and backward-filter; linear ``2 * M * K * O`` for
forward and each of the two backward matmuls; elementwise and norm by their output elements
and bytes moved, pooling by output elements x window size (as the calibrator counts them);
backward is priced at twice forward. Views cost nothing.

Every op also pays the runtime's own per-op work when the profile measured it (pseudo class
``runtime_op``, ``calibrate.overhead``): a third in forward, two thirds in backward. Ops other
than convolutions and linear layers are priced from exact measurements of their local shape
when the profile has them (``calibrate.exact_ops``), like convolutions.

Saved activations (what autograd keeps for backward, per op): convolution, linear, batch norm,
pooling and multiplications keep their inputs; activations keep their output; additions, views
and dropout with p = 0 keep nothing. This is the ``activation_bytes`` term of every layer.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..calibrate.exact_ops import op_key, op_spec
from ..calibrate.kernels import shape_key
from ..decomp.ir import (ADAPTIVE_POOL, BATCH_NORM, BINARY, CAT, CONV, DROPOUT, FLATTEN, LINEAR,
                         MEAN, OTHER, POOL, UNARY, VIEW, OpSpec)

PHASES = ("fwd", "bwd_data", "bwd_filter")


def conv_spec(op: OpSpec, x_shape: Sequence[int], w_shape: Sequence[int] | None = None) -> dict:
    """The calibrator's shape spec of a convolution on local input ``x_shape``."""
    a = op.attrs
    w = list(w_shape if w_shape is not None else op.params["weight"])
    return {"op": "conv", "x": [int(s) for s in x_shape], "w": [int(s) for s in w],
            "stride": list(a["stride"]), "padding": list(a["padding"]) if not isinstance(a["padding"], str) else a["padding"],
            "dilation": list(a["dilation"]), "groups": int(a["groups"])}


def linear_spec(x_shape: Sequence[int], w_shape: Sequence[int]) -> dict:
    m = math.prod(x_shape[:-1])
    return {"op": "linear", "x": [int(m), int(x_shape[-1])], "w": [int(s) for s in w_shape]}


def _shape_key(spec: dict) -> str:
    return shape_key(spec)


def conv_flops(x_shape: Sequence[int], w_shape: Sequence[int], out_shape: Sequence[int], groups: int) -> float:
    n, f = x_shape[0], w_shape[0]
    return 2.0 * n * f * math.prod(out_shape[2:]) * w_shape[1] * math.prod(w_shape[2:])


def op_compute_s(op: OpSpec, in_shapes: Sequence[Sequence[int]], out_shape: Sequence[int],
                 ctx, w_shape: Sequence[int] | None = None, itemsize: int = 4) -> tuple[float, float, str]:
    """(forward s, backward s, source) of ``op`` on local shapes, on one rank."""
    prof = ctx.profile
    slow = prof.slowdown(ctx.ranks_on_node) * (1.0 + straggler(prof, ctx.ranks_on_node) if ctx.world > 1 else 1.0) \
        * compute_drift(prof, ctx.ranks_on_node)
    out_numel = math.prod(out_shape)
    in_bytes = sum(math.prod(s) for s in in_shapes) * itemsize
    out_bytes = out_numel * itemsize
    if op.kind == CONV:
        w = list(w_shape if w_shape is not None else op.params["weight"])
        x = in_shapes[0]
        fl = conv_flops(x, w, out_shape, op.attrs.get("groups", 1))
        wbytes = math.prod(w) * itemsize
        times, sources = [], []
        spec = conv_spec(op, x, w)
        if getattr(ctx, "spec_log", None) is not None:
            ctx.spec_log.append(spec)
        key = _shape_key(spec) if ctx.prefer_exact else None
        for phase, cls in zip(PHASES, ("conv_fwd", "conv_bwd_data", "conv_bwd_filter")):
            t = prof.exact_time_s(key, phase) if key else None
            if t is None:
                t, src = prof.kernel_time_s(cls, fl, in_bytes + out_bytes + wbytes), "fit"
            else:
                src = "exact"
            times.append(t)
            sources.append(src)
        src = sources[0] if len(set(sources)) == 1 else "mixed"
        if src != "fit":
            _note_key(ctx, key)
        over = _runtime_overhead_s(prof)
        return (times[0] + over / 3) * slow, (times[1] + times[2] + 2 * over / 3) * slow, src
    if op.kind == LINEAR:
        w = list(w_shape if w_shape is not None else op.params["weight"])
        x = in_shapes[0]
        m = math.prod(x[:-1])
        fl = 2.0 * m * w[0] * w[1]
        by = (m * w[1] + m * w[0] + w[0] * w[1]) * itemsize
        spec = linear_spec(x, w)
        if getattr(ctx, "spec_log", None) is not None:
            ctx.spec_log.append(spec)
        key = _shape_key(spec) if ctx.prefer_exact else None
        tf = prof.exact_time_s(key, "fwd") if key else None
        if tf is not None:
            tbd = prof.exact_time_s(key, "bwd_data") or tf
            tbf = prof.exact_time_s(key, "bwd_filter") or tf
            _note_key(ctx, key)
            over = _runtime_overhead_s(prof)
            return (tf + over / 3) * slow, (tbd + tbf + 2 * over / 3) * slow, "exact"
        over = _runtime_overhead_s(prof)
        t = prof.kernel_time_s("matmul", fl, by)
        return (t + over / 3) * slow, (2 * t + 2 * over / 3) * slow, "fit"
    if op.kind in (VIEW, FLATTEN):
        return 0.0, 0.0, "fit"
    over = _runtime_overhead_s(prof)
    spec = op_spec(op, in_shapes, out_shape)
    if spec is not None:
        if getattr(ctx, "spec_log", None) is not None:
            ctx.spec_log.append(spec)
        if ctx.prefer_exact and getattr(prof, "exact", None):
            key = op_key(spec)
            tf, tb = prof.exact_time_s(key, "fwd"), prof.exact_time_s(key, "bwd_data")
            if tf is not None and tb is not None:
                _note_key(ctx, key)
                return (tf + over / 3) * slow, (tb + 2 * over / 3) * slow, "exact"
    cls = {BATCH_NORM: "norm", POOL: "pool", ADAPTIVE_POOL: "pool"}.get(op.kind, "elementwise")
    flops = {BATCH_NORM: 8.0, UNARY: 1.0, BINARY: 1.0}.get(op.kind, 1.0) * out_numel
    if op.kind == POOL:   # the calibrator counts one flop per window element
        flops = out_numel * math.prod(op.attrs.get("kernel", [1]))
    elif op.kind == ADAPTIVE_POOL:
        flops = float(sum(math.prod(s) for s in in_shapes))
    t = prof.kernel_time_s(cls, flops, in_bytes + out_bytes)
    return (t + over / 3) * slow, (2 * t + 2 * over / 3) * slow, "fit"


def _note_key(ctx, key: str) -> None:
    """Record which exact measurement priced an op (``ctx.key_log``: the table keeps them per
    layer choice, plan.json per layer, and refinement corrects exactly those entries)."""
    log = getattr(ctx, "key_log", None)
    if log is not None:
        log.append(key)


def _runtime_overhead_s(prof) -> float:
    """The runtime's own work per op (``calibrate.overhead``), 0 when the profile has none."""
    k = prof.kernels.get("runtime_op") if isinstance(getattr(prof, "kernels", None), dict) else None
    return float(k["t0_s"]) if k else 0.0


def saved_bytes(op: OpSpec, in_shapes: Sequence[Sequence[int]], out_shape: Sequence[int],
                itemsize: int = 4) -> float:
    """Bytes autograd keeps for backward (see module docstring)."""
    if op.kind in (CONV, LINEAR, BATCH_NORM, POOL, MEAN, ADAPTIVE_POOL, OTHER, CAT):
        return sum(math.prod(s) for s in in_shapes[:1 if op.kind != CAT else None]) * itemsize
    if op.kind == BINARY:
        return sum(math.prod(s) for s in in_shapes) * itemsize if op.target.startswith(("aten.mul", "aten.div")) else 0.0
    if op.kind == UNARY:
        return math.prod(out_shape) * itemsize
    if op.kind == DROPOUT:
        p = op.attrs.get("p", 0.0)
        return math.prod(out_shape) * 1.0 if p and op.attrs.get("train", True) else 0.0
    return 0.0


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


def straggler(prof, ranks_on_node: int) -> float:
    """kappa of ``calibrate.insitu.measure_straggler`` for the nearest measured number of ranks
    running: ranks that synchronise wait for the slowest, about kappa seconds per second of
    compute between synchronisations; 0 when not measured (dedicated devices)."""
    table = _samples(prof).get("straggler_kappa")
    if not table or ranks_on_node < 2:
        return 0.0
    w = min((int(k) for k in table), key=lambda x: (abs(x - ranks_on_node), -x))
    return float(table[str(w)])


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
