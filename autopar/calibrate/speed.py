"""The machine's speed while kernels are measured: a fixed probe read between measurements.

On a shared machine (a VM whose cores other guests use too) kernels run 10-30 % faster or
slower for seconds at a time. A calibration measures its op classes and exact shapes one after
another, so each lands in whatever phase the machine was in: two quick profiles made minutes
apart priced the same ResNet-2D plan's local convolutions 20 % apart, because the exact shapes
it needs happened to be measured in a slow phase of one and a fast phase of the other, while
the same shapes in another stretch of the same runs agreed to 1 %.

The machine's speed moves on two time scales here. Probe readings 25 ms apart correlated 0.69,
five apart 0.36, twenty apart not at all in one run, 0.47 / 0.08 / 0.01 in another
(``benchmarks/bench_calibration_noise.py`` (removed; git 172578b^)): phases of a few hundred milliseconds, +-7-10 %
(one reading's spread). On top of them, stretches of seconds to minutes run 10-20 % slower or
faster: in the two profiles above the first fifth of the exact shapes was measured 17-50 %
slower in one than the other, the rest alike. Only the slow stretches can be followed: a
reading says nothing about a kernel measured half a second later, so one reading per
measurement would add the fast phases' noise instead of removing anything.

``SpeedTrack`` reads a fixed probe (``kernels.slowdown_kernel_set``: a convolution forward and
filter backward, a matmul, a ReLU and a batch norm, about 5 ms here; the median of
``PROBE_REPEATS`` runs) every ``READ_INTERVAL_S`` of measuring, and gives each measurement the
mean of the readings within ``SMOOTH_S`` of it (about 20 readings on this VM, so about 2 % of
reading noise). ``normalize_rows`` then states every time at one nominal speed, the median
probe reading of the calibration (``samples["speed_probe"]``):

    t_nominal = t_measured * nominal_probe_s / probe_s

Measured side by side on this VM (12 chunks of 10 convolution shapes, six passes, the probe
read around each chunk): the sum's spread across passes fell from 11 % to 4 % (coefficient of
variation). Across four fresh quick profiles pricing the same plans
(``benchmarks/bench_profile_stability.py`` (removed; git 172578b^)) the predictions spread 7.9 % with it and 7.7 % on
the raw times (median over the in-sample plans): no gain when every profile's kernels ran in
similar stretches; 15.7 % against 19.7 % in a run where one profile was measured in a
disturbed one. Later additions to the profile (``calibrate.run.add_exact_shapes``,
``exact_ops.add_op_shapes``, ``ondemand``) normalise to the profile's nominal, so a shape
measured in a slow minute is priced as if measured with the rest. What it does not remove: a
calibration made entirely in a slow phase has a slow nominal, and a plan executed in a
different phase than the calibration runs at that phase's speed (``execute`` reports the probe
against the nominal).

Raw times stay in every row (``raw_median_s``, ``raw_bwd_median_s``, ``probe_s``), so a
profile can be fitted again either way.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from ..profile.speed import profile_nominal_s  # noqa: F401  (the nominal this module measures)
from .kernels import slowdown_kernel_set, time_fn

#: runs of the probe per reading (the median is the reading): about 25 ms on this VM
PROBE_REPEATS = 5
#: seconds of measuring between two readings: the VM's phases last seconds; reading every
#: 0.5 s costs about 5 % of the kernel sweep
READ_INTERVAL_S = 0.5
#: seconds either side of a measurement whose readings give its speed (the slow stretches of
#: this VM last seconds to minutes, its fast phases a few hundred milliseconds)
SMOOTH_S = 5.0
#: the row fields ``normalize_rows`` states at nominal speed
TIME_KEYS = ("median_s", "bwd_median_s")


def probe_reading_s(device: str = "cpu", repeats: int = PROBE_REPEATS,
                    probe: Callable[[], None] | None = None) -> float:
    """One reading: the median seconds of ``repeats`` runs of the probe (after one warm-up)."""
    fn = probe or slowdown_kernel_set(device)
    return statistics.median(time_fn(fn, device, repeats=repeats, warmup=1, min_sample_s=0.0))


@dataclass
class SpeedTrack:
    """Probe readings between the measurements of one process: call ``mark(key)`` before
    each measurement (it reads the probe when the last reading is ``interval_s`` old), and
    ``close()`` after the last; ``probes()`` is then ``{key: the mean of the readings within
    ``smooth_s`` of that measurement}`` (``segment`` and ``probe_s`` underneath). ``read`` and
    ``clock`` are for tests."""

    device: str = "cpu"
    interval_s: float = READ_INTERVAL_S
    smooth_s: float = SMOOTH_S
    read: Callable[[], float] | None = None
    clock: Callable[[], float] = time.perf_counter
    readings_s: list[float] = field(default_factory=list)
    at_s: list[float] = field(default_factory=list)       # when each reading ended (clock)
    _last: float = -math.inf
    _probe: Callable[[], None] | None = None
    _marks: dict = field(default_factory=dict)

    def _read(self) -> None:
        if self.read is not None:
            self.readings_s.append(float(self.read()))
        else:
            if self._probe is None:
                self._probe = slowdown_kernel_set(self.device)
            self.readings_s.append(probe_reading_s(self.device, probe=self._probe))
        self._last = self.clock()
        self.at_s.append(self._last)

    def segment(self) -> int:
        """The index of the stretch the next measurement falls in (reading the probe first
        when the last reading is ``interval_s`` old or there is none)."""
        if not self.readings_s or self.clock() - self._last >= self.interval_s:
            self._read()
        return len(self.readings_s) - 1

    def mark(self, key) -> None:
        """Before measuring ``key``: note the stretch it falls in (``segment``)."""
        self._marks[key] = self.segment()

    def probes(self) -> dict:
        """``{key: probe_s}`` of every ``mark``ed measurement (after ``close``)."""
        return {k: self.probe_s(seg) for k, seg in self._marks.items()}

    def close(self) -> None:
        """Read once more, so that the last stretch has a reading after it too."""
        if self.readings_s:
            self._read()

    def probe_s(self, index: int) -> float:
        """The probe's time around stretch ``index`` (between readings ``index`` and
        ``index + 1``): the mean of the readings within ``smooth_s`` of its middle, the two
        around it at least."""
        r, at = self.readings_s, self.at_s
        j = min(index + 1, len(r) - 1)
        mid = (at[index] + at[j]) / 2
        near = [x for x, t in zip(r, at) if abs(t - mid) <= self.smooth_s]
        return statistics.fmean(near or [r[index], r[j]])


def nominal_probe_s(readings_s) -> float | None:
    """The calibration's nominal speed: the median of its probe readings (None without any)."""
    vals = [float(x) for x in readings_s if x and x > 0]
    return statistics.median(vals) if vals else None


