"""Calibration profile: the artifact the cost model reads (schema ``autopar.profile/1``).

A profile says how long a kernel of a given op class, FLOP count and byte count takes on one
rank, how long each collective takes for a group size and message size, how much a kernel slows
down when several ranks share one node's cores, and (optionally) the measured time of exact
layer shapes. It is plain JSON, written by :func:`autopar.calibrate.run.calibrate` (measured)
or ``calibration/make_datasheet_profile.py`` (derived from vendor datasheets).

Part of the pure profile model (``autopar.profile``): no torch, no measurement, no process.
Loading a profile fits the shape-aware models a profile made before them lacks
(``profile.fit.add_shape_models``: numpy, and scipy when there is something to fit).

Model forms (alpha: per-message latency in s, beta: s per byte, p: group size, n: bytes by the
conventions in :meth:`Profile.collective_time_s`; ``L = ceil(log2 p)``)::

    p2p             t = alpha + n*beta
    allgather       t = L*alpha + (p-1)/p * n*beta
    reduce_scatter  t = L*alpha + (p-1)/p * n*beta
    allreduce       t = 2*L*alpha + 2*(p-1)/p * n*beta
    broadcast       t = L*(alpha + n*beta)
    all_to_all      t = (p-1)*alpha + (p-1)/p * n*beta

    kernel          t = t0 + flops*s_per_flop + bytes*s_per_byte

No reduction term (gamma) is fitted for allreduce / reduce_scatter: at a fixed group size it is
proportional to ``(p-1)/p*n`` exactly like the beta term, so it cannot be told apart from beta
and is folded into it (fits are per group size). The same formulas are fitted in
:mod:`autopar.profile.fit` through ``collective_terms``, written once in
:mod:`autopar.profile.schema`.
"""

from __future__ import annotations

import copy
import importlib.metadata
import math
import platform
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..errors import CalibrationError
from ..io import atomic_write_json, read_json
from .features import conv_model_time_s
from .fit import add_shape_models, bwd_model_time_s, cache_features, intensity_features
from .schema import COLLECTIVES, LEVELS, OP_CLASSES, PHASES, PROFILE_SCHEMA, SIMULATED, collective_terms

__all__ = ["COLLECTIVES", "LEVELS", "OP_CLASSES", "PHASES", "PROFILE_SCHEMA", "SIMULATED", "Profile",
           "check_fingerprint", "collective_terms", "current_fingerprint", "default_profile_path",
           "load_profile", "require_measured_here", "save_profile", "simulated_entries"]

# Fingerprint fields whose difference makes a profile suspect on this machine.
_CHECKED_FIELDS = ("host", "cpu_model", "gpu_model", "torch_version", "device")
_REQUIRED_FIELDS = ("schema", "fingerprint", "provenance", "topology", "kernels", "collectives",
                    "exact", "compute_slowdown", "samples")
_KERNEL_KEYS = ("t0_s", "s_per_flop", "s_per_byte")
_COLL_KEYS = ("alpha_s", "beta_s_per_byte")
_MEASURED_VALUES = (True, False, SIMULATED)

_REDO = "rerun `autopar calibrate` to regenerate it"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def current_fingerprint(backend: str = "gloo") -> dict:
    """What identifies this machine and software for a profile measured with ``backend``.

    gloo means CPU (no torch import, cheap); nccl means CUDA and imports torch for the GPU name.
    """
    device = "cuda" if backend == "nccl" else "cpu"
    gpu_model = None
    if device == "cuda":
        import torch

        gpu_model = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "host": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "gpu_model": gpu_model,
        "torch_version": _torch_version(),
        "backend": backend,
        "device": device,
        "num_threads": 1,
        "python": platform.python_version(),
    }


