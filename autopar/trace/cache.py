"""A cache of traced layer graphs, so that re-planning a model (another world size, cluster,
memory limit, a sweep) skips importing torch and tracing (about 1.5-2 s for ResNet-50 from a
cold process, most of it ``import torch``).

The key is a SHA-256 over everything the graph depends on: the model file and every other
``.py`` file in its folder (a model may import its neighbours), the batch size, every
``AUTOPAR_*`` environment variable (example models read their size from them), the torch and
autopar versions, and the source of the tracer itself (``autopar/trace/*.py`` with the recorder,
``decomp/ir.py`` and ``modelfile.py``, which says what of a model's output is kept), so a change to any of them is a miss. Entries are the graph's JSON (data,
never pickles), written atomically under ``$AUTOPAR_CACHE_DIR`` (default
``~/.cache/autopar/traces``); an unreadable entry is ignored and traced again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..decomp.ir import LayerGraphData
from .. import __version__
from ..io import atomic_write_json, load_json_file
from ..ops import FAMILIES
from .tracer import trace_model
from .units import merge_units

_SOURCES = [Path(__file__).parent / n for n in ("tracer.py", "recorder.py", "cache.py", "graph.py", "graph_items.py")] + \
    [Path(__file__).parent.parent / "decomp" / "ir.py", Path(__file__).parent.parent / "modelfile.py"] + \
    sorted((Path(__file__).parent.parent / "ops").glob("*.py"))   # the op registry classifies


def _families() -> list[str]:
    return sorted(f"{k}:{type(f).__module__ if not isinstance(f, type) else f.__module__}"
                  for k, f in FAMILIES.items())


#: AUTOPAR_ variables that say where state lives, not what the model is (not in the trace key)
_NOT_MODEL_ENV = frozenset({"AUTOPAR_CACHE_DIR", "AUTOPAR_SPEED_HISTORY"})


def cache_dir() -> Path:
    env = os.environ.get("AUTOPAR_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "autopar" / "traces"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _torch_version() -> str:
    """torch's version without importing torch (re-planning from the cache then never does)."""
    import sys
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    try:
        from importlib.metadata import version
        return version("torch")
    except Exception:
        import torch
        return torch.__version__


def trace_key(model_path: Path, batch_size: int) -> str:
    model_path = Path(model_path).resolve()
    parts = {
        "model": _sha(model_path),
        "siblings": {p.name: _sha(p) for p in sorted(model_path.parent.glob("*.py")) if p != model_path},
        "batch_size": int(batch_size),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("AUTOPAR_") and k not in _NOT_MODEL_ENV},
        "torch": _torch_version(),
        "autopar": __version__,
        "tracer": [_sha(p) for p in _SOURCES if p.is_file()],
        # families registered at run time (a model file's or a test's own) change the trace too
        "families": _families(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def load(key: str) -> LayerGraphData | None:
    path = cache_dir() / f"{key}.json"
    try:
        return LayerGraphData.from_json(load_json_file(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(key: str, graph: LayerGraphData) -> None:
    try:
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_json(d / f"{key}.json", graph.to_json())
    except OSError:
        pass   # a read-only home is no reason to fail a plan


def trace_cached(mf, batch_size: int, use_cache: bool = True) -> tuple[LayerGraphData, bool]:
    """(graph, True if it came from the cache) for model file ``mf`` at ``batch_size``, with
    the model file's ``PLANNING_UNITS`` merged into sub-graph units (``trace.units``; after
    the cache, which holds the traced chain layers)."""
    units = mf.planning_units()
    if not use_cache:
        return merge_units(trace_model(mf, batch_size), units), False
    key = trace_key(mf.path, batch_size)
    graph = load(key)
    if graph is not None:
        return merge_units(graph, units), True
    graph = trace_model(mf, batch_size)
    store(key, graph)
    return merge_units(graph, units), False