def _round(t: float) -> float:
    return float(f"{t:.6g}")


def normalize_rows(rows, nominal_s: float | None, keys=TIME_KEYS) -> None:
    """State each row's times at the nominal speed, in place: ``row[k] = raw * nominal_s /
    row["probe_s"]`` for k in ``keys``, the raw time kept as ``row["raw_" + k]``. Rows without
    a probe reading (or no nominal) are left as measured; a row already normalised is
    normalised again from its raw time (so the nominal can change)."""
    if not nominal_s:
        return
    for r in rows:
        p = r.get("probe_s") if isinstance(r, dict) else None
        if not p or p <= 0:
            continue
        for k in keys:
            raw = r.get("raw_" + k, r.get(k))
            if raw is None:
                continue
            r["raw_" + k] = raw
            r[k] = _round(raw * nominal_s / p)


def normalize_exact(exact: dict, probes: dict, nominal_s: float | None) -> dict:
    """``{key: {phase: s}}`` of exact measurements stated at the nominal speed, from each
    key's probe reading in ``probes`` (``{key: probe_s}``; keys without one as measured)."""
    if not nominal_s:
        return exact
    out = {}
    for key, phases in exact.items():
        p = probes.get(key)
        out[key] = ({ph: _round(t * nominal_s / p) for ph, t in phases.items()}
                    if p and p > 0 else phases)
    return out


def speed_entry(readings_s, nominal_s: float | None = None) -> dict:
    """``samples["speed_probe"]`` of a profile: the nominal (median reading, or the one
    given), every reading, and their spread (max / min - 1)."""
    vals = [float(x) for x in readings_s if x and x > 0]
    kept = [_round(x) for x in vals]
    # the nominal is the median of the readings as stored, so a reader can recompute it exactly
    nominal = nominal_s if nominal_s else nominal_probe_s(kept)
    return {"nominal_s": nominal, "readings_s": kept,
            "spread": (max(vals) / min(vals) - 1.0) if vals else None,
            "probe": "kernels.slowdown_kernel_set", "repeats": PROBE_REPEATS}


def as_measured(profile) -> None:
    """Undo the normalisation of ``profile``'s kernel times, in place, from the raw times its
    samples keep: sweep rows (``raw_median_s``), exact shapes (the median of their repeats) and
    exact ops (``samples["exact_ops"]``); the nominal is dropped. Fit the models again after it
    (``calibrate.run.refit_profile``, ``refit_conv_shape_models``): the profile as it was
    measured, for comparing predictions with and without the probe."""
    samples = profile.samples or {}
    for rows in (samples.get("kernels") or {}).values():
        for r in rows:
            for k in TIME_KEYS:
                if "raw_" + k in r:
                    r[k] = r.pop("raw_" + k)
            r.pop("probe_s", None)
    for key, phases in (samples.get("exact") or {}).items():
        if isinstance(phases, dict) and phases.get("probe_s") and key in profile.exact:
            profile.exact[key] = {ph: _round(statistics.median(ts)) for ph, ts in phases.items()
                                  if isinstance(ts, list) and ts}
    for key, entry in (samples.get("exact_ops") or {}).items():
        if key in profile.exact and entry.get("raw"):
            profile.exact[key] = dict(entry["raw"])
    samples.pop("speed_probe", None)
