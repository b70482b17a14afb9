"""Exact local shapes of every other op (batch norm, pooling, activations, additions...).

Convolutions and linear layers have their exact-shape measurements in ``kernels.measure_exact``.
On a CPU the rest of a layer (a max-pool backward, a batch norm over a large activation) is
just as hard to fit with one linear model per op class, so the same idea is applied to them:
the spec of an op is its traced ``OpSpec`` with the *local* shapes a decomposition gives it,
the key is a canonical string of that, and the measurement runs the op exactly as the runtime
does (``runtime.ops.call_local``) on random tensors: forward, then backward with a random
output gradient, less what starting the autograd engine costs (``backward_call_s``: a step
starts it once, not per op). Stored in ``profile.exact[key]`` as ``{"fwd": s, "bwd_data": s}``
(the whole backward under ``bwd_data``). Which ops are measured this way is their op family's
``exact_measured`` (``autopar.ops``): not views, not convolutions and linear layers, not ops
with integer inputs (embedding, gather, scatter, class-index losses), not unregistered ops.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Iterable

from ..profile.keys import op_key, op_spec  # noqa: F401  (the keys of what this measures)
from ..decomp.ir import OpSpec
from ..profile.profile import load_profile, save_profile
from ..profile.speed import profile_nominal_s
from ..runtime import launch as rank_launch  # looked up at each call: tests replace run_ranks
from ..runtime.ops import call_local
from .speed import SpeedTrack, normalize_exact


def _build(spec: dict):
    import torch
    op = OpSpec(name="y", kind=spec["kind"], target=spec["target"], args=spec["args"], kwargs=spec["kwargs"],
                out_shape=spec["out_shape"], dtype=spec["dtype"], inputs=spec["inputs"],
                in_shapes=spec["in_shapes"], params=spec["params"], param_names=spec["param_names"],
                buffers=spec["buffers"], attrs=spec["attrs"])
    gen = torch.Generator().manual_seed(0)
    ins = [torch.randn(s, generator=gen).requires_grad_() for s in spec["in_shapes"]]
    params = {q: torch.randn(op.params[r], generator=gen).requires_grad_() for r, q in op.param_names.items()}
    c = spec["in_shapes"][0][1] if len(spec["in_shapes"][0]) > 1 else 1
    buffers = {q: (torch.zeros(c) if "mean" in r else torch.ones(c)) for r, q in op.buffers.items()}
    return op, ins, params, buffers


def backward_call_s(repeats: int = 200) -> float:
    """Median time of ``y.backward(g)`` through one trivial one-element op: what starting the
    autograd engine costs. A step starts it once, not once per op, so ``measure_ops``
    subtracts it from every op's backward (the engine's per-op work is ``runtime_op``)."""
    import torch
    x = torch.randn(1, requires_grad=True)
    g = torch.ones(1)
    ts = []
    for _ in range(repeats):
        y = x * 1.0
        t = time.perf_counter()
        y.backward(g)
        ts.append(time.perf_counter() - t)
        x.grad = None
    return statistics.median(ts)


def measure_ops(specs: Iterable[dict], repeats: int = 10, warmup: int = 2,
                track=None) -> dict[str, dict[str, float]]:
    """Median forward and backward time of each op spec (one thread, as ranks run); backward
    without the engine's start-up (``backward_call_s``). With a ``speed.SpeedTrack``, each
    measurement is ``mark``ed on it (the caller closes it and reads ``probes()``)."""
    import torch
    base_s = backward_call_s()
    out: dict[str, dict[str, float]] = {}
    for spec in specs:
        key = op_key(spec)
        if key in out:
            continue
        if track is not None:
            track.mark(key)
        op, ins, params, buffers = _build(spec)
        y = call_local(op, ins, params, buffers)
        g = torch.randn_like(y)
        fwd, bwd = [], []
        ring: list = []          # keep recent outputs alive, as a step keeps its activations
        for i in range(warmup + repeats):
            t = time.perf_counter()
            y = call_local(op, ins, params, buffers)
            t1 = time.perf_counter()
            if y.requires_grad:
                y.backward(g)
            t2 = time.perf_counter()
            ring.append(y.detach())
            del ring[:-8]
            for x in list(ins) + list(params.values()):
                x.grad = None
            if i >= warmup:
                fwd.append(t1 - t)
                bwd.append(t2 - t1)
        out[key] = {"fwd": statistics.median(fwd), "bwd_data": max(0.0, statistics.median(bwd) - base_s)}
    return out


def _measure_rank(rank, world, specs, repeats):
    """(``{key: {phase: s}}`` as measured, ``{key: probe_s}``) of ``measure_ops`` with a track."""
    track = SpeedTrack()
    res = measure_ops(specs, repeats, track=track)
    track.close()
    return res, track.probes()


def add_op_shapes(profile_path: str | Path, specs: list[dict], progress: Callable[[str], None] = print,
                  repeats: int = 10) -> Path:
    """Measure the generic op specs not yet in the profile (in a fresh one-thread process, as
    the ranks run) and write the profile back atomically."""
    path = Path(profile_path)
    prof = load_profile(path, check_machine=False)
    todo, seen = [], set(prof.exact)
    for s in specs:
        k = op_key(s)
        if k not in seen:
            seen.add(k)
            todo.append(s)
    if not todo:
        progress(f"exact ops: all {len(specs)} already in {path}")
        return path
    import torch  # noqa: F401  (before forking)
    t0 = time.perf_counter()
    res, probes = rank_launch.run_ranks(_measure_rank, 1, (todo, repeats), timeout_s=900)[0]
    prof.exact.update(normalize_exact(res, probes, profile_nominal_s(prof)))
    prof.samples.setdefault("exact_ops", {}).update(      # as measured (``speed.as_measured``)
        {k: {"raw": v, "probe_s": probes.get(k)} for k, v in res.items()})
    save_profile(prof, path)
    progress(f"exact ops: {len(res)} op shape(s) measured in {time.perf_counter() - t0:.1f} s, written to {path}")
    return path
