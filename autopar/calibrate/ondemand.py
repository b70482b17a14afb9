"""Measuring missing shapes: the local convolution and linear shapes of competitive candidates
that a profile lacks, measured into the shape file beside it (``PROFILE-shapes.json``). Planning
never runs this (it starts no process; ``autopar.planner.shapes`` names what is missing): the
step before planning, ``autopar plan --measure-shapes`` (``calibrate.shapes_step``), does, and
the plan then reads the shape file it names and records.

A new model is then priced like a shipped one (whose shapes ``calibrate --model`` measured),
without recalibrating. Steps (``OnDemand``):

1. ``OnDemand(profile_path, profile, world)`` reads the cache ``PROFILE-shapes.json``
   (``cache_path``) and returns a profile whose ``exact`` table also holds the cached shapes
   (the profile's own entries win). A cache that does not parse, has another schema, wrong
   value types, or another machine's fingerprint is never trusted: it is set aside with a
   warning and rebuilt from scratch by the next measurement.
2. After the plan is solved, ``measure_for(table, solution)`` collects the shapes of the
   *competitive* candidates (``competitive_specs``: each layer's chosen decomposition and every
   kept choice within ``COMPETITIVE`` (x1.25) of the layer's fastest) that neither the profile
   nor the cache holds, and measures them in one child process (``kernels.measure_exact``,
   ``REPEATS`` repeats) within ``budget_s`` (default 30 s): before each shape the child
   estimates its cost from the fitted model and stops when it would overrun. What was measured
   is written to the cache (atomically) and ``shapes_step`` plans again with it (up to 3 rounds, as
   the new optimum may have competitive shapes of its own, all within one budget); shapes left
   out are named (they stay priced by the generic model).

Measuring is possible only where the numbers describe the plan's machine (``can_measure``):
a profile measured on this machine and software (fingerprint match), and a world no larger
than the ranks that profile measured (``topology``): a datasheet profile, another machine's,
or a simulated cluster of 1024 ranks is priced by the generic models, as before.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from ..planner.shapes import COMPETITIVE, competitive_specs  # noqa: F401  (one definition, the planner's)
from ..profile.keys import shape_key
from ..profile.shapes import CACHE_SCHEMA, cache_path, can_measure, load_cache, write_cache  # noqa: F401
from ..profile.speed import profile_nominal_s
from ..runtime import launch as rank_launch  # looked up at each call: tests replace run_ranks
from .kernels import measure_exact, spec_features
from .run import _check_backend
from .speed import SpeedTrack, normalize_exact

#: timed repeats per phase (after one warm-up) of a shape measured on demand
REPEATS = 5
DEFAULT_BUDGET_S = 30.0


def _measure_rank(rank, world, specs, budget_s, device, est_s, nominal_s=None):  # pragma: no cover - in child
    """Measure ``specs`` in order until the next one would overrun ``budget_s``; with the
    profile's nominal probe time, each stated at that speed of the machine (``speed``)."""
    t0 = time.perf_counter()
    track = SpeedTrack(device) if nominal_s else None
    done: dict[str, dict] = {}
    for spec, est in zip(specs, est_s):
        if time.perf_counter() - t0 + est > budget_s:
            break
        if track is not None:
            track.mark(shape_key(spec))
        done.update(measure_exact([spec], device, REPEATS, warmup=1))
        if time.perf_counter() - t0 > budget_s:
            break
    probes = {}
    if track is not None:
        track.close()
        probes = track.probes()
    return normalize_exact(done, probes, nominal_s), [shape_key(s) for s in specs]


def _estimate_s(profile, spec: dict) -> float:
    """Seconds to measure ``spec`` (3 phases x (repeats + warm-up)) by the fitted model."""
    try:
        cls, fl, by = spec_features(spec)
        t = sum(profile.kernel_time_s(c, fl, by, spec=spec) for c in
                (("conv_fwd", "conv_bwd_data", "conv_bwd_filter") if cls == "conv" else ("matmul",) * 3))
    except Exception:
        t = 0.01
    return t * (REPEATS + 1) + 0.002


class OnDemand:
    """The on-demand measurement of one ``make_plan`` call (module docstring)."""

    def __init__(self, profile_path: str | Path, profile, world: int,
                 progress: Callable[[str], None] = lambda s: None,
                 budget_s: float = DEFAULT_BUDGET_S) -> None:
        self.path = cache_path(profile_path)
        self.base = profile
        self.world = world
        self.say = progress
        self.budget_s = budget_s
        self.reason = can_measure(profile, world)
        self.cached, why = load_cache(self.path, profile.fingerprint)
        if why:
            warnings.warn(f"shape cache {self.path} is {why}: not trusted, it will be rebuilt",
                          stacklevel=3)
            self.cached = {}
            self.rebuild = True
        else:
            self.rebuild = False
        self.measured: list[str] = []
        self.left_out: list[str] = []
        self.spent_s = 0.0

    @property
    def profile(self):
        """The profile with the cached shapes added (its own entries win)."""
        if not self.cached:
            return self.base
        return dataclasses.replace(self.base, exact={**self.cached, **self.base.exact})

    def measure_for(self, table, choice: list[int]) -> bool:
        """Measure the competitive shapes missing; True when something new was measured (the
        caller re-plans)."""
        if self.reason is not None:
            return False
        budget = self.budget_s - self.spent_s
        prof = self.profile
        todo = [s for s in competitive_specs(table, choice) if shape_key(s) not in prof.exact]
        if not todo:
            return False
        backend = self.base.fingerprint.get("backend") or "gloo"
        device = _check_backend(backend, 1)
        est = [_estimate_s(prof, s) for s in todo]
        self.say(f"exact shapes: measuring {len(todo)} local shape(s) of competitive candidates "
                 f"missing from the profile (at most {max(budget, 0):.3g} s more, estimated "
                 f"{sum(est):.1f} s; autopar plan --measure-shapes; written to {self.path})")
        t0 = time.perf_counter()
        import torch  # noqa: F401  (before forking)
        done, _ = rank_launch.run_ranks(_measure_rank, 1, (todo, budget, device, est, profile_nominal_s(self.base)),
                            backend=backend, timeout_s=max(budget, 0) * 2 + 60)[0]
        self.spent_s += time.perf_counter() - t0
        self.measured += list(done)
        self.left_out = [shape_key(s) for s in todo if shape_key(s) not in done]
        if done or self.rebuild:
            self.cached.update(done)
            write_cache(self.path, self.base.fingerprint, self.cached)
            self.rebuild = False
        self.say(f"exact shapes: {len(done)} measured in {time.perf_counter() - t0:.1f} s"
                 + (f"; stopped at the {self.budget_s:.3g} s bound, {len(self.left_out)} shape(s) "
                    f"stay priced by the generic model: " + ", ".join(self.left_out[:6])
                    + (" ..." if len(self.left_out) > 6 else "") if self.left_out else ""))
        return bool(done)

    def to_json(self) -> dict[str, Any]:
        return {"cache": str(self.path), "measured": len(self.measured),
                "left_out": self.left_out, "not_measured_because": self.reason,
                "cached": len(self.cached)}
