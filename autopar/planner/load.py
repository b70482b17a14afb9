"""Stage 1, load: the request (options and hooks, normalized), the model file, the profile on
the cluster shape planned for, and the shape file named by the options. Reads files only."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

from ..artifacts import PlanHooks, PlanOptions
from ..decomp.graph.graphs import Graphs
from ..errors import AutoparError
from ..io import sha256_file
from ..modelfile import load_model_file
from ..pins import plan_level
from ..profile.profile import check_fingerprint, default_profile_path, load_profile
from ..profile.shapes import load_cache
from ..solve.placement import placements_for


def parse_bytes(text: str | None) -> float | None:
    """'512MiB', '2GB', '1.5GiB', '1000000' -> bytes."""
    if text is None:
        return None
    t = str(text).strip().lower().replace(" ", "")
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6,
             "gb": 1e9, "tb": 1e12, "k": 2**10, "m": 2**20, "g": 2**30, "b": 1}
    for u, f in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(u):
            try:
                return float(t[: -len(u)]) * f
            except ValueError:
                break
    try:
        return float(t)
    except ValueError:
        raise AutoparError(f"cannot read memory size {text!r}", "write e.g. 512MiB, 2GiB or a number of bytes") from None


@dataclass(frozen=True)
class Request:
    """What was asked, normalized: ``force`` (layer index -> choice, tests), ``force_graphs``
    (the plan-level graphs(P) asked for: ``--kinds graphs``, ``--pin '*=graphs'`` or ``force``
    naming graphs on every layer), the layer pins, and the kinds the cost table prices."""
    options: PlanOptions
    force: Mapping[int, str] | None
    force_graphs: bool
    layer_pins: tuple
    table_kinds: tuple[str, ...] | None
    choice_filter: Callable[[Any], bool] | None
    say: Callable[[str], None]

    @property
    def world(self) -> int:
        return self.options.world_size

    @property
    def memory_limit_bytes(self) -> float | None:
        return self.options.memory_limit_bytes

    @property
    def constrained(self) -> bool:
        """Layers pinned by a test's ``force`` or candidates filtered: the ILP's plan is kept."""
        return bool(self.force) or self.choice_filter is not None


def request(options: PlanOptions, hooks: PlanHooks, strategy_kinds: Collection[str] = ()) -> Request:
    """The request normalized. ``strategy_kinds``: the ``--kinds`` names plan-level strategies
    read, which the cost table does not price (``strategies.strategy_kinds``, checked and passed
    by ``planner.make``: the strategies sit above this stage)."""
    o = options
    force = hooks.force
    # ``force`` naming graphs(P) on every layer: the plan-level graph-parallel plan, whatever it costs
    force_graphs = bool(force) and all(str(v).split("(")[0] == Graphs.kind for v in force.values())
    if force_graphs:
        force = None
    layer_pins = tuple(o.pins)
    if layer_pins and plan_level(layer_pins, o.world_size):   # ``*=graphs``
        force_graphs, layer_pins = True, ()
    # a plan-level strategy's kinds (``graphs``, ``sharded``, ``zero1``...) are no layer choice
    # of the ILP: each strategy reads them; graphs(P) is asked for by naming its kind alone
    table_kinds = tuple(k for k in o.kinds if k not in strategy_kinds) if o.kinds else None
    if o.kinds and not table_kinds:
        force_graphs, table_kinds = Graphs.kind in o.kinds, None
    return Request(o, force, force_graphs, layer_pins, table_kinds, hooks.choice_filter,
                   hooks.progress or (lambda s: None))


@dataclass(frozen=True)
class ShapesUsed:
    """A shape file read into the profile's exact table (``--shapes``; the profile's own entries
    win): recorded in plan.json (``calibration.shapes``) so that a re-plan reads the same."""
    path: str
    sha256: str
    entries: int
    added: int        # entries the profile itself lacked

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Loaded:
    """The model file, batch, profile (on the planned cluster shape) and cluster shape."""
    model_file: Path
    mf: Any                      # ``modelfile.ModelFile`` (imported lazily: torch only to trace)
    batch_size: int
    profile: Any                 # ``profile.Profile`` with the planned topology
    cal_path: Path | None
    ranks_per_node: int
    nodes: int
    shapes: ShapesUsed | None


_LOADED: dict = {}   # (path, mtime, size) -> profile: a long-lived process re-plans without re-reading
_TOPOLOGY: dict = {}  # (profile read by load_calibration, rpn, nodes) -> (it, its copy for that shape)


def _with_topology(profile, rpn: int, n_nodes: int):
    """``profile.with_topology`` (a deep copy, raw samples and all) once per profile read by
    ``load_calibration`` and cluster shape; planning only reads it."""
    key = (id(profile), rpn, n_nodes)
    hit = _TOPOLOGY.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    if len(_TOPOLOGY) > 8:
        _TOPOLOGY.clear()
    out = profile.with_topology(rpn, n_nodes)
    _TOPOLOGY[key] = (profile, out)
    return out


def load_calibration(path: str | Path | None, check_machine: bool = True):
    """(path, profile); a profile file read before in this process and unchanged since (same
    modification time and size) is not read, validated and fitted again. Planning never
    changes the profile it is given (``Profile.with_topology`` copies)."""
    if path is None:
        path = default_profile_path()
    try:
        st = Path(path).stat()
        key = (str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    prof = _LOADED.get(key) if key is not None else None
    if prof is None:
        prof = load_profile(path, check_machine=False)
        if key is not None:
            _LOADED.clear()        # one profile kept: the one a session re-plans with
            _LOADED[key] = prof
    if check_machine and prof.provenance.get("kind") == "measured":
        check_fingerprint(prof, path)  # warns, naming the fields that differ
    return Path(path), prof


def with_shapes(profile, shapes_path: str | Path):
    """(the profile with the shape file's exact entries added, what was read). A shape file of
    another machine or profile, or a corrupt one, is refused by name."""
    path = Path(shapes_path)
    if not path.is_file():
        raise AutoparError(f"shape file {path} does not exist",
                           "measure it first (autopar plan ... --measure-shapes) or drop --shapes")
    exact, why = load_cache(path, profile.fingerprint)
    if why:
        raise AutoparError(f"shape file {path} is {why}",
                           "measure it again for this profile (autopar plan ... --measure-shapes)")
    added = sum(1 for k in exact if k not in profile.exact)
    used = ShapesUsed(str(path), sha256_file(path), len(exact), added)
    return dataclasses.replace(profile, exact={**exact, **profile.exact}), used


def load(model_file: str | Path, req: Request, hooks: PlanHooks) -> Loaded:
    """The model file (imported lazily), batch size, profile with the planned topology (and
    the named shape file), cluster shape; a bad ``--placement`` fails here, before tracing."""
    o = req.options
    if o.measure_shapes:
        raise AutoparError("make_plan starts no process: measure_shapes=True is a step before planning",
                           "run autopar.calibrate.shapes_step.measure_missing_shapes first (autopar plan "
                           "--measure-shapes), then plan with shapes=<the shape file>")
    mf = load_model_file(Path(model_file), lazy=True)   # imported (with torch) only if traced
    batch = o.batch_size if o.batch_size is not None else (mf.default_batch_size() or max(8, o.world_size))
    profile = hooks.profile
    if profile is None:
        cal_path, profile = load_calibration(o.calibration)
    else:
        cal_path = Path(o.calibration) if o.calibration else None
    shapes = None
    if o.shapes:
        profile, shapes = with_shapes(profile, o.shapes)
    rpn = int(o.ranks_per_node or profile.topology.get("ranks_per_node", o.world_size))
    n_nodes = int(o.nodes or max(1, math.ceil(o.world_size / rpn)))
    if rpn * n_nodes < o.world_size:
        raise AutoparError(f"{n_nodes} nodes x {rpn} ranks per node < world size {o.world_size}",
                           "raise --nodes or --ranks-per-node")
    if hooks.profile is None and shapes is None:
        profile = _with_topology(profile, rpn, n_nodes)
    else:
        profile = profile.with_topology(rpn, n_nodes)
    placements_for(o.placement, o.world_size, rpn)   # a bad --placement fails before tracing
    return Loaded(Path(model_file), mf, int(batch), profile, cal_path, rpn, n_nodes, shapes)
