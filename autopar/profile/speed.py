"""The speed a profile's kernels are stated at (``profile_nominal_s``): its nominal speed-probe
reading, which ``calibrate.speed`` measures and the speed history (``profile.history``) holds
the machine's usual reading against. Pure: reads the profile."""

from __future__ import annotations


def profile_nominal_s(profile) -> float | None:
    """The nominal probe time a profile's kernels are stated at (None: measured before the
    probe existed, or not on this kind of machine; later measurements stay raw then)."""
    entry = (getattr(profile, "samples", None) or {}).get("speed_probe") or {}
    v = entry.get("nominal_s")
    return float(v) if v else None
