"""The machine's usual speed: every speed-probe reading taken on this machine, kept.

A calibration states every kernel time at the median probe reading of its own kernel sweep
(``calibrate.speed``: ``t_nominal = t_measured * nominal_probe_s / probe_s``). On a shared VM
that sweep lasts 15 s of a quick calibration and lands in whatever stretch the machine is in:
over seven fresh quick profiles of one 2-core VM the nominal read 4.33-5.57 ms, while the
probe read after each plan of the prediction benchmark's runs kept medians of 5.02-5.33 ms
(about 190 readings per run). A profile made in a fast stretch priced every plan low, one made
in a slow stretch every plan high (``reports/benchmarks/speed_drift_across_runs.txt``, removed; git 172578b^).

This module keeps the readings: ``autopar calibrate`` records its nominal and ``autopar
execute`` the probe it reads after its timed steps, each one event of this machine instance
(the host name and the kernel's boot id: a restarted or new VM starts a history of its own).
``usual_speed`` gives the median of this machine's events of the last ``WINDOW_HOURS`` once
there are ``MIN_EVENTS``; ``autopar plan --speed-history`` (``PlanOptions.speed_history``) then
multiplies every local compute time by

    speed_factor = (usual_probe_s / profile_nominal_probe_s) ** USUAL_WEIGHT

(``Profile.slowdown`` carries it), i.e. states the profile's kernels at a reading between the
machine's usual one and the one of the seconds they were measured in (``USUAL_WEIGHT`` = 0.5:
their geometric mean, ``MachineSpeed.priced_at_s``), and records it in ``plan.json``
(``calibration.machine_speed``). Why between: the plans of a fresh profile run in the minutes
after it was measured, when the machine may still be in the stretch the calibration met, and
a stretch can last an hour. The prediction benchmark's thirteen kept runs of one VM boot,
replayed (``benchmarks/reprice_with_speed_history.py``,
``reports/benchmarks/speed_history_weight_0.5_runs_29-41.txt`` and ``_weight_1_``, all removed; git 172578b^): the median of the runs' median
|error| in-sample / held-out 7.6 / 14.4 % with the history off, 8.4 / 12.7 % priced at the
usual reading, 5.7 / 12.7 % at the geometric mean; the two runs calibrated in the boot's fastest
stretch, whose machine stayed fast, were over-predicted 10.2-28.7 % at the usual reading and
4.1-22.2 % at the mean. Only for a profile whose fingerprint matches
this machine and software (``ondemand.can_measure``'s rule): the probe says nothing about
another machine's kernels. Collectives, in-step latencies and the straggler are as measured.

Opt-in: by default ``autopar plan`` prices the profile as measured and reads no history, so
that a default plan depends on its profile and model alone, never on machine-local state (the
same plan read 15.21 ms with the history and 15.05 ms without it on one day, and could choose
differently on another); the weight above was chosen on the very runs it was scored on.
``autopar calibrate`` and ``autopar execute`` still append their readings (harmless: nothing
reads them unless asked).

Where: ``AUTOPAR_SPEED_HISTORY`` (a file; ``off`` turns the history off, recording included), by
default ``$XDG_CACHE_HOME/autopar/speed_history.json`` (``~/.cache``): machine-local state, never
in a repository.
A history file that does not read as one is set aside with a warning and started anew.

Part of neither the runtime nor the solver; imports nothing heavy.
"""

from __future__ import annotations

import datetime as _dt
import functools
import math
import os
import socket
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..io import atomic_write_json, load_json_file
from .shapes import can_measure
from .speed import profile_nominal_s

SCHEMA = "autopar.speed_history/1"
#: environment variable naming the history file; "off" (or "0", "no", "false") disables it
HISTORY_ENV = "AUTOPAR_SPEED_HISTORY"
#: events of this machine needed before a plan is restated (one calibration and four runs)
MIN_EVENTS = 5
#: the hours of readings whose median is the usual reading: a long window, because the
#: machine's slow and fast stretches last seconds to minutes and a short window inherits the
#: last one (ad hoc, replaying runs 30-35 of 2026-12-02 as ``benchmarks/
#: reprice_with_speed_history.py`` (removed; git 172578b^) does: the last 64 readings priced the held-out plans at
#: 14.5 % in the median, the whole history at 11.3 %, the history off at 14.9 %)
WINDOW_HOURS = 24.0
#: the weight of the usual reading against the profile's own in the reading compute is priced
#: at (module docstring; 1 prices at the usual reading, 0 as measured). Windows of 1 and 2 h at
#: full weight replayed 9.4 / 12.6 and 9.0 / 12.5 % over the same runs
USUAL_WEIGHT = 0.5
#: events kept per file (oldest dropped first)
KEEP_EVENTS = 5000
_OFF = ("off", "0", "no", "false", "none")


