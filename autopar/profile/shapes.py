"""The shape cache beside a profile (``PROFILE-shapes.json``): exact local shapes measured on
demand (``calibrate.ondemand``), read back into the profile's ``exact`` table when planning.
Reading, writing and trusting the cache is the pure profile model's; measuring is not (this
module starts nothing). ``can_measure`` says whether shapes measured here describe a profile's
machine (the shape cache and the speed history both ask it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..io import atomic_write_json, load_json_file
from .profile import _CHECKED_FIELDS, current_fingerprint
from .schema import PHASES

CACHE_SCHEMA = "autopar.shapes/1"


def cache_path(profile_path: str | Path) -> Path:
    p = Path(profile_path)
    return p.with_name(p.stem + "-shapes.json")


def can_measure(profile, world: int) -> str | None:
    """None when shapes measured here describe ``profile``'s machine at ``world`` ranks, else
    the reason they do not."""
    if profile.provenance.get("kind") != "measured":
        return f"the profile is {profile.provenance.get('kind')!r}, not measured here"
    here = current_fingerprint(profile.fingerprint.get("backend") or "gloo")
    diff = [k for k in _CHECKED_FIELDS if profile.fingerprint.get(k) != here.get(k)]
    if diff:
        return f"the profile was made on another machine or software ({', '.join(diff)})"
    topo = profile.provenance.get("measured_topology") or {}
    ranks = int(topo.get("ranks", 0)) or _measured_ranks(profile)
    if world > ranks:
        return f"world {world} is a simulated cluster (the profile measured {ranks} ranks)"
    return None


def _measured_ranks(profile) -> int:
    sizes = [int(k) for k in (profile.compute_slowdown or {}) if str(k).isdigit()]
    return max(sizes, default=1)


def _valid_entry(e: Any) -> bool:
    return isinstance(e, dict) and bool(e) and all(
        k in PHASES and isinstance(v, (int, float)) and v > 0 for k, v in e.items())


def load_cache(path: Path, fingerprint: dict) -> tuple[dict[str, dict], str | None]:
    """(exact entries, why the cache was not trusted or None). A missing cache is empty."""
    if not path.exists():
        return {}, None
    try:
        obj = load_json_file(path)
    except (OSError, ValueError) as e:
        return {}, f"unreadable ({e.__class__.__name__})"
    if not isinstance(obj, dict) or obj.get("schema") != CACHE_SCHEMA:
        return {}, "not an autopar shape cache (schema)"
    if obj.get("fingerprint") != fingerprint:
        return {}, "made for another machine or profile (fingerprint)"
    exact = obj.get("exact")
    if not isinstance(exact, dict) or not all(isinstance(k, str) and _valid_entry(v) for k, v in exact.items()):
        return {}, "corrupt entries"
    return exact, None


def write_cache(path: Path, fingerprint: dict, exact: dict[str, dict]) -> None:
    atomic_write_json(path, {"schema": CACHE_SCHEMA, "fingerprint": fingerprint,
                             "note": "exact local shapes measured on demand by `autopar plan` "
                                     "(autopar.calibrate.ondemand); delete to re-measure",
                             "exact": exact})