@dataclass
class Profile:
    """A calibration profile. Field layouts (all times in seconds, sizes in bytes):

    - ``kernels[op_class]``: ``t0_s, s_per_flop, s_per_byte`` (fitted, non-negative),
      ``flops_per_s, bytes_per_s`` (their inverses, None when the term is 0),
      ``heldout_median_rel_err, heldout_max_rel_err, n_samples, measured``.
    - ``collectives[kind][level][str(group_size)]``: ``alpha_s, beta_s_per_byte``,
      ``heldout_median_rel_err, heldout_max_rel_err, n_samples, measured`` (False for entries
      that were not measured, e.g. "inter" in a single-node profile, which copy "intra";
      ``"simulated"`` for "inter" entries of a simulated multi-node calibration, measured
      between processes of ONE host over loopback: see ``autopar.calibrate.cluster``),
      ``source``. A multi-node calibration keeps its "inter" samples in
      ``samples["collectives_inter"]`` (``samples["collectives"]`` holds "intra").
    - ``exact[shape_key] = {"fwd": s, "bwd_data": s, "bwd_filter": s}``.
    - ``compute_slowdown[str(k)]``: kernel-time factor with k ranks running on one node (a CPU
      calibration prices counts beyond one rank per core as time sharing,
      ``calibrate.run.time_shared_slowdown``; its readings: ``samples["compute_slowdown_measured"]``).
    - ``samples["insitu_raw"][str(w)]``: the in-step probes' rounds with w ranks running
      (``calibrate.insitu.raw_rounds``), from which the stored straggler and in-situ latencies
      were read, by ``samples["insitu_stat"]`` ("mean"; absent: "median", as calibration read
      them before 2026-12-02), and another statistic can be read later
      (``insitu.estimate_in_situ``); absent from profiles made before they were kept.
    - ``samples["grad_reducer"]``: torch DDP's reducer work beyond its all-reduces,
      ``fixed_s, per_tensor_s, per_byte_s`` and the probe rows they were fitted to
      (``calibrate.overhead.measure_grad_reducer``; priced by ``cost.primitives.grad_reducer_s``); absent from
      profiles made before 2026-12-02 and from GPU profiles.
    """

    schema: str
    fingerprint: dict
    provenance: dict
    topology: dict
    kernels: dict
    collectives: dict
    exact: dict = field(default_factory=dict)
    compute_slowdown: dict = field(default_factory=lambda: {"1": 1.0})
    samples: dict = field(default_factory=dict)

    # ---- kernels ------------------------------------------------------------------------
    def kernel_time_s(self, op_class: str, flops: float, bytes_moved: float,
                      spec: dict | None = None) -> float:
        """``t0 + flops*s_per_flop + bytes*s_per_byte`` (flop/byte conventions: ``profile.features``);
        for a convolution whose shape ``spec`` is given and whose class has a fitted
        ``shape_model``, that model (``features.conv_shape_features``) instead; for a class with
        an ``intensity_model`` (``fit.intensity_features``: its own rates above a bytes-per-FLOP
        threshold), that one; else for a class with a ``cache_model``, that one
        (``fit.cache_features``)."""
        k = self.kernels.get(op_class)
        if k is None:
            raise CalibrationError(
                f"profile has no kernel model for op class {op_class!r} "
                f"(has: {', '.join(sorted(self.kernels)) or 'none'})", _REDO)
        sm = k.get("shape_model") if spec is not None else None
        if sm and spec.get("op") == "conv":
            t = conv_model_time_s(sm, spec)
            if t is not None:
                return t
        im = k.get("intensity_model")
        if im and im.get("form") == "intensity/1":
            feats = intensity_features(flops, bytes_moved, im["threshold_bytes_per_flop"])
            return float(sum(c * f for c, f in zip(im["coef"], feats)))
        cm = k.get("cache_model")
        if cm and cm.get("form") == "cache/1":
            return float(sum(c * f for c, f in zip(cm["coef"], cache_features(flops, bytes_moved))))
        return k["t0_s"] + float(flops) * k["s_per_flop"] + float(bytes_moved) * k["s_per_byte"]

    def kernel_bwd_time_s(self, op_class: str, flops: float, bytes_moved: float) -> float | None:
        """The backward of a kernel of ``op_class`` whose FORWARD has these FLOPs and bytes, by
        the class's measured ``bwd_model`` (``fit.add_backward_models``); None when the profile
        did not measure it (the cost model then prices backward at twice the forward)."""
        k = self.kernels.get(op_class)
        bm = k.get("bwd_model") if isinstance(k, dict) else None
        if not bm:
            return None
        return bwd_model_time_s(bm, flops, bytes_moved)

    def exact_time_s(self, shape_key: str, phase: str) -> float | None:
        """Measured time of an exact layer shape (``profile.keys.shape_key``), or None if unmeasured."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        entry = self.exact.get(shape_key)
        if entry is None:
            return None
        t = entry.get(phase)
        return None if t is None else float(t)

    # ---- collectives --------------------------------------------------------------------
    def collective_time_s(self, kind: str, group_size: int, nbytes: float,
                          level: str = "intra") -> float:
        """Time of one collective. ``nbytes`` conventions:

        allreduce, broadcast: the buffer per rank; allgather: the whole gathered output;
        reduce_scatter: the whole input per rank; all_to_all: the total one rank sends (its
        whole input buffer, its own block included); p2p: one message (group_size ignored).
        ``group_size <= 1`` costs 0 (except p2p). For a group size that was not measured, the
        constants of the nearest measured size are plugged into the formula with the real p.
        """
        if kind not in COLLECTIVES:
            raise CalibrationError(f"unknown collective {kind!r}",
                                   f"use one of {', '.join(COLLECTIVES)}")
        if kind != "p2p" and int(group_size) <= 1:
            return 0.0
        if level not in LEVELS:
            raise ValueError(f"level must be 'intra' or 'inter', got {level!r}")
        per_level = self.collectives.get(kind, {})
        table = per_level.get(level)
        if not table:
            raise CalibrationError(f"profile has no {kind} model for level {level!r}", _REDO)
        p = 2 if kind == "p2p" else int(group_size)
        c = table[str(_nearest_size(p, table))] if kind != "p2p" else next(iter(table.values()))
        a, b = collective_terms(kind, p)
        return a * c["alpha_s"] + b * max(float(nbytes), 0.0) * c["beta_s_per_byte"]

    def slowdown(self, ranks_on_node: int) -> float:
        """Kernel-time factor with ``ranks_on_node`` ranks sharing one node.

        Measured counts are returned as stored, but never below 1: ranks sharing a node do not
        run faster than one alone, and a factor under 1 (0.87 for 2 ranks in one calibration
        of the 2-core VM) is the machine speeding up between the 1-rank and the k-rank windows;
        between them the factor is interpolated linearly (with 1.0 at 1 rank); beyond the
        largest measured count k with factor f it follows the ``max(1, ranks/cores)`` shape with
        effective cores ``k/f``: ``max(f, r*f/k)``.
        """
        r = int(ranks_on_node)
        if r <= 1:
            return 1.0
        table = {int(k): max(1.0, float(v)) for k, v in self.compute_slowdown.items()}
        table.setdefault(1, 1.0)
        if r in table:
            return table[r]
        ks = sorted(table)
        kmax = ks[-1]
        if r > kmax:
            f = table[kmax]
            return max(f, 1.0, r * f / kmax)
        lo = max(k for k in ks if k < r)
        hi = min(k for k in ks if k > r)
        w = (r - lo) / (hi - lo)
        return table[lo] * (1 - w) + table[hi] * w

    # ---- topology -----------------------------------------------------------------------
    def level_of(self, ranks: Sequence[int]) -> str:
        """"intra" if all ``ranks`` are on one node (rank // ranks_per_node), else "inter"."""
        rpn = int(self.topology["ranks_per_node"])
        nodes = {int(r) // rpn for r in ranks}
        return "intra" if len(nodes) <= 1 else "inter"

    def with_topology(self, ranks_per_node: int, nodes: int) -> "Profile":
        """A copy for planning another cluster shape with the same per-node/per-link costs."""
        if ranks_per_node < 1 or nodes < 1:
            raise ValueError("ranks_per_node and nodes must be >= 1")
        new = copy.deepcopy(self)
        new.topology = {"ranks_per_node": int(ranks_per_node), "nodes": int(nodes)}
        return new

    # ---- JSON ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema": self.schema,
            "fingerprint": self.fingerprint,
            "provenance": self.provenance,
            "topology": self.topology,
            "kernels": self.kernels,
            "collectives": self.collectives,
            "exact": self.exact,
            "compute_slowdown": self.compute_slowdown,
            "samples": self.samples,
        }

    @staticmethod
    def from_json(obj: dict, owned: bool = False) -> "Profile":
        """Build a profile from its JSON object; CalibrationError names what is wrong.
        ``owned``: ``obj`` was just parsed and nothing else holds it, so its parts are taken
        as they are (a 1.3 MB profile with raw samples is not deep-copied once more)."""
        _validate(obj)
        if owned:
            return Profile(**{k: obj[k] for k in _REQUIRED_FIELDS})
        return Profile(**{k: copy.deepcopy(obj[k]) for k in _REQUIRED_FIELDS})


def _nearest_size(p: int, table: dict) -> int:
    sizes = sorted(int(s) for s in table)
    # nearest by distance; ties go to the larger measured size (more pessimistic contention)
    return min(sizes, key=lambda s: (abs(s - p), -s))


def _validate(obj, where: str = "profile") -> None:
    if not isinstance(obj, dict):
        raise CalibrationError(f"{where} is not a JSON object", _REDO)
    schema = obj.get("schema")
    if schema != PROFILE_SCHEMA:
        raise CalibrationError(
            f"{where} has schema {schema!r}, this autopar reads {PROFILE_SCHEMA!r}", _REDO)
    missing = [k for k in _REQUIRED_FIELDS if k not in obj]
    if missing:
        raise CalibrationError(f"{where} lacks field(s) {', '.join(missing)}", _REDO)
    for k in _REQUIRED_FIELDS[1:]:
        if not isinstance(obj[k], dict):
            raise CalibrationError(f"{where}: field {k!r} must be an object, got "
                                   f"{type(obj[k]).__name__}", _REDO)
    topo = obj["topology"]
    for k in ("ranks_per_node", "nodes"):
        if not isinstance(topo.get(k), int) or topo[k] < 1:
            raise CalibrationError(f"{where}: topology.{k} must be a positive integer", _REDO)
    for op, entry in obj["kernels"].items():
        bad = [k for k in _KERNEL_KEYS if not _is_number(entry.get(k) if isinstance(entry, dict) else None)]
        if bad:
            raise CalibrationError(f"{where}: kernels.{op} lacks numeric {', '.join(bad)}", _REDO)
    for kind, levels in obj["collectives"].items():
        if kind not in COLLECTIVES or not isinstance(levels, dict):
            raise CalibrationError(f"{where}: collectives.{kind} is not a known collective table",
                                   _REDO)
        for level, sizes in levels.items():
            if level not in LEVELS or not isinstance(sizes, dict) or not sizes:
                raise CalibrationError(f"{where}: collectives.{kind}.{level} is malformed", _REDO)
            for size, entry in sizes.items():
                if not str(size).isdigit():
                    raise CalibrationError(
                        f"{where}: collectives.{kind}.{level} has non-integer group size {size!r}",
                        _REDO)
                bad = [k for k in _COLL_KEYS
                       if not _is_number(entry.get(k) if isinstance(entry, dict) else None)]
                if bad:
                    raise CalibrationError(
                        f"{where}: collectives.{kind}.{level}.{size} lacks numeric "
                        f"{', '.join(bad)}", _REDO)
                m = entry.get("measured", False)
                if not any(m is v or (isinstance(v, str) and m == v) for v in _MEASURED_VALUES):
                    raise CalibrationError(
                        f"{where}: collectives.{kind}.{level}.{size}.measured is {m!r}; "
                        f"expected true, false or {SIMULATED!r}", _REDO)
    for k, v in obj["compute_slowdown"].items():
        if not str(k).isdigit() or not _is_number(v):
            raise CalibrationError(f"{where}: compute_slowdown[{k!r}] is malformed", _REDO)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def check_fingerprint(prof: Profile, path) -> None:
    """Warn (not fail), naming each differing field, if ``prof`` was made on another machine."""
    fp = prof.fingerprint
    here = current_fingerprint(fp.get("backend") or "gloo")
    diffs = [f"{k}: profile {fp.get(k)!r} vs here {here.get(k)!r}"
             for k in _CHECKED_FIELDS if fp.get(k) != here.get(k)]
    if diffs:
        kind = prof.provenance.get("kind", "measured")
        extra = (" (a datasheet profile describes a machine you need not be on; pass "
                 "check_machine=False to silence this)" if kind == "datasheet" else
                 "; its timings may not hold here, recalibrate with `autopar calibrate`")
        warnings.warn(f"calibration profile {path} was made on another machine or software "
                      f"({'; '.join(diffs)}){extra}", stacklevel=3)


def require_measured_here(prof: Profile, path, what: str) -> None:
    """CalibrationError unless ``prof`` was measured on this machine and software: adding
    ``what`` measured here to a datasheet profile, or to one from another host, would mix two
    machines' numbers in one profile."""
    if prof.provenance.get("kind") != "measured":
        raise CalibrationError(f"{path} is a {prof.provenance.get('kind')!r} profile: {what} "
                               "measured here would not describe its machine",
                               "calibrate this machine (`autopar calibrate`) and add them to that")
    here = current_fingerprint(prof.fingerprint.get("backend") or "gloo")
    diff = [k for k in _CHECKED_FIELDS if prof.fingerprint.get(k) != here.get(k)]
    if diff:
        raise CalibrationError(f"{path} was measured on another machine or software "
                               f"(differs in {', '.join(diff)}): {what} measured here would not "
                               "match it", "recalibrate this machine first")


def simulated_entries(prof: Profile) -> list[str]:
    """``kind.level.p`` of every collective entry measured on a simulated multi-node layout."""
    return [f"{kind}.{level}.{p}" for kind, levels in prof.collectives.items()
            for level, sizes in levels.items() for p, e in sizes.items()
            if e.get("measured") == SIMULATED]


def load_profile(path, check_machine: bool = True) -> Profile:
    """Read and validate a profile; warn (not fail) if it was measured on another machine, and
    (always) if some of its collectives were measured on a simulated multi-node layout."""
    obj = read_json(path, CalibrationError, "calibration profile")
    try:
        prof = Profile.from_json(obj, owned=True)    # read_json's object: no one else holds it
    except CalibrationError as e:
        raise CalibrationError(f"calibration profile {path}: {e.message}", e.hint) from None
    if check_machine:
        check_fingerprint(prof, path)
    add_shape_models(prof)      # a profile made before the shape-aware models: from its samples
    sim = simulated_entries(prof)
    if sim:
        warnings.warn(f"calibration profile {path}: {len(sim)} collective entries (e.g. {sim[0]}) "
                      "are SIMULATED: 'inter' was measured between processes on ONE host "
                      "(loopback), not over a real inter-node link; calibrate the real cluster "
                      "before trusting multi-node plans", stacklevel=2)
    return prof


def save_profile(profile: Profile, path) -> None:
    """Validate and write atomically: an interruption leaves the old file or the new one."""
    obj = profile.to_json()
    _validate(obj)
    atomic_write_json(path, obj)


def default_profile_path() -> Path:
    """``<repo>/calibration/cpu-2core-gloo.json``; CalibrationError if it does not exist."""
    path = Path(__file__).resolve().parents[2] / "calibration" / "cpu-2core-gloo.json"
    if not path.is_file():
        raise CalibrationError(f"no default calibration profile at {path}",
                               "run `autopar calibrate` or pass a profile path")
    return path
