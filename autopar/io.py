"""Artifact I/O: JSON only (plans and profiles are data, never code or pickles), written atomically.

The rule: this is the ONE module that reads or writes a JSON *file*. Elsewhere in ``autopar``
a file is written with ``atomic_write_json`` and read with ``read_json`` (a named error saying
what to do) or ``load_json_file`` (for a cache or a history that recovers on its own: it lets
``OSError`` / ``ValueError`` through). ``json.dumps`` / ``json.loads`` on strings held in memory
stay where they are used: a canonical text hashed as a cache key (``profile.keys``,
``cost.table``, ``trace.cache``), a message printed or put in a store (``runtime.entry``,
``tournament.runtime``), a checkpoint's opaque entry (``train.checkpoint``).
``tests/test_json_io.py`` holds every other module to it (AST: no ``json.load``/``json.dump``,
no ``json.loads`` of what a file read returned)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and ``os.replace``.

    A crash at any point leaves either the old file or the new one, never half of either.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; artifacts are ordinary files
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=False, allow_nan=False) + "\n")


def read_json(path: str | os.PathLike, error_cls: type[Exception], what: str) -> Any:
    """Read JSON or raise ``error_cls`` naming the file and what to do (missing / truncated)."""
    path = Path(path)
    if not path.is_file():
        raise error_cls(f"{what} not found: {path}", "check the path")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error_cls(f"{what} {path} is corrupt or truncated ({e.__class__.__name__}: {e})",
                        "regenerate it") from None


def load_json_file(path: str | os.PathLike) -> Any:
    """The JSON of ``path``, for a reader with its own recovery (a cache, a history): a missing
    or unreadable file is ``OSError``, a corrupt one ``ValueError`` (``JSONDecodeError`` and
    ``UnicodeDecodeError`` are both). Artifacts a user gave read with ``read_json`` instead."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