def history_path() -> Path | None:
    """The history file (module docstring), or None when ``AUTOPAR_SPEED_HISTORY`` is off."""
    env = os.environ.get(HISTORY_ENV)
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autopar" / "speed_history.json"


@functools.lru_cache(maxsize=1)
def machine_key() -> str:
    """This machine instance: host name and (on Linux) the boot id (read once per process)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def _load(path: Path) -> list[dict]:
    """The events of ``path``; [] when there is none. A file that is not a history is set
    aside (renamed ``.corrupt``) with a warning, never trusted."""
    if not path.exists():
        return []
    try:
        obj = load_json_file(path)
        events = obj["events"] if obj.get("schema") == SCHEMA else None
        if not isinstance(events, list) or not all(_valid(e) for e in events):
            raise ValueError("not an autopar speed history")
        return events
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        bad = path.with_name(path.name + ".corrupt")
        try:
            os.replace(path, bad)
        except OSError:
            pass
        warnings.warn(f"speed history {path} is unreadable ({e}); set aside as {bad.name} and "
                      "started anew", stacklevel=2)
        return []


def _valid(e) -> bool:
    return (isinstance(e, dict) and isinstance(e.get("machine"), str) and isinstance(e.get("when"), str)
            and isinstance(e.get("probe_s"), (int, float)) and 0 < e["probe_s"] < 60)


def _age_h(e: dict, now: _dt.datetime) -> float:
    try:
        return (now - _dt.datetime.fromisoformat(e["when"])).total_seconds() / 3600.0
    except (ValueError, TypeError):
        return math.inf


def record(probe_s: float | None, source: str, path: Path | None = None) -> bool:
    """Append one probe reading (seconds) of this machine, made by ``source`` ("calibrate",
    "execute"); written atomically. False (nothing written) when the history is off or the
    reading is missing; a file that cannot be written is warned about, never fatal."""
    path = path if path is not None else history_path()
    if path is None or probe_s is None or not (0 < float(probe_s) < 60):
        return False
    events = _load(path)
    events.append(event(float(probe_s), str(source)))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"schema": SCHEMA, "events": events[-KEEP_EVENTS:]})
    except OSError as e:
        warnings.warn(f"speed history {path} not written ({e})", stacklevel=2)
        return False
    return True


def event(probe_s: float, source: str, when: _dt.datetime | None = None) -> dict:
    """One reading of this machine, as the history keeps it."""
    when = when or _dt.datetime.now(_dt.timezone.utc)
    return {"machine": machine_key(), "source": source, "probe_s": float(f"{probe_s:.6g}"),
            "when": when.isoformat(timespec="seconds")}


@dataclass(frozen=True)
class MachineSpeed:
    """The usual probe reading of this machine against the one a profile's kernels are stated at."""
    usual_probe_s: float          # median of the window's events
    profile_nominal_s: float      # the profile's nominal probe reading
    events: int                   # readings in the window
    path: str                     # the history file read

    @property
    def factor(self) -> float:
        """Every local compute time of the profile is multiplied by this (module docstring)."""
        return (self.usual_probe_s / self.profile_nominal_s) ** USUAL_WEIGHT

    @property
    def priced_at_s(self) -> float:
        """The probe reading the plan's compute is stated at: ``profile_nominal_s * factor``."""
        return self.profile_nominal_s * self.factor

    def to_json(self) -> dict:
        return {"usual_probe_s": self.usual_probe_s, "profile_nominal_s": self.profile_nominal_s,
                "usual_weight": USUAL_WEIGHT, "priced_at_s": self.priced_at_s,
                "events": self.events, "speed_factor": round(self.factor, 4), "history": self.path}


def usual_speed(profile, path: Path | None = None) -> tuple[MachineSpeed | None, str]:
    """(the machine's usual speed against ``profile``'s, or None, and why not). None when the
    history is off or has fewer than ``MIN_EVENTS`` events of this machine, when the profile
    has no nominal probe reading, or when it was made on another machine or software."""
    path = path if path is not None else history_path()
    if path is None:
        return None, f"the speed history is off ({HISTORY_ENV})"
    nominal = profile_nominal_s(profile)
    if not nominal:
        return None, "the profile has no speed-probe reading"
    why = can_measure(profile, 1)
    if why is not None:
        return None, why
    key, now = machine_key(), _dt.datetime.now(_dt.timezone.utc)
    mine = [e for e in _load(path) if e["machine"] == key and _age_h(e, now) <= WINDOW_HOURS]
    if len(mine) < MIN_EVENTS:
        return None, (f"{len(mine)} probe readings of this machine in the last {WINDOW_HOURS:g} h in {path} "
                      f"(fewer than {MIN_EVENTS})")
    usual = statistics.median(float(e["probe_s"]) for e in mine)
    return MachineSpeed(usual, float(nominal), len(mine), str(path)), ""
