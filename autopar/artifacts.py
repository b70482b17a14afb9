"""Typed artifacts: the plan, the run result, the multi-plan run file and the planning options,
as frozen values, and the ONE module that reads and writes them as JSON.

Pure: no torch, no solver, no tracer (the runtime imports this module). ``autopar.decomp`` (the
registry, ``Sharding``, ``RankMap``, the layer graph types) is imported lazily, only to check a
plan on load and to build what a caller asks for (``Plan.graph()``, ``LayerDecision.decomposition()``).

Schemas
-------
``autopar.plan/2`` (``Plan``), top-level keys::

    schema, created, autopar_version, plan_file
    model        {path, sha256, name, batch_size, tracer}                     ModelRef
    world_size   int (== mesh.world_size)
    mesh         {world_size, ranks_per_node, nodes, placement, ranks}         MeshInfo
                 placement {kind: "stride", local_stride: S}: which physical slot runs each
                 logical rank (``autopar.decomp.rankmap``); ranks: the global ranks the plan
                 runs on, in logical order (a plan file alone: 0..W-1; a run set places a plan on
                 other ranks of a larger world, see ``RunSet``)
    placement_search  {mode, chosen, chosen_name, min_gain, max_solved, tried: [{placement, name,
                 solved, step_time_s, gain_bound_s, step_time_at_least_s, note}]}: every placement
                 priced (``autopar.solve.placement``), or absent      PlacementSearchRecord
    calibration  {path, fingerprint, provenance, speed_probe_nominal_s, machine_speed, shapes}
                                                                           CalibrationRef
    solver       {solver, status, sol_status, time_s, gap, objective_s, variables, constraints,
                  notes, memory_limit_bytes, candidates, max_candidates_per_layer}  SolverInfo
    predicted    {step_time_s, fwd_s, bwd_s, grad_sync_s, exposed_comm_s, optimizer_s,
                  memory_per_rank_bytes, grad_sync_bytes}                   Prediction
    layers       [{layer, name, module, kinds, out_shape, decomposition, choice, in_placements,
                   out_placement, predicted (LayerCost JSON), source, exact_keys, alternatives,
                   illegal}]                                                 LayerDecision
    transitions  [{src, dst, value, src_placement, dst_placement, fwd_s, bwd_s}]
                                                                             TransitionDecision
    graph        the layer graph, ``LayerGraphData`` JSON kept as is       Plan.graph_json
    generated    file name of the generated module beside plan.json
    timings_s    seconds per planning stage
    batch_norm   {mode: "local" | "global", group: G | null}: the batch-norm statistics every
                 layer computes (``autopar.decomp.bn.BatchNormStats``); a plan without it is
                 "global" (what plans made before the choice computed)
    trainers     (tournament training only) the trainer level: T trainers of ``world_size``
                 ranks each, interval, pairing seed, what is exchanged, the metric, the data
                 split and the predicted figures (``TrainerLevel``); absent: one trainer
    padding      (``--graph-sizes`` only) the padding chosen for a padded GNN: policy
                 ("global_max" or "K_buckets"), sampling, per bucket its padded shape, the
                 fractions of graphs and steps, the predicted step and padded fractions of
                 nodes, edges and work, and every candidate priced (``PaddingInfo``,
                 ``autopar.cost.padding``); absent: the model's own fixed shape

Schema 1 -> 2: schema 2 only adds ``mesh.ranks`` (and makes ``mesh.placement`` explicit). A
schema-1 plan is therefore **migrated on load** (ranks 0..W-1, a missing placement = block):
lossless, announced by a ``PlanMigrated`` warning naming the file, never written back. Schema 2
-> 3: a layer's ``in_layouts``/``out_layout`` (``[[dim, parts], ...]`` or ``{"splits",
"partial"}``) become ``in_placements``/``out_placement``, placements on named mesh axes of the
world (``autopar.decomp.sharding``): ``{"mesh": {"shape": [4, 2], "names": ["N", "replica"]},
"placements": ["Shard(0)", "Replicate()"]}`` (``placements`` may also map axis names to
placements); migrated on load the same way, a layout that cannot be read refused naming the
field. A plan (of any schema) that states a spatially split window op's input as its owned
block (``Shard``) where the decomposition reads it with a halo (``HaloShard``, stated since
plans carry halos) is completed on load the same way (the halo follows from the op). So is a
plan (of any schema: schema-3 plans written before the rename) whose transitions name their
placements ``src_layout``/``dst_layout``: renamed ``src_placement``/``dst_placement``. The
warning says only what was migrated. Any other schema is refused with ``PlanFileError`` saying
to re-plan.

``autopar.run/1`` (``RunResult``): run.json of ``autopar execute``, unchanged in content.

Typed values
------------
Every field is a typed value; what stays JSON is a ``JsonObject`` (read-only, string keys, JSON
values, written back as read), in two uses only: (1) every record's ``extra``, the keys this
version does not know, kept so that a re-write loses nothing (a key added by a newer autopar or
another stage survives load -> write); (2) a sub-record whose owner is another module that reads
it itself: ``calibration.fingerprint`` / ``provenance`` (``autopar.profile``), ``machine_speed``
(``profile.history``), ``shapes`` (``profile.shapes``), a placement's ``{kind, local_stride}``,
a run's ``options``. ``Plan.graph_json`` stays the graph's JSON as read (``Plan.graph()`` builds
``LayerGraphData``; see the field). The records a plan holds from other stages
(``CalibrationRef``, ``PlacementSearchRecord``, ``RuntimeRecord``, ``TrainerPrediction``) are
written back with the keys they were read with, so plan.json and run.json are unchanged in
content by a load -> write (``tests/test_typed_artifacts.py``). A ``dict`` given for one of them
in code is read into the typed value; callers read the fields (a trainer level's per-dtype
figures, ``exchange_s_float64``..., are in ``TrainerPrediction.extra``).

``autopar.runset/1`` (``RunSet``): several plans run at once on disjoint sub-meshes of one world::

    {"schema": "autopar.runset/1", "world_size": W,
     "plans": [{"plan": "path/plan.json", "ranks": [0, 1]}, ...]}

Checks on load (``PlanFileError`` naming the unit and the field, before any process starts):
mesh ranks out of the world or repeated; sub-meshes of a run set that overlap (both plans and
the shared ranks named); a layer whose ``in_placements`` miss an input value, name a dim the
tensor lacks, split a dim more ways than its extent (a padded shard: pad it short), read a
halo wider than the smallest neighbour block (``HaloShard``), name a mesh
axis the mesh lacks, or whose mesh is not the world or names ranks outside it (likewise
``out_placement``); placements that disagree with the layer's decomposition; an unknown
decomposition kind.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .errors import AutoparError, PlanFileError, RunFileError  # noqa: F401  (RunFileError re-exported)
from .io import atomic_write_json, read_json
from .decomp import REGISTRY, decomposition_from_json
from .decomp.bn import LEGACY, BatchNormStats, MODES
from .decomp.ir import Layer, LayerGraphData
from .decomp.sharding import (HaloShard, PaddedShard, Partial, Replicate, Sharding, block_extent,
                               from_splits)
from .decomp.rankmap import RankMap
from .pins import parse_pins

PLAN_SCHEMA = "autopar.plan/3"
#: older plan schemas this autopar migrates on load (losslessly)
MIGRATED_PLAN_SCHEMAS = ("autopar.plan/1", "autopar.plan/2")
#: the JSON of a sharding whole on every rank, when a record has none
_WHOLE = {"mesh": {"shape": [1], "names": ["replica"]}, "placements": ["Replicate()"]}
RUN_SCHEMA = "autopar.run/1"
RUNSET_SCHEMA = "autopar.runset/1"
REPLAN = "re-plan (autopar plan) instead of editing plan.json by hand"


class PlanMigrated(UserWarning):
    """A plan of an older schema was migrated on load (losslessly); re-plan to silence it."""


def _bad(src: str, unit: str, fld: str, what: str, hint: str = REPLAN) -> PlanFileError:
    return PlanFileError(f"{src}: {unit}, field {fld}: {what}", hint)


# ---- flat records: known fields typed, unknown keys kept (``extra``) for forward compatibility --

class _Record:
    """A frozen JSON object: every dataclass field but ``extra`` is a key; unknown keys are kept
    in ``extra`` and written back, so a field added by another stage survives a round trip."""

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else _plain(v)
        out.update(_extra_json(self))
        return out

    def __post_init__(self) -> None:
        if "extra" in {f.name for f in fields(self)}:  # type: ignore[arg-type]
            object.__setattr__(self, "extra", _json_object(getattr(self, "extra")))

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]):
        names = {f.name for f in fields(cls)} - {"extra"}  # type: ignore[arg-type]
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in obj.items() if k in names}
        extra = {k: v for k, v in obj.items() if k not in names}
        if "extra" in {f.name for f in fields(cls)}:  # type: ignore[arg-type]
            kw["extra"] = JsonObject(extra)
        return cls(**kw)


class _Sparse(_Record):
    """A record written back with the keys it was read with (a field the file lacked stays out);
    one made in code writes its fields that are set (not None)."""

    def to_json(self) -> dict[str, Any]:
        present = getattr(self, "present", ())
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            if f.name in ("extra", "present"):
                continue
            v = getattr(self, f.name)
            if (f.name in present) if present else v is not None:
                out[f.name] = _plain(v)
        out.update(_extra_json(self))
        return out

    @classmethod
    def read(cls, obj: Mapping[str, Any], nested: Mapping[str, Callable[[Any], Any]] | None = None):
        """From JSON: ``nested`` builds the typed value of those keys."""
        names = {f.name for f in fields(cls)} - {"extra", "present"}  # type: ignore[arg-type]
        kw = {k: (nested[k](v) if nested and k in nested and v is not None else _frozen(v))
              for k, v in obj.items() if k in names}
        return cls(**kw, extra=JsonObject({k: v for k, v in obj.items() if k not in names}),
                   present=tuple(k for k in obj if k in names))


def _frozen(v):
    return tuple(_frozen(x) for x in v) if isinstance(v, list) else v


class JsonObject(Mapping[str, Any]):
    """A read-only JSON object, kept as read: a ``Mapping`` with string keys whose values are
    JSON (numbers, strings, None, lists, objects) and are not to be changed.

    Two uses only (the module docstring says which fields): a record's ``extra``, the keys this
    version does not know, kept so that a re-write loses nothing; and a sub-record whose owner
    is another module that reads it itself (a profile's fingerprint, a shape file's record).
    ``to_json()``: a plain ``dict`` (a deep copy)."""
    __slots__ = ("_d",)

    def __init__(self, obj: Mapping[str, Any] | None = None) -> None:
        d = dict(obj.to_json() if isinstance(obj, JsonObject) else (obj or {}))
        bad = [k for k in d if not isinstance(k, str)]
        if bad:
            raise TypeError(f"JSON object keys must be strings, got {bad[:3]!r}")
        self._d = d

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"JsonObject({self._d!r})"

    def to_json(self) -> dict[str, Any]:
        return copy.deepcopy(self._d)


def _json_object(v: Any) -> JsonObject:
    return v if isinstance(v, JsonObject) else JsonObject(v)


def _plain(v):
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v.to_json() if hasattr(v, "to_json") else v


def _extra_json(rec: Any) -> dict[str, Any]:
    """A record's unknown keys (``extra``) as plain JSON, to be written after its own."""
    extra = getattr(rec, "extra", None)
    return extra.to_json() if isinstance(extra, JsonObject) else dict(extra or {})


@dataclass(frozen=True)
class ModelRef(_Record):
    """The model file a plan was made from (``path`` relative to the plan's folder)."""
    path: str
    sha256: str
    name: str
    batch_size: int
    tracer: str = ""
    extra: JsonObject = field(default_factory=JsonObject)


@dataclass(frozen=True)
class Prediction(_Record):
    """Predicted step (seconds, bytes per rank); the cost model's figures, never measured."""
    step_time_s: float
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    grad_sync_s: float = 0.0
    exposed_comm_s: float = 0.0
    optimizer_s: float = 0.0
    memory_per_rank_bytes: float = 0.0
    grad_sync_bytes: float = 0.0
    extra: JsonObject = field(default_factory=JsonObject)


@dataclass(frozen=True)
class SolverInfo(_Record):
    """How the ILP was solved (``autopar.solve.ilp.Solution`` plus what the planner added)."""
    solver: str
    status: str
    sol_status: int | None = None
    time_s: float = 0.0
    gap: float | None = None
    objective_s: float | None = None
    variables: int = 0
    constraints: int = 0
    notes: tuple[str, ...] = ()
    memory_limit_bytes: float | None = None
    candidates: Mapping[str, int] = field(default_factory=dict)
    max_candidates_per_layer: int | None = None
    extra: JsonObject = field(default_factory=JsonObject)


@dataclass(frozen=True)
class TransitionDecision(_Record):
    """A redistribution of value ``value`` between layer ``src`` and layer ``dst``: from the
    placement ``src_placement`` its producer writes to the placement ``dst_placement`` its
    reader reads (each ``Sharding``'s text, e.g. ``Shard(0)@N4``)."""
    src: int
    dst: int
    value: str
    src_placement: str
    dst_placement: str
    fwd_s: float
    bwd_s: float
    extra: JsonObject = field(default_factory=JsonObject)


@dataclass(frozen=True)
class LayerPrice(_Record):
    """What the cost model predicted for one layer under its decomposition, per rank (the
    slowest), as ``autopar.decomp.base.LayerCost`` prices it (the plan file's
    ``layers[].predicted``): seconds of compute and exposed communication per pass, the gradient
    all-reduce, bytes held, what priced the compute (``source``: exact, fit, mixed)."""
    fwd_compute_s: float = 0.0
    bwd_compute_s: float = 0.0
    fwd_comm_s: float = 0.0
    bwd_comm_s: float = 0.0
    grad_sync_s: float = 0.0
    grad_sync_bytes: float = 0.0
    param_bytes: float = 0.0
    grad_bytes: float = 0.0
    optim_bytes: float = 0.0
    activation_bytes: float = 0.0
    workspace_bytes: float = 0.0
    source: str = ""
    optim_step_s: float = 0.0
    grad_sync_latency: tuple = ()
    memory_bytes: float = 0.0
    extra: JsonObject = field(default_factory=JsonObject)

    @property
    def compute_s(self) -> float:
        return self.fwd_compute_s + self.bwd_compute_s

    @property
    def comm_s(self) -> float:
        return self.fwd_comm_s + self.bwd_comm_s

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out["grad_sync_latency"] = [list(x) for x in self.grad_sync_latency]
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "LayerPrice":
        obj = dict(obj or {})
        lat = tuple(tuple(x) for x in obj.pop("grad_sync_latency", None) or ())
        return dataclasses.replace(super().from_json(obj), grad_sync_latency=lat)


@dataclass(frozen=True)
class LayerAlternative(_Record):
    """A kept candidate of a layer (``layers[].alternatives``): its choice, its time (forward,
    backward and gradient sync) and its memory per rank."""
    choice: str
    time_s: float = 0.0
    memory_bytes: float = 0.0
    extra: JsonObject = field(default_factory=JsonObject)


@dataclass(frozen=True)
class RuntimeRecord(_Sparse):
    """Which runtime the planner expects the plan to run on (plan.json ``runtime``): "native"
    (the user's module on each rank) or "traced" (op by op), its predicted step, why, and the
    comparison with the native data-parallel plan (``autopar.cost.native.RuntimeChoice``;
    absent fields: a plan-level strategy's own record). Written back with the keys it was read
    with."""
    expected: str
    step_time_s: float | None = None
    ilp_step_time_s: float | None = None
    native_data_parallel_step_time_s: float | None = None
    op_by_op_runtime_gap_s: float | None = None
    grad_reducer_s: float | None = None
    ops: int | None = None
    reason: str = ""
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "RuntimeRecord":
        return cls.read(obj)


def _placements(obj, layer: Any, fld: str):
    """A ``Sharding`` from its JSON (``{"mesh": {"shape", "names"[, "ranks"]}, "placements":
    [...]}``; ``placements`` may also map axis names to placements, the axes not named being
    ``Replicate()``); a malformed one is a ``PlanFileError`` naming the layer and the field."""
    if isinstance(obj, Sharding):
        return obj
    try:
        if isinstance(obj, Mapping) and isinstance(obj.get("placements"), Mapping):
            names = list((obj.get("mesh") or {}).get("names") or ())
            unknown = [a for a in obj["placements"] if a not in names]
            if unknown:
                raise PlanFileError(f"layer {layer}, field {fld}.placements: names mesh axis {unknown[0]!r}, "
                                    f"which the mesh {names} lacks", "name an axis of the mesh, or re-plan")
            obj = {**obj, "placements": [obj["placements"].get(a, "Replicate()") for a in names]}
        return Sharding.from_json(dict(obj) if isinstance(obj, Mapping) else obj)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise PlanFileError(f"layer {layer}, field {fld}: malformed placements {obj!r} ({e})",
                            "re-plan (`autopar plan`) instead of editing placements by hand") from None


@dataclass(frozen=True)
class DecompositionRef:
    """A layer's decomposition as plan.json names it (key ``decomposition``): its ``kind`` and
    its parameters, the fields of that kind's ``Decomposition`` dataclass in file order (e.g.
    ``parts``, ``grid``); ``LayerDecision.decomposition()`` builds the value from it. A kind the
    registry lacks is kept as read, so that the plan check names the layer and the field."""
    kind: str
    params: tuple[tuple[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **{k: _plain(v) for k, v in self.params}}

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> "DecompositionRef":
        obj = dict(obj)
        kind = obj.pop("kind")
        return DecompositionRef(str(kind), tuple((str(k), _frozen(v)) for k, v in obj.items()))


@dataclass(frozen=True)
class LayerDecision:
    """One layer's decomposition and what the cost model predicted for it.

    ``in_placements`` / ``out_placement``: a ``Sharding`` per value (``autopar.decomp.sharding``;
    JSON ``{"mesh": {"shape": [4, 2], "names": ["N", "replica"]}, "placements": ["Shard(0)",
    "Replicate()"]}``, the mesh being the whole world);
    ``decomposition_ref`` names the decomposition (key ``decomposition`` in the file)."""
    layer: int
    name: str
    module: str
    kinds: tuple[str, ...]
    out_shape: tuple[int, ...]
    decomposition_ref: DecompositionRef     # kind and parameters; ``decomposition()`` builds the value
    choice: str
    in_placements: "Mapping[str, Sharding]"    # value -> Sharding
    out_placement: "Sharding"
    predicted: LayerPrice                 # the cost model's price of this layer
    source: str = ""
    exact_keys: tuple[str, ...] = ()
    alternatives: tuple[LayerAlternative, ...] = ()
    # candidates the layer could not take: str(decomposition) -> why (``cost.table``)
    illegal: Mapping[str, str] = field(default_factory=dict)
    extra: JsonObject = field(default_factory=JsonObject)
    # the pin that fixed this layer's choice (``autopar.pins``, ``--pin``: "PATTERN=WANT"), or
    # "" when the solver chose it; in the file only when set
    pinned: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "illegal", JsonObject({str(k): str(v) for k, v in dict(self.illegal or {}).items()}))
        object.__setattr__(self, "extra", _json_object(self.extra))

    _KEYS = ("layer", "name", "module", "kinds", "out_shape", "decomposition", "choice",
             "in_placements", "out_placement", "predicted", "source", "exact_keys", "alternatives",
             "illegal", "pinned")

    @property
    def kind(self) -> str:
        return self.decomposition_ref.kind

    def decomposition(self):
        """The ``Decomposition`` value (``autopar.decomp``), built on each call."""
        return decomposition_from_json(self.decomposition_ref.to_json())

    # predicted seconds of this layer (the cost model's, see ``predicted``)
    @property
    def fwd_s(self) -> float:
        return self.predicted.fwd_compute_s + self.predicted.fwd_comm_s

    @property
    def bwd_s(self) -> float:
        return self.predicted.bwd_compute_s + self.predicted.bwd_comm_s

    @property
    def grad_sync_s(self) -> float:
        return self.predicted.grad_sync_s

    @property
    def memory_bytes(self) -> float:
        return self.predicted.memory_bytes

    def to_json(self, world: int) -> dict[str, Any]:
        """The plan file's record; the placements on the mesh of ``world`` ranks."""
        out = {"layer": self.layer, "name": self.name, "module": self.module,
               "kinds": list(self.kinds), "out_shape": list(self.out_shape),
               "decomposition": self.decomposition_ref.to_json(), "choice": self.choice,
               "in_placements": {v: sh.to_json(world) for v, sh in self.in_placements.items()},
               "out_placement": self.out_placement.to_json(world),
               "predicted": self.predicted.to_json(), "source": self.source,
               "exact_keys": list(self.exact_keys), "alternatives": [a.to_json() for a in self.alternatives],
               "illegal": self.illegal.to_json()}
        if self.pinned:
            out["pinned"] = self.pinned
        out.update(_extra_json(self))
        return out

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> "LayerDecision":
        return LayerDecision(
            layer=int(obj["layer"]), name=str(obj.get("name", "")), module=str(obj.get("module") or ""),
            kinds=tuple(obj.get("kinds", ())), out_shape=tuple(int(x) for x in obj.get("out_shape", ())),
            decomposition_ref=DecompositionRef.from_json(obj["decomposition"]), choice=str(obj.get("choice", "")),
            in_placements={str(v): _placements(sh, obj["layer"], f"in_placements[{v!r}]")
                           for v, sh in (obj.get("in_placements") or {}).items()},
            out_placement=_placements(obj.get("out_placement") or _WHOLE, obj["layer"], "out_placement"),
            predicted=LayerPrice.from_json(obj.get("predicted") or {}), source=str(obj.get("source", "")),
            exact_keys=tuple(obj.get("exact_keys") or ()),
            alternatives=tuple(LayerAlternative.from_json(a) for a in obj.get("alternatives") or ()),
            illegal=dict(obj.get("illegal") or {}),
            extra=JsonObject({k: v for k, v in obj.items() if k not in LayerDecision._KEYS}),
            pinned=str(obj.get("pinned") or ""))


@dataclass(frozen=True)
class MeshInfo:
    """The ranks a plan runs on: ``world_size`` ranks, ``ranks_per_node`` per node, ``nodes``
    nodes, the rank placement (local stride, 1 = block) and ``ranks``: the global ranks in
    logical order (default ``0..world_size-1``)."""
    world_size: int
    ranks_per_node: int
    nodes: int
    local_stride: int = 1
    ranks: tuple[int, ...] | None = None
    extra: JsonObject = field(default_factory=JsonObject)

    def __post_init__(self) -> None:
        object.__setattr__(self, "world_size", int(self.world_size))
        if self.ranks is None:
            object.__setattr__(self, "ranks", tuple(range(self.world_size)))
        else:
            object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "extra", _json_object(self.extra))

    def placement(self):
        """The ``RankMap`` (``autopar.decomp.rankmap``) the runtime applies at init."""
        return RankMap(self.world_size, self.local_stride)

    @property
    def placement_json(self) -> dict[str, Any]:
        return {"kind": "stride", "local_stride": self.local_stride}

    def to_json(self) -> dict[str, Any]:
        out = {"world_size": self.world_size, "ranks_per_node": self.ranks_per_node, "nodes": self.nodes,
               "placement": self.placement_json, "ranks": list(self.ranks or ())}
        out.update(_extra_json(self))
        return out

    @staticmethod
    def from_json(obj: Mapping[str, Any], src: str = "plan") -> "MeshInfo":
        pl = obj.get("placement")
        if pl is None:
            stride = 1
        elif isinstance(pl, Mapping) and pl.get("kind") == "stride" and isinstance(pl.get("local_stride"), int):
            stride = int(pl["local_stride"])
        else:
            raise _bad(src, "mesh", "mesh.placement", f"unknown placement {pl!r} "
                       '(expected {"kind": "stride", "local_stride": S})')
        known = {"world_size", "ranks_per_node", "nodes", "placement", "ranks"}
        try:
            return MeshInfo(world_size=int(obj["world_size"]), ranks_per_node=int(obj["ranks_per_node"]),
                            nodes=int(obj["nodes"]), local_stride=stride,
                            ranks=None if obj.get("ranks") is None else tuple(obj["ranks"]),
                            extra=JsonObject({k: v for k, v in obj.items() if k not in known}))
        except KeyError as e:
            raise _bad(src, "mesh", f"mesh.{e.args[0]}", "missing") from None
        except (TypeError, ValueError) as e:
            raise _bad(src, "mesh", "mesh", f"not integers ({e})") from None


@dataclass(frozen=True)
class TrainerPrediction(_Sparse):
    """The cost model's figures of a trainer level (``autopar.tournament.pricing``; plan.json
    ``trainers.predicted``, and in a tournament's run.json ``predicted`` with ``priced_dtype``,
    the dtype the exchange figures were taken in). Seconds, bytes, samples per second; the
    per-dtype figures (``exchange_s_float64``, ...) are in ``extra``, read by name. Written back
    with the keys it was read with."""
    trainers: int | None = None
    ranks_per_trainer: int | None = None
    world_size: int | None = None
    batch_per_trainer: int | None = None
    interval_steps: int | None = None
    step_s: float | None = None
    plan_step_s: float | None = None
    colocation_slowdown: float | None = None
    ingest_s: float | None = None
    data_in_memory: bool | None = None
    shard_bytes: float | None = None
    data_store_bytes_per_rank: float | None = None
    storage_read_bytes_per_s: float | None = None
    ingestion_source: str | None = None
    exchange_s: float | None = None
    exchange_bytes_per_rank: float | None = None
    exchange_link: str | None = None
    eval_s: float | None = None
    tournament_s: float | None = None
    round_s: float | None = None
    tournament_overhead: float | None = None
    samples_per_s: float | None = None
    memory_per_rank_bytes: float | None = None
    memory_limit_bytes: float | None = None
    priced_dtype: str | None = None
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | None) -> "TrainerPrediction":
        return obj if isinstance(obj, TrainerPrediction) else cls.read(obj or {})


TOURNAMENT_EXCHANGES = ("weights", "weights+optimizer")
TOURNAMENT_METRICS = ("loss", "model_file")


@dataclass(frozen=True)
class TrainerLevel(_Record):
    """The trainer level of tournament training (LTFB, ``autopar.tournament``): ``trainers``
    trainers, each running the plan on its own ``ranks_per_trainer`` ranks (trainer t on global
    ranks ``[t*n, (t+1)*n)``), a tournament every ``interval_steps`` steps paired with
    ``pairing_seed``, exchanging ``exchange`` ("weights" or "weights+optimizer"), judged by
    ``metric`` ("loss": the loss on the trainer's held-out tournament set; "model_file": the
    model file's ``tournament_metric``; lower wins). Each trainer trains on
    ``train_samples_per_trainer`` samples of its shard and holds out ``tournament_samples``.
    ``predicted``: the cost model's figures (``autopar.tournament.pricing``); ``candidates``:
    every trainer count priced (``--trainers auto``)."""
    trainers: int
    ranks_per_trainer: int
    interval_steps: int = 10
    pairing_seed: int = 0
    exchange: str = "weights"
    metric: str = "loss"
    train_samples_per_trainer: int = 0
    tournament_samples: int = 0
    data_seed: int = 0
    predicted: TrainerPrediction = field(default_factory=TrainerPrediction)
    candidates: tuple = ()
    extra: JsonObject = field(default_factory=JsonObject)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "predicted", TrainerPrediction.from_json(self.predicted))

    @property
    def world_size(self) -> int:
        return self.trainers * self.ranks_per_trainer

    def trainer_ranks(self, t: int) -> tuple[int, ...]:
        """Global ranks of trainer ``t`` (its sub-mesh, in mesh order)."""
        n = self.ranks_per_trainer
        return tuple(range(t * n, (t + 1) * n))


def check_trainer_level(tl: TrainerLevel, plan_world: int, batch_size: int, src: str) -> None:
    """A trainer level that the runtime can run (named field otherwise)."""
    def bad(fld, what):
        return _bad(src, "trainers", f"trainers.{fld}", what)
    for fld in ("trainers", "ranks_per_trainer", "interval_steps"):
        v = getattr(tl, fld)
        if not isinstance(v, int) or v < 1:
            raise bad(fld, f"{v!r} (must be an integer >= 1)")
    if tl.ranks_per_trainer != plan_world:
        raise bad("ranks_per_trainer", f"{tl.ranks_per_trainer} but the trainer's plan is for "
                  f"{plan_world} ranks (world_size)")
    if tl.exchange not in TOURNAMENT_EXCHANGES:
        raise bad("exchange", f"{tl.exchange!r} (one of {', '.join(TOURNAMENT_EXCHANGES)})")
    if tl.metric not in TOURNAMENT_METRICS:
        raise bad("metric", f"{tl.metric!r} (one of {', '.join(TOURNAMENT_METRICS)})")
    b = max(1, int(batch_size))
    for fld in ("train_samples_per_trainer", "tournament_samples"):
        v = getattr(tl, fld)
        if not isinstance(v, int) or v < b or v % b:
            raise bad(fld, f"{v!r} (must be a positive multiple of the batch size {b})")


@dataclass(frozen=True)
class PaddingInfo(_Record):
    """The padding decision of a padded GNN plan (``autopar.cost.padding``): ``buckets`` one
    record per padded shape ({nodes, edges, graph_fraction, step_fraction, step_time_s,
    padded_node_fraction, padded_edge_fraction, padded_work_fraction, plan}); this plan.json is
    the plan of the largest shape, ``plan`` names the others' plan files (relative to it)."""
    policy: str
    sampling: str
    buckets: tuple = ()
    expected_step_time_s: float = 0.0
    padded_work_fraction: float = 0.0
    rank_imbalance: float = 0.0
    distinct_shapes: int = 1
    extra: JsonObject = field(default_factory=JsonObject)


@dataclass(frozen=True)
class StrategyAlternative(_Record):
    """One whole-plan candidate a plan-level strategy offered (``autopar.planner.strategies``):
    its prediction, or why it was illegal, and whether it was chosen."""
    strategy: str
    label: str
    step_time_s: float | None = None
    memory_per_rank_bytes: float | None = None
    illegal: str | None = None
    chosen: bool = False
    extra: JsonObject = field(default_factory=JsonObject)


@dataclass(frozen=True)
class CalibrationRef(_Sparse):
    """Where a plan's prices came from (plan.json ``calibration``, ``planner.build``): the
    profile's ``path`` (as given when planning; ``explain`` re-prices with it), its
    ``fingerprint`` and ``provenance`` (``autopar.profile``'s, kept as read), its nominal
    speed-probe reading (``speed_probe_nominal_s``; ``execute`` compares the machine's reading
    with it), the machine speed the local compute was priced at (``machine_speed``,
    ``profile.history.MachineSpeed``) and the shape file read (``shapes``,
    ``profile.shapes``), if any. Written back with the keys it was read with."""
    path: str | None = None
    fingerprint: JsonObject | None = None
    provenance: JsonObject | None = None
    speed_probe_nominal_s: float | None = None
    machine_speed: JsonObject | None = None
    shapes: JsonObject | None = None
    shapes_on_demand: JsonObject | None = None
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)

    _OBJECTS = ("fingerprint", "provenance", "machine_speed", "shapes", "shapes_on_demand")

    @property
    def speed_factor(self) -> float:
        """The factor the local compute was priced with (1.0 without the speed history)."""
        return float((self.machine_speed or {}).get("speed_factor", 1.0))

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | None) -> "CalibrationRef":
        if isinstance(obj, CalibrationRef):
            return obj
        return cls.read(obj or {}, {k: _json_object for k in cls._OBJECTS})


@dataclass(frozen=True)
class PlacementTrialRecord(_Sparse):
    """One rank placement the search priced (``autopar.solve.placement.PlacementTrial``): the
    placement (``{kind: "stride", local_stride}``) and its name, whether the ILP was solved
    for it, its step, and for one not solved the bound on its gain that ruled it out."""
    placement: JsonObject | None = None
    name: str | None = None
    solved: bool | None = None
    step_time_s: float | None = None
    gain_bound_s: float | None = None
    step_time_at_least_s: float | None = None
    note: str | None = None
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class PlacementSearchRecord(_Sparse):
    """Every rank placement priced (plan.json ``placement_search``,
    ``autopar.solve.placement.PlacementResult``): the ``mode`` ("search", "block", a stride),
    the placement chosen and its name, the search's limits and each placement ``tried``."""
    mode: str | int | None = None
    chosen: JsonObject | None = None
    chosen_name: str | None = None
    min_gain: float | None = None
    max_solved: int | None = None
    tried: tuple[PlacementTrialRecord, ...] = ()
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "PlacementSearchRecord":
        if isinstance(obj, PlacementSearchRecord):
            return obj
        return cls.read(obj, {"chosen": _json_object,
                              "tried": lambda ts: tuple(PlacementTrialRecord.read(t, {"placement": _json_object})
                                                        for t in ts)})


@dataclass(frozen=True)
class Plan:
    """A plan: one decision per layer of ``graph_json``, the transitions between them, what the
    cost model predicts, and where it came from. Loadable without a process group."""
    model: ModelRef
    mesh: MeshInfo
    calibration: CalibrationRef           # a dict is read into one
    solver: SolverInfo
    predicted: Prediction
    layers: tuple[LayerDecision, ...]
    transitions: tuple[TransitionDecision, ...]
    # the layer graph's JSON, kept as read: ``graph()`` builds the typed ``LayerGraphData`` on
    # each call; parsing it on load (the 96-layer GPT: ~10^4 op records) would cost every reader
    # of a plan and gain nothing the plan check does not already read from it
    graph_json: Mapping[str, Any]
    generated: str
    created: str = ""
    autopar_version: str = ""
    plan_file: str = "plan.json"
    placement_search: PlacementSearchRecord | None = None   # a dict is read into one
    timings_s: Mapping[str, float] = field(default_factory=dict)
    schema: str = PLAN_SCHEMA
    extra: JsonObject = field(default_factory=JsonObject)
    # a dict ({mode, group}) is read into one; absent from a file: global (``decomp.bn.LEGACY``)
    batch_norm: BatchNormStats = field(default_factory=BatchNormStats)
    trainers: TrainerLevel | None = None   # tournament training (LTFB); None: one trainer
    padding: PaddingInfo | None = None     # padded GNN (--graph-sizes); None: the model's own shape
    options: "PlanOptions | None" = None   # the planning options it was made with (pins included)
    # every whole-plan candidate priced by the plan-level strategies, the chosen one marked
    # (plans made before the strategies seam: empty)
    strategies: tuple[StrategyAlternative, ...] = ()
    # the runtime the planner expects (plan.json ``runtime``); None: a plan made without it
    runtime: RuntimeRecord | None = None

    _KEYS = ("schema", "created", "autopar_version", "plan_file", "model", "world_size", "mesh",
             "placement_search", "calibration", "solver", "predicted", "layers", "transitions",
             "graph", "generated", "timings_s", "batch_norm", "trainers", "padding", "options",
             "strategies", "runtime")

    def __post_init__(self) -> None:
        object.__setattr__(self, "calibration", CalibrationRef.from_json(self.calibration))
        if self.placement_search is not None:
            object.__setattr__(self, "placement_search", PlacementSearchRecord.from_json(self.placement_search))
        if not isinstance(self.batch_norm, BatchNormStats):
            object.__setattr__(self, "batch_norm", BatchNormStats.from_json(self.batch_norm))
        object.__setattr__(self, "extra", _json_object(self.extra))

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def graph(self):
        """The layer graph (``autopar.decomp.ir.LayerGraphData``), built anew on each call from
        ``graph_json`` (so no caller can change another's copy)."""
        return LayerGraphData.from_json(self.graph_json)

    def placement(self):
        return self.mesh.placement()

    def model_file(self, plan_file: str | Path) -> Path:
        """The model file, its stored path read relative to the plan file's folder."""
        p = Path(self.model.path)
        return p if p.is_absolute() else (Path(plan_file).resolve().parent / p).resolve()

    def model_env(self) -> dict[str, str]:
        """Environment variables the model file must be imported with to build the model this
        plan was made for (a padded GNN's padded sizes, ``padding.env``); empty otherwise."""
        if self.padding is None:
            return {}
        return {str(k): str(v) for k, v in (self.padding.extra.get("env") or {}).items()}

    def bn_stats(self):
        """The batch-norm statistics (``autopar.decomp.bn.BatchNormStats``) the plan computes."""
        return self.batch_norm

    def layer(self, index: int) -> LayerDecision:
        for d in self.layers:
            if d.layer == index:
                return d
        raise KeyError(index)

    def decompositions(self) -> list[str]:
        """The distinct decompositions used, sorted (``choice`` strings)."""
        return sorted({d.choice for d in self.layers})

    def with_ranks(self, ranks: Sequence[int]) -> "Plan":
        """The same plan placed on the global ranks ``ranks`` (a run set's sub-mesh)."""
        return dataclasses.replace(self, mesh=dataclasses.replace(self.mesh, ranks=tuple(ranks)))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": self.schema, "created": self.created, "autopar_version": self.autopar_version,
            "plan_file": self.plan_file, "model": self.model.to_json(), "world_size": self.world_size,
            "mesh": self.mesh.to_json()}
        if self.placement_search is not None:
            out["placement_search"] = self.placement_search.to_json()
        out.update({
            "calibration": self.calibration.to_json(), "solver": self.solver.to_json(),
            "predicted": self.predicted.to_json(), "layers": [d.to_json(self.world_size) for d in self.layers],
            "transitions": [t.to_json() for t in self.transitions], "graph": dict(self.graph_json),
            "generated": self.generated, "timings_s": dict(self.timings_s),
            "batch_norm": self.batch_norm.to_json()})
        if self.trainers is not None:
            out["trainers"] = self.trainers.to_json()
        if self.padding is not None:
            out["padding"] = self.padding.to_json()
        if self.options is not None:
            out["options"] = self.options.to_json()
        if self.strategies:
            out["strategies"] = [a.to_json() for a in self.strategies]
        if self.runtime is not None:
            out["runtime"] = self.runtime.to_json()
        out.update(_extra_json(self))
        return out

    @staticmethod
    def from_json(obj: Mapping[str, Any], src: str = "plan", world_size: int | None = None) -> "Plan":
        """Parse and check a plan (any schema this autopar reads; schema 1 is migrated, with a
        ``PlanMigrated`` warning naming ``src``). ``PlanFileError`` names the unit and field."""
        if not isinstance(obj, Mapping) or "schema" not in obj:
            raise PlanFileError(f"{src} is not an autopar plan (no schema field)", "run `autopar plan` to make one")
        obj, migrated = _migrate(dict(obj), src)
        missing = [k for k in ("model", "world_size", "mesh", "calibration", "solver", "predicted",
                               "layers", "graph", "generated") if k not in obj]
        if missing:
            raise PlanFileError(f"{src} is incomplete: missing {', '.join(missing)}", "re-plan")
        try:
            model = ModelRef.from_json(obj["model"])
        except TypeError as e:
            raise _bad(src, "model", "model", f"malformed ({e})") from None
        mesh = MeshInfo.from_json(obj["mesh"], src)
        try:
            solver = SolverInfo.from_json(obj["solver"])
            predicted = Prediction.from_json(obj["predicted"])
        except TypeError as e:
            raise _bad(src, "plan", "solver/predicted", f"malformed ({e})") from None
        layers = []
        for i, d in enumerate(obj["layers"]):
            if isinstance(d, Mapping):
                unit = f"layer {d.get('layer', i)} ({d.get('module') or d.get('name', '')})"
                for v, sj in (d.get("in_placements") or {}).items():
                    check_mesh_json(sj, mesh.world_size, src, unit, f"layers[{i}].in_placements[{v!r}]")
                check_mesh_json(d.get("out_placement"), mesh.world_size, src, unit, f"layers[{i}].out_placement")
            try:
                layers.append(LayerDecision.from_json(d))
            except PlanFileError as e:
                raise PlanFileError(f"{src}: {e.message}", e.hint) from None
            except (KeyError, TypeError, ValueError) as e:
                raise _bad(src, f"layers[{i}]", f"layers[{i}]", f"malformed ({e.__class__.__name__}: {e})") from None
        trans = []
        for i, t in enumerate(obj.get("transitions") or ()):
            try:
                trans.append(TransitionDecision.from_json(t))
            except TypeError as e:
                raise _bad(src, f"transitions[{i}]", f"transitions[{i}]", f"malformed ({e})") from None
        bn = obj.get("batch_norm") or LEGACY
        if not isinstance(bn, Mapping) or bn.get("mode") not in MODES:
            raise _bad(src, "plan", "batch_norm.mode", f"{bn!r}: the mode must be one of {MODES}")
        grp = bn.get("group")
        if bn["mode"] == "local" and (not isinstance(grp, int) or isinstance(grp, bool) or grp < 1):
            raise _bad(src, "plan", "batch_norm.group", f"{grp!r} is not a positive number of samples")
        try:
            calibration = CalibrationRef.from_json(obj["calibration"])
            search = None if obj.get("placement_search") is None else PlacementSearchRecord.from_json(obj["placement_search"])
        except (TypeError, AttributeError) as e:
            raise _bad(src, "plan", "calibration/placement_search", f"malformed ({e})") from None
        plan = Plan(model=model, mesh=mesh, calibration=calibration, solver=solver,
                    predicted=predicted, layers=tuple(layers), transitions=tuple(trans),
                    graph_json=obj["graph"], generated=str(obj["generated"]),
                    created=str(obj.get("created", "")), autopar_version=str(obj.get("autopar_version", "")),
                    plan_file=str(obj.get("plan_file", "plan.json")),
                    placement_search=search, timings_s=dict(obj.get("timings_s") or {}),
                    schema=PLAN_SCHEMA, extra=JsonObject({k: v for k, v in obj.items() if k not in Plan._KEYS}),
                    batch_norm=BatchNormStats.from_json(bn))
        if int(obj["world_size"]) != mesh.world_size:
            raise _bad(src, "mesh", "world_size", f"{obj['world_size']} but mesh.world_size is {mesh.world_size}")
        if obj.get("trainers") is not None:
            try:
                tl = TrainerLevel.from_json(obj["trainers"])
            except TypeError as e:
                raise _bad(src, "trainers", "trainers", f"malformed ({e})") from None
            check_trainer_level(tl, mesh.world_size, model.batch_size, src)
            plan = dataclasses.replace(plan, trainers=tl)
        if obj.get("padding") is not None:
            try:
                pad = PaddingInfo.from_json(obj["padding"])
            except TypeError as e:
                raise _bad(src, "padding", "padding", f"malformed ({e})") from None
            plan = dataclasses.replace(plan, padding=pad)
        if obj.get("options") is not None:
            try:
                opts = PlanOptions.from_json(obj["options"])
            except (AutoparError, TypeError) as e:
                raise _bad(src, "options", "options", f"malformed ({e})") from None
            plan = dataclasses.replace(plan, options=opts)
        if obj.get("strategies"):
            try:
                alts = tuple(StrategyAlternative.from_json(a) for a in obj["strategies"])
            except (TypeError, AttributeError) as e:
                raise _bad(src, "strategies", "strategies", f"malformed ({e})") from None
            plan = dataclasses.replace(plan, strategies=alts)
        if obj.get("runtime") is not None:
            try:
                plan = dataclasses.replace(plan, runtime=RuntimeRecord.from_json(obj["runtime"]))
            except (TypeError, AttributeError) as e:
                raise _bad(src, "runtime", "runtime", f"malformed ({e})") from None
        plan, halos = _state_halos(plan)
        if halos:
            migrated = (migrated or [PLAN_SCHEMA]) + [
                f"the halo of {len(halos)} spatially split input(s) stated on its placement (HaloShard, "
                f"from the op's window: {', '.join(halos[:4])}{', ...' if len(halos) > 4 else ''})"]
        check_plan(plan, src)
        if migrated:
            frm, notes = migrated[0], migrated[1:]
            what = f"plan of schema {frm} migrated to {PLAN_SCHEMA}" if frm != PLAN_SCHEMA else "plan completed"
            warnings.warn(f"{src}: {what} on load (lossless: {'; '.join(notes) or 'the schema name'}); "
                          f"re-plan to write it in full", PlanMigrated, stacklevel=2)
        if world_size is not None and plan.world_size != int(world_size):
            raise PlanFileError(f"{src} was made for world size {plan.world_size}, not {world_size}",
                                f"re-plan with --world-size {world_size}")
        return plan


def plan_from_decisions(obj: Mapping[str, Any], src: str = "in-memory plan") -> Plan:
    """A plan built in memory from only ``{"world_size", "graph", "layers": [{"layer",
    "decomposition"}]}`` (e.g. ``calibrate.overhead``'s synthetic chain): the layouts are the
    decompositions' own, every prediction is empty; checked like a plan file."""
    try:
        world = int(obj["world_size"])
        glayers = {int(g["index"]): g for g in obj["graph"]["layers"]}
        decisions = []
        for d in obj["layers"]:
            gl = glayers[int(d["layer"])]
            dec = decomposition_from_json(dict(d["decomposition"]))
            lay = Layer.from_json(gl)
            decisions.append(LayerDecision(
                layer=lay.index, name=lay.name, module=lay.module, kinds=tuple(op.kind for op in lay.ops),
                out_shape=tuple(lay.out_shape), decomposition_ref=DecompositionRef.from_json(dec.to_json()),
                choice=str(dec),
                in_placements={v: dec.in_placement(lay, v) for v in lay.inputs},
                out_placement=dec.out_placement(lay), predicted=LayerPrice()))
    except (KeyError, TypeError, ValueError) as e:
        raise PlanFileError(f"{src} needs world_size, graph and layers [{{layer, decomposition}}] "
                            f"({e.__class__.__name__}: {e})", "make the plan with `autopar plan`") from None
    plan = Plan(model=ModelRef(path="", sha256="", name=str(obj["graph"].get("model_name", "")),
                               batch_size=int(obj["graph"].get("batch_size", 0))),
                mesh=MeshInfo(world_size=world, ranks_per_node=world, nodes=1), calibration={},
                solver=SolverInfo(solver="", status="not solved"), predicted=Prediction(step_time_s=0.0),
                layers=tuple(decisions), transitions=(), graph_json=obj["graph"], generated="",
                batch_norm=dict(obj.get("batch_norm") or {"mode": "global", "group": None}))
    check_plan(plan, src)
    return plan


def _migrate(obj: dict[str, Any], src: str) -> tuple[dict[str, Any], list[str]]:
    """``obj`` in the current schema, and what was migrated: ``[]`` when nothing, else the old
    schema followed by one note per change actually made (``Plan.from_json`` warns with them)."""
    schema = obj.get("schema")
    if schema == PLAN_SCHEMA:
        renamed = _migrate_transitions(obj)
        return obj, ([PLAN_SCHEMA, renamed] if renamed else [])
    if schema in MIGRATED_PLAN_SCHEMAS:
        notes = [str(schema)]
        mesh = dict(obj.get("mesh") or {})
        world = mesh.get("world_size", obj.get("world_size"))
        if mesh.get("placement") is None:
            mesh["placement"] = {"kind": "stride", "local_stride": 1}   # older plans: block
            notes.append("mesh.placement = block (local stride 1) added")
        if world is not None and "ranks" not in mesh:
            mesh["ranks"] = list(range(int(world)))
            notes.append(f"mesh.ranks = 0..{int(world) - 1} added")
        obj["mesh"] = mesh
        layers = obj.get("layers") or ()
        if any(isinstance(d, Mapping) and ("in_layouts" in d or "out_layout" in d) for d in layers):
            notes.append("layouts [[dim, parts], ...] written as placements on named mesh axes")
        obj["layers"] = [_migrate_layer(d, i, int(world or 1), src) for i, d in enumerate(layers)]
        renamed = _migrate_transitions(obj)
        if renamed:
            notes.append(renamed)
        obj["schema"] = PLAN_SCHEMA
        return obj, notes
    raise PlanFileError(f"{src} has schema {schema!r}; this autopar reads {PLAN_SCHEMA!r} "
                        f"(and migrates {', '.join(MIGRATED_PLAN_SCHEMAS)})",
                        "re-plan with this version of autopar")


#: transition keys renamed in place (plans of every schema up to schema-3 plans written before
#: the rename named a transition's placements by the old word)
_TRANSITION_RENAMES = (("src_layout", "src_placement"), ("dst_layout", "dst_placement"))


def _migrate_transitions(obj: dict[str, Any]) -> str | None:
    """Rename the old keys of ``obj``'s transitions (``_TRANSITION_RENAMES``; the values, each a
    ``Sharding``'s text, are unchanged); the migration note, or None when none had them. A record
    with both the old and the new key keeps the new one's value."""
    trans = obj.get("transitions")
    if not isinstance(trans, list):
        return None
    n, out = 0, []
    for t in trans:
        if isinstance(t, Mapping) and any(old in t for old, _ in _TRANSITION_RENAMES):
            t, n = dict(t), n + 1
            for old, new in _TRANSITION_RENAMES:
                if old in t:
                    v = t.pop(old)
                    t.setdefault(new, v)
        out.append(t)
    if not n:
        return None
    obj["transitions"] = out
    return f"{n} transition(s)' src_layout/dst_layout renamed src_placement/dst_placement"


def _migrate_layer(d: Any, i: int, world: int, src: str) -> Any:
    """A schema-1/2 layer record with ``in_layouts``/``out_layout`` (``[[dim, parts], ...]`` or
    ``{"splits": [...], "partial": p}``: Shard(dim) per pair, outermost first, then a Partial
    axis, then the replicas) rewritten as ``in_placements``/``out_placement``; one that cannot be
    read is refused naming the field."""
    if not isinstance(d, Mapping):
        return d
    d = dict(d)

    def one(old: Any, fld: str) -> dict:
        try:
            if isinstance(old, Mapping):
                sh = from_splits(old.get("splits", ()), int(old.get("partial", 1)))
            else:
                sh = from_splits([(int(dim), int(p)) for dim, p in old])
            return sh.to_json(world)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise _bad(src, f"layer {d.get('layer', i)}", f"layers[{i}].{fld}",
                       f"{old!r} cannot be migrated to placements ({e})") from None

    if "in_layouts" in d:
        d["in_placements"] = {v: one(lay, f"in_layouts[{v!r}]") for v, lay in (d.pop("in_layouts") or {}).items()}
    if "out_layout" in d:
        d["out_placement"] = one(d.pop("out_layout") or [], "out_layout")
    return d


def _state_halos(plan: Plan) -> tuple[Plan, list[str]]:
    """``plan`` with every input placement that states the owned block (``Shard``) where the
    layer's decomposition reads a halo (``HaloShard``, same owned blocks) replaced by the
    decomposition's: plans made before halos were stated. Returns the inputs completed as
    ``"layer i value v"``; anything else is left for ``check_plan`` to judge (and name)."""
    done, layers = [], []
    try:
        glayers = {int(g["index"]): g for g in plan.graph_json["layers"]}
    except (KeyError, TypeError, ValueError):
        return plan, done          # check_plan names a malformed graph
    for d in plan.layers:
        ins = dict(d.in_placements)
        if d.kind in REGISTRY and d.layer in glayers:
            try:
                dec = d.decomposition()
                layer = Layer.from_json(glayers[d.layer])
                for v, sh in d.in_placements.items():
                    if v not in layer.inputs:
                        continue
                    want = dec.in_placement(layer, v)
                    if sh != want and want.owned() == sh:
                        ins[v] = want
                        done.append(f"layer {d.layer} value {v}")
            except Exception:   # noqa: BLE001 -- an unbuildable record is check_plan's to name
                pass
        layers.append(dataclasses.replace(d, in_placements=ins) if ins != dict(d.in_placements) else d)
    return (dataclasses.replace(plan, layers=tuple(layers)) if done else plan), done


# ---- checks on load -------------------------------------------------------------------------

def check_ranks(ranks: Sequence[int], world: int, src: str, unit: str, fld: str) -> None:
    """Every rank in ``0..world-1`` and none twice."""
    bad = [r for r in ranks if not 0 <= int(r) < world]
    if bad:
        raise _bad(src, unit, fld, f"ranks {bad} are outside the world of {world} ranks (0..{world - 1})")
    seen, dup = set(), []
    for r in ranks:
        if r in seen:
            dup.append(r)
        seen.add(r)
    if dup:
        raise _bad(src, unit, fld, f"ranks {sorted(set(dup))} appear more than once")


def check_mesh_json(obj: Any, world: int, src: str, unit: str, fld: str) -> None:
    """A placement record's mesh is the plan's world: its shape holds ``world`` ranks, and the
    ranks it names (``mesh.ranks``, optional) are in ``0..world-1``, none twice."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("mesh"), Mapping):
        return                                  # malformed: LayerDecision.from_json names it
    mesh = obj["mesh"]
    try:
        shape = [int(s) for s in mesh.get("shape") or ()]
    except (TypeError, ValueError):
        raise _bad(src, unit, f"{fld}.mesh.shape", f"{mesh.get('shape')!r} is not a list of axis sizes") from None
    if mesh.get("ranks") is not None:
        check_ranks([int(r) for r in mesh["ranks"]], world, src, unit, f"{fld}.mesh.ranks")
        if len(mesh["ranks"]) != math.prod(shape):
            raise _bad(src, unit, f"{fld}.mesh.ranks", f"{len(mesh['ranks'])} ranks for a mesh of shape {shape}")
    if math.prod(shape) != world:
        raise _bad(src, unit, f"{fld}.mesh.shape", f"{shape} holds {math.prod(shape)} ranks, but the plan's "
                   f"world is {world} ranks (a layer's mesh is the whole world)")


def check_placements(sh: Any, shape: Sequence[int], world: int, src: str,
                     unit: str, fld: str) -> None:
    """A sharding covers its tensor: each placement splits a dim the tensor has into at most its
    extent (a padded shard pads it to at least its extent, a multiple of the axis size), and its
    axes hold a number of ranks that divides the world."""
    for a, p in enumerate(sh.placements):
        n = sh.sizes[a]
        if isinstance(p, Partial) or isinstance(p, Replicate):
            continue
        d = p.dim
        if not 0 <= d < len(shape):
            raise _bad(src, unit, fld, f"{p} on mesh axis {sh.names[a]!r} splits dim {d}, but the tensor "
                       f"{list(shape)} has {len(shape)} dims")
        if isinstance(p, PaddedShard):
            if p.padded % n or p.padded < shape[d]:
                raise _bad(src, unit, fld, f"{p} on mesh axis {sh.names[a]!r}: the padded extent must be at "
                           f"least dim {d}'s extent {shape[d]} and a multiple of the axis size {n}")
        elif n > shape[d]:
            raise _bad(src, unit, fld, f"{p} splits dim {d} of extent {shape[d]} into {n} parts "
                       f"(more parts than elements: some ranks would hold nothing)")
        if isinstance(p, HaloShard):
            # a halo comes from the immediate neighbour: block c reads halo_lo of block c-1
            # (blocks 0..n-2) and halo_hi of block c+1 (blocks 1..n-1)
            below = min(block_extent(int(shape[d]), n, c) for c in range(n - 1))
            above = min(block_extent(int(shape[d]), n, c) for c in range(1, n))
            if p.halo_lo > below or p.halo_hi > above:
                raise _bad(src, unit, fld, f"{p} on mesh axis {sh.names[a]!r} reads a halo of {p.halo_lo} "
                           f"below / {p.halo_hi} above, but dim {d} of extent {shape[d]} over {n} parts "
                           f"leaves a neighbour block of {below} below / {above} above (a halo reaches "
                           f"only the immediate neighbour)")
    q = math.prod(sh.sizes)
    if world % q:
        raise _bad(src, unit, fld, f"{sh} holds {q} ranks per replica, which does not divide the world of {world} ranks")


def check_plan(plan: Plan, src: str = "plan") -> None:
    """Everything a plan must satisfy before any process starts (see the module docstring)."""

    world = plan.world_size
    mesh = plan.mesh
    if world < 1:
        raise _bad(src, "mesh", "mesh.world_size", f"{world} (must be >= 1)")
    if mesh.ranks_per_node < 1 or mesh.nodes < 1 or mesh.ranks_per_node * mesh.nodes < world:
        raise _bad(src, "mesh", "mesh.ranks_per_node/nodes", f"{mesh.nodes} nodes x {mesh.ranks_per_node} "
                   f"ranks per node do not hold {world} ranks")
    if mesh.local_stride < 1 or world % mesh.local_stride:
        raise _bad(src, "mesh", "mesh.placement", f"local stride {mesh.local_stride} does not divide "
                   f"the world size {world}")
    if len(mesh.ranks) != world:
        raise _bad(src, "mesh", "mesh.ranks", f"{len(mesh.ranks)} ranks for a world of {world}")
    check_ranks(mesh.ranks, world, src, "mesh", "mesh.ranks")
    bn = plan.batch_norm
    if bn.local:
        grp, batch = bn.group, plan.model.batch_size
        if not isinstance(grp, int) or grp < 1 or (batch and batch % grp):
            raise _bad(src, "plan", "batch_norm.group", f"{grp!r} does not divide the batch of {batch} samples")

    g = plan.graph_json
    try:
        glayers = {int(gl["index"]): gl for gl in g["layers"]}
    except (KeyError, TypeError, ValueError) as e:
        raise _bad(src, "graph", "graph.layers", f"malformed ({e.__class__.__name__}: {e})") from None
    decided = [d.layer for d in plan.layers]
    missing = sorted(set(glayers) - set(decided))
    if missing:
        raise _bad(src, f"layers {missing[:8]}", "layers", "the graph has these layers but the plan decides nothing for them")
    dup = sorted({i for i in decided if decided.count(i) > 1})
    if dup:
        raise _bad(src, f"layers {dup[:8]}", "layers", "decided more than once")
    for i, d in enumerate(plan.layers):
        unit = f"layer {d.layer} ({d.module or d.name})"
        if d.layer not in glayers:
            raise _bad(src, unit, f"layers[{i}].layer", "no such layer in the plan's graph")
        if d.kind not in REGISTRY:
            raise _bad(src, unit, f"layers[{i}].decomposition.kind",
                       f"unknown decomposition kind {d.kind!r}; known: {sorted(REGISTRY)}")
        gl = glayers[d.layer]
        ops = gl.get("ops") or []
        shapes: dict[str, list[int]] = {}
        for op in ops:
            for v, s in zip(op.get("inputs", []), op.get("in_shapes", [])):
                shapes.setdefault(v, s)
        for v in gl.get("inputs", []):
            if v not in d.in_placements:
                raise _bad(src, unit, f"layers[{i}].in_placements",
                           f"misses input value {v!r} of the layer (inputs {list(gl.get('inputs', []))})")
        for v, sh in d.in_placements.items():
            if v not in gl.get("inputs", []):
                raise _bad(src, unit, f"layers[{i}].in_placements[{v!r}]", "is not an input value of the layer")
            check_placements(sh, shapes.get(v, []), world, src, unit, f"layers[{i}].in_placements[{v!r}]")
        out_shape = ops[-1]["out_shape"] if ops else list(d.out_shape)
        check_placements(d.out_placement, out_shape, world, src, unit, f"layers[{i}].out_placement")
        # the runtime computes layouts from the decomposition: the stated ones must be its own
        try:
            dec = d.decomposition()
            layer = Layer.from_json(gl)
            want_in = {v: dec.in_placement(layer, v) for v in gl.get("inputs", [])}
            want_out = dec.out_placement(layer)
        except Exception as e:  # a hand-edited decomposition the registry cannot build
            raise _bad(src, unit, f"layers[{i}].decomposition",
                       f"{d.decomposition_ref.to_json()} cannot be built for this layer ({e.__class__.__name__}: {e})") from None
        for v, want in want_in.items():
            if d.in_placements[v] != want:
                raise _bad(src, unit, f"layers[{i}].in_placements[{v!r}]",
                           f"is {d.in_placements[v]} but decomposition {dec} reads the tensor as "
                           f"{want.named_for(len(layer.value_shape(v)))}")
        if d.out_placement != want_out:
            raise _bad(src, unit, f"layers[{i}].out_placement",
                       f"is {d.out_placement} but decomposition {dec} writes {want_out.named_for(len(layer.out_shape))}")
    for i, t in enumerate(plan.transitions):
        for end in ("src", "dst"):
            if getattr(t, end) not in glayers:
                raise _bad(src, f"transition {i} ({t.value})", f"transitions[{i}].{end}",
                           f"layer {getattr(t, end)} is not in the plan's graph")


# ---- plan files -----------------------------------------------------------------------------

def load_plan(path: str | Path, world_size: int | None = None) -> Plan:
    """Read and check a plan file; ``PlanFileError`` (named, says what to do) otherwise."""
    obj = read_json(path, PlanFileError, "plan file")
    return Plan.from_json(obj, str(path), world_size=world_size)


def write_plan(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` atomically (a crash leaves the old file or the new one)."""
    atomic_write_json(path, plan.to_json())
    return Path(path)


# ---- run results ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Check(_Record):
    """One tensor of the validation step against the single-process run."""
    tensor: str
    passed: bool
    max_abs_diff: float
    max_abs_ref: float
    rel: float
    note: str | None = None
    extra: JsonObject = field(default_factory=JsonObject)

    def to_json(self) -> dict[str, Any]:
        """Non-finite figures (a NaN gradient, a shape mismatch's infinite difference) as the
        strings "nan" / "inf" / "-inf": run.json is strict JSON, and a failed check must still be
        written (``from_json`` reads them back as floats)."""
        out = super().to_json()
        if out.get("note") is None:
            out.pop("note", None)
        for k in _CHECK_FIGURES:
            v = out.get(k)
            if isinstance(v, float) and not math.isfinite(v):
                out[k] = str(v)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]):
        return super().from_json({k: float(v) if k in _CHECK_FIGURES and isinstance(v, str) else v
                                  for k, v in obj.items()})


_CHECK_FIGURES = ("max_abs_diff", "max_abs_ref", "rel")


@dataclass(frozen=True)
class Validation:
    passed: bool
    dtype: str
    rtol: float
    atol: float
    rule: str
    checked: int
    checks: tuple[Check, ...]

    @property
    def failures(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "dtype": self.dtype, "rtol": self.rtol, "atol": self.atol,
                "rule": self.rule, "checked": self.checked,
                "failures": [c.to_json() for c in self.failures], "checks": [c.to_json() for c in self.checks]}

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> "Validation":
        return Validation(passed=bool(obj["passed"]), dtype=str(obj["dtype"]), rtol=float(obj["rtol"]),
                          atol=float(obj["atol"]), rule=str(obj.get("rule", "")), checked=int(obj["checked"]),
                          checks=tuple(Check.from_json(c) for c in obj.get("checks", ())))


@dataclass(frozen=True)
class LayerTiming(_Record):
    """One layer's measured (instrumented steps, slowest rank, median) and predicted seconds."""
    layer: int
    module: str
    choice: str
    measured_s: float
    measured_fwd_s: float
    measured_bwd_s: float
    predicted_s: float
    source: str = ""
    extra: JsonObject = field(default_factory=JsonObject)


@dataclass(frozen=True)
class Measured:
    step_time_s: float
    step_times_s: tuple[float, ...]
    phases: Mapping[str, float]
    per_layer: tuple[LayerTiming, ...]
    grad_sync_bytes_per_step: float

    def to_json(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "step_times_s": list(self.step_times_s),
                "phases": dict(self.phases), "per_layer": [p.to_json() for p in self.per_layer],
                "grad_sync_bytes_per_step": self.grad_sync_bytes_per_step}

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> "Measured":
        return Measured(step_time_s=float(obj["step_time_s"]), step_times_s=tuple(obj.get("step_times_s", ())),
                        phases=dict(obj.get("phases") or {}),
                        per_layer=tuple(LayerTiming.from_json(p) for p in obj.get("per_layer", ())),
                        grad_sync_bytes_per_step=obj.get("grad_sync_bytes_per_step", 0))


@dataclass(frozen=True)
class Baseline(_Record):
    """torch DDP on the same model and batch, timed the same way."""
    ddp_step_times_s: tuple[float, ...]
    ddp_step_time_s: float
    ddp_allreduce_bytes_per_step: float
    equivalent: bool
    note: str
    extra: JsonObject = field(default_factory=JsonObject)


class ExecutedRun:
    """What ``autopar execute`` returns, whatever the plan: a ``RunResult`` (one plan, ``kind``
    "plan") or a ``TournamentRun`` (a plan with a trainer level, ``kind`` "tournament"). Both
    say which plan ran, on how many ranks, and whether it matched its single-process check."""
    kind = ""

    @property
    def passed(self) -> bool | None:
        """True / False: the check against one process; None: not checked (skipped)."""
        raise NotImplementedError


@dataclass(frozen=True)
class RunResult(ExecutedRun):
    """What ``autopar execute`` measured (run.json)."""
    plan: str
    plan_sha256: str
    model: str
    world_size: int
    backend: str
    placement: JsonObject          # the rank placement run ({kind: "stride", local_stride}), as read
    batch_size: int
    options: JsonObject            # ``ExecuteOptions`` as given, as read
    decompositions: tuple[str, ...]
    validation: Validation
    measured: Measured
    predicted: Prediction
    prediction_error: float | None
    baseline: Baseline | None
    ratio_to_ddp: float | None
    wall_s: float
    created: str = ""
    notes: tuple[str, ...] = ()
    schema: str = RUN_SCHEMA
    extra: JsonObject = field(default_factory=JsonObject)

    _KEYS = ("schema", "created", "plan", "plan_sha256", "model", "world_size", "backend", "placement",
             "batch_size", "options", "decompositions", "validation", "measured", "predicted",
             "prediction_error", "baseline", "ratio_to_ddp", "wall_s", "notes")
    kind = "plan"

    def __post_init__(self) -> None:
        for name in ("placement", "options", "extra"):
            object.__setattr__(self, name, _json_object(getattr(self, name)))

    @property
    def passed(self) -> bool | None:
        return self.validation.passed

    def to_json(self) -> dict[str, Any]:
        out = {"schema": self.schema, "created": self.created, "plan": self.plan, "plan_sha256": self.plan_sha256,
               "model": self.model, "world_size": self.world_size, "backend": self.backend,
               "placement": self.placement.to_json(), "batch_size": self.batch_size, "options": self.options.to_json(),
               "decompositions": list(self.decompositions), "validation": self.validation.to_json(),
               "measured": self.measured.to_json(), "predicted": self.predicted.to_json(),
               "prediction_error": self.prediction_error,
               "baseline": self.baseline.to_json() if self.baseline else {},
               "ratio_to_ddp": self.ratio_to_ddp, "wall_s": self.wall_s}
        if self.notes:
            out["notes"] = list(self.notes)
        out.update(_extra_json(self))
        return out

    @staticmethod
    def from_json(obj: Mapping[str, Any], src: str = "run") -> "RunResult":
        if not isinstance(obj, Mapping) or obj.get("schema") != RUN_SCHEMA:
            got = obj.get("schema") if isinstance(obj, Mapping) else None
            raise RunFileError(f"{src} has schema {got!r}; this autopar reads {RUN_SCHEMA!r}",
                               "execute the plan again (autopar execute)")
        try:
            return RunResult(
                plan=str(obj["plan"]), plan_sha256=str(obj.get("plan_sha256", "")), model=str(obj["model"]),
                world_size=int(obj["world_size"]), backend=str(obj.get("backend", "")),
                placement=dict(obj.get("placement") or {}), batch_size=int(obj.get("batch_size") or 0),
                options=dict(obj.get("options") or {}), decompositions=tuple(obj.get("decompositions", ())),
                validation=Validation.from_json(obj["validation"]), measured=Measured.from_json(obj["measured"]),
                predicted=Prediction.from_json(obj["predicted"]), prediction_error=obj.get("prediction_error"),
                baseline=Baseline.from_json(obj["baseline"]) if obj.get("baseline") else None,
                ratio_to_ddp=obj.get("ratio_to_ddp"), wall_s=float(obj.get("wall_s", 0.0)),
                created=str(obj.get("created", "")), notes=tuple(obj.get("notes", ())), schema=RUN_SCHEMA,
                extra=JsonObject({k: v for k, v in obj.items() if k not in RunResult._KEYS}))
        except (KeyError, TypeError, ValueError) as e:
            raise RunFileError(f"{src} is incomplete or malformed ({e.__class__.__name__}: {e})",
                               "execute the plan again (autopar execute)") from None


# ---- tournament runs (``autopar.tournament.run``: run.json of a plan with a trainer level) ------

TOURNAMENT_RUN_SCHEMA = "autopar.tournament-run/1"


@dataclass(frozen=True)
class TournamentRoundResult(_Sparse):
    """One trainer's result in one round: its partner, both metrics, the winner, what it kept."""
    trainer: int
    partner: int | None = None
    metric_own: float | str | None = None       # a metric that could not be computed: its text
    metric_partner: float | str | None = None
    winner: int | None = None
    kept: str | None = None
    notes: str | None = None
    exchange_s: float | None = None
    eval_s: float | None = None
    wait_s: float | None = None
    exchange_bytes: float | None = None
    exchange_error: str | None = None
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class TournamentRound(_Sparse):
    """One tournament round: the step it ran at, the trainers alive, the pairs, each result."""
    round: int
    step: int | None = None
    alive: tuple[int, ...] = ()
    pairs: tuple[tuple[int, int], ...] = ()
    results: tuple[TournamentRoundResult, ...] = ()
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class TrainerStop(_Sparse):
    """Where and why a trainer stopped (a dead or killed rank), and who saw it."""
    round: int | None = None
    step: int | None = None
    reason: str = ""
    seen_by: str | None = None
    after_s: float | None = None
    launcher_saw: str | None = None
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class TrainerDetail(_Sparse):
    """One trainer of the run: its ranks, finished or stopped, its metric over time."""
    trainer: int
    ranks: tuple[int, ...] = ()
    status: str = "finished"
    stopped: TrainerStop | None = None
    metric_over_time: tuple[tuple[int, float], ...] = ()
    step_s: float | None = None
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class TournamentMeasured(_Sparse):
    """Medians over the run (the slowest rank of a trainer per round) and the bytes exchanged."""
    step_s: float | None = None
    exchange_s: float | None = None
    exchange_bytes: float | None = None
    exchange_bytes_per_rank: float | None = None
    eval_s: float | None = None
    tournament_s: float | None = None
    samples_per_s: float | None = None
    samples: int | None = None
    span_s: float | None = None
    note: str | None = None
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class TournamentValidation(_Sparse):
    """The run against its single-process simulation, or why that was ``skipped``."""
    passed: bool | None = None
    checked: int | None = None
    max_rel_diff: float | None = None
    winners_equal: bool | None = None
    alive_equal: bool | None = None
    survivors: tuple[int, ...] | None = None
    rule: str | None = None
    worst: str | None = None
    skipped: str | None = None
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class TournamentRun(_Sparse, ExecutedRun):
    """What ``autopar execute`` measured of a tournament (run.json, ``autopar.tournament-run/1``;
    ``autopar.tournament.run`` documents every key). ``predicted``: the plan's trainer-level
    prediction in the run's dtype (``TrainerLevel.predicted``: name -> figure); ``options``: the
    run options as given (``TournamentRunOptions``)."""
    schema: str
    plan: str
    model: str
    trainers: int
    ranks_per_trainer: int
    world_size: int
    created: str = ""
    interval_steps: int | None = None
    rounds: int | None = None
    exchange: str | None = None
    metric: str | None = None
    dtype: str | None = None
    batch_per_trainer: int | None = None
    options: JsonObject | None = None        # ``TournamentRunOptions`` as given, as read
    wall_s: float | None = None
    rounds_log: tuple[TournamentRound, ...] = ()
    trainers_detail: tuple[TrainerDetail, ...] = ()
    stopped: tuple[int, ...] = ()
    measured: TournamentMeasured | None = None
    predicted: TrainerPrediction | None = None
    validation: TournamentValidation | None = None
    extra: JsonObject = field(default_factory=JsonObject)
    present: tuple[str, ...] = field(default=(), compare=False)
    kind = "tournament"

    @property
    def passed(self) -> bool | None:
        return None if self.validation is None or self.validation.skipped else bool(self.validation.passed)

    @staticmethod
    def from_json(obj: Mapping[str, Any], src: str = "tournament run") -> "TournamentRun":
        if not isinstance(obj, Mapping) or obj.get("schema") != TOURNAMENT_RUN_SCHEMA:
            got = obj.get("schema") if isinstance(obj, Mapping) else None
            raise RunFileError(f"{src} has schema {got!r}; this autopar reads {TOURNAMENT_RUN_SCHEMA!r}",
                               "execute the plan again (autopar execute)")

        def rnd(o):
            return TournamentRound.read(o, {"results": lambda rs: tuple(TournamentRoundResult.read(r) for r in rs)})

        def trainer(o):
            return TrainerDetail.read(o, {"stopped": TrainerStop.read})
        try:
            return TournamentRun.read(obj, {
                "rounds_log": lambda xs: tuple(rnd(x) for x in xs),
                "trainers_detail": lambda xs: tuple(trainer(x) for x in xs),
                "measured": TournamentMeasured.read, "validation": TournamentValidation.read,
                "options": _json_object, "predicted": TrainerPrediction.from_json})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise RunFileError(f"{src} is incomplete or malformed ({e.__class__.__name__}: {e})",
                               "execute the plan again (autopar execute)") from None


def load_tournament_run(path: str | Path) -> TournamentRun:
    obj = read_json(path, RunFileError, "tournament run file")
    return TournamentRun.from_json(obj, str(path))


def load_run(path: str | Path) -> RunResult:
    """Read run.json (or the run folder holding it)."""
    p = Path(path)
    p = p / "run.json" if p.is_dir() else p
    return RunResult.from_json(read_json(p, RunFileError, "run file"), str(p))


def write_run(run: RunResult, path: str | Path) -> Path:
    atomic_write_json(path, run.to_json())
    return Path(path)


# ---- run sets: several plans on disjoint sub-meshes of one world ---------------------------

@dataclass(frozen=True)
class RunSetEntry:
    plan_path: Path
    ranks: tuple[int, ...]
    plan: Plan            # with ``mesh.ranks`` set to ``ranks``


@dataclass(frozen=True)
class RunSet:
    world_size: int
    entries: tuple[RunSetEntry, ...]

    def to_json(self, base: str | Path | None = None) -> dict[str, Any]:
        def rel(p: Path) -> str:
            if base is None:
                return str(p)
            import os
            return os.path.relpath(Path(p).resolve(), Path(base).resolve())
        return {"schema": RUNSET_SCHEMA, "world_size": self.world_size,
                "plans": [{"plan": rel(e.plan_path), "ranks": list(e.ranks)} for e in self.entries]}

    @staticmethod
    def from_json(obj: Mapping[str, Any], src: str = "runset", base: str | Path = ".") -> "RunSet":
        if not isinstance(obj, Mapping) or obj.get("schema") != RUNSET_SCHEMA:
            got = obj.get("schema") if isinstance(obj, Mapping) else None
            raise PlanFileError(f"{src} has schema {got!r}; this autopar reads {RUNSET_SCHEMA!r}",
                                'write {"schema": "autopar.runset/1", "world_size": W, "plans": '
                                '[{"plan": "path/plan.json", "ranks": [0, 1]}, ...]}')
        try:
            world = int(obj["world_size"])
            items = list(obj["plans"])
        except (KeyError, TypeError, ValueError) as e:
            raise _bad(src, "run set", "world_size/plans", f"missing or malformed ({e})",
                       "give world_size and a list of plans") from None
        if world < 1:
            raise _bad(src, "run set", "world_size", f"{world} (must be >= 1)", "give a positive number of ranks")
        entries: list[RunSetEntry] = []
        for i, it in enumerate(items):
            try:
                ppath = Path(it["plan"])
                ranks = tuple(int(r) for r in it["ranks"])
            except (KeyError, TypeError, ValueError) as e:
                raise _bad(src, f"plans[{i}]", f"plans[{i}]", f"needs plan (a path) and ranks (integers): {e}",
                           "fix the run set file") from None
            if not ppath.is_absolute():
                ppath = Path(base) / ppath
            unit = f"plans[{i}] ({ppath})"
            check_ranks(ranks, world, src, unit, f"plans[{i}].ranks")
            plan = load_plan(ppath)
            if plan.world_size != len(ranks):
                raise _bad(src, unit, f"plans[{i}].ranks", f"{len(ranks)} ranks for a plan made for world size "
                           f"{plan.world_size}", "give as many ranks as the plan's world size, or re-plan")
            for e in entries:
                shared = sorted(set(e.ranks) & set(ranks))
                if shared:
                    j = entries.index(e)
                    raise _bad(src, f"plans[{j}] ({e.plan_path}) and plans[{i}] ({ppath})", f"plans[{i}].ranks",
                               f"sub-meshes overlap on ranks {shared}", "give each plan its own ranks")
            entries.append(RunSetEntry(ppath, ranks, plan.with_ranks(ranks)))
        return RunSet(world, tuple(entries))


def load_runset(path: str | Path) -> RunSet:
    """Read and check a run set file; plan paths are relative to its folder."""
    obj = read_json(path, PlanFileError, "run set file")
    return RunSet.from_json(obj, str(path), Path(path).parent)


def write_runset(runset: RunSet, path: str | Path) -> Path:
    atomic_write_json(path, runset.to_json(Path(path).parent))
    return Path(path)


# ---- planning options -----------------------------------------------------------------------

@dataclass(frozen=True)
class PlanOptions:
    """Every user knob of ``autopar.planner.make_plan`` (the CLI's ``autopar plan`` flags).

    ``placement``: "search" (plan under block placement and each candidate local stride, keep the
    fastest), "block", or an integer local stride. ``trace_cache``: reuse the traced graph of an
    unchanged model file. ``write``: write plan.json and the generated module to ``out_dir``
    (default ``strategies/plans/<model>-w<N>``). ``shapes``: a shape file read into the profile
    (``measure_shapes`` asks for the measuring step before planning, which ``make_plan`` does
    not take)."""
    world_size: int
    batch_size: int | None = None
    calibration: str | None = None
    out_dir: str | None = None
    memory_limit_bytes: float | None = None
    ranks_per_node: int | None = None
    nodes: int | None = None
    kinds: tuple[str, ...] | None = None
    time_limit_s: float = 60.0
    solver: str = "highs"
    max_candidates: int = 8
    optimizer_state_per_param: float = 1.0
    placement: str | int = "search"
    trace_cache: bool = True
    write: bool = True
    # batch-norm statistics (``autopar.decomp.bn``): "local" = per group of ``bn_group`` samples
    # (default: the samples one rank holds under data parallelism, what torch DDP computes),
    # "global" = over the whole batch (the single-process function, DDP + SyncBatchNorm)
    batch_norm: str = "local"
    bn_group: int | None = None
    # measure competitive local shapes the profile lacks, within this many seconds: a step
    # BEFORE planning (``autopar.calibrate.shapes_step``, ``autopar plan --measure-shapes``);
    # ``make_plan`` itself starts no process and refuses True
    measure_shapes: bool = False
    measure_budget_s: float = 30.0
    # a shape file (``PROFILE-shapes.json``: exact local shapes measured on this machine) read
    # into the profile's exact table; recorded in plan.json (``calibration.shapes``). None: the
    # profile alone
    shapes: str | None = None
    # opt in (``autopar plan --speed-history``): state the profile's kernels at this machine's
    # usual speed (``profile.history``: the speed probe's readings of earlier calibrations and
    # runs here). Off by default: a default plan prices the profile as measured, so nothing in
    # ``~/.cache`` changes it
    speed_history: bool = False
    # layers whose choice the user fixes (``autopar.pins.Pin``: "PATTERN=KIND" or
    # "PATTERN=CHOICE", also given as such strings or {"pattern", "want"}), the last winning
    pins: tuple = ()
    # pipeline stages (``planner.strategies.stages``, issue 41): "auto" (try every feasible stage
    # count), an integer S, or None/"off"; microbatches M (None: tried) and torch's schedule name
    # (``decomp.stages.SCHEDULES``; None: 1f1b). Left out of plan.json while unset
    pipeline: str | int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    # what each stage's dp axis does with its parameters (``decomp.stages.STAGE_DATA``):
    # "replicate", "fsdp" (FSDP2 over the stage's dp group), or None/"auto" (the search chooses)
    stage_data: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise AutoparError(f"world size must be an integer >= 1, got {self.world_size!r}",
                               "give a positive number of ranks")
        if self.kinds is not None:
            object.__setattr__(self, "kinds", tuple(self.kinds))
        object.__setattr__(self, "pins", parse_pins(self.pins))
        for name in ("calibration", "out_dir", "shapes"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                object.__setattr__(self, name, str(v))
        if self.max_candidates < 1:
            raise AutoparError(f"max candidates must be >= 1, got {self.max_candidates}", "keep at least one per layer")
        if self.time_limit_s <= 0:
            raise AutoparError(f"solver time limit must be > 0 s, got {self.time_limit_s}", "give a positive --time-limit")
        if self.batch_norm not in ("local", "global"):
            raise AutoparError(f"--batch-norm {self.batch_norm!r} is not local or global",
                               "choose local (per group of samples, as DDP) or global (the whole batch)")
        stray = [f"--{n.replace('_', '-')}" for n in ("microbatches", "schedule", "stage_data")
                 if getattr(self, n) is not None]
        if stray and self.pipeline in (None, "off", 0, 1, "1"):
            raise AutoparError(f"pipeline option(s) {', '.join(stray)} given without pipeline stages",
                               "add --pipeline auto (or a stage count), or drop " + ", ".join(stray))
        if self.bn_group is not None and (not isinstance(self.bn_group, int) or self.bn_group < 1):
            raise AutoparError(f"--bn-group must be a positive integer, got {self.bn_group!r}",
                               "give the number of samples per statistics group")

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.kinds is not None:
            out["kinds"] = list(self.kinds)
        out["pins"] = [p.to_json() for p in self.pins]
        for name in ("pipeline", "microbatches", "schedule", "stage_data"):
            if out[name] is None:
                del out[name]
        return out

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> "PlanOptions":
        names = {f.name for f in fields(PlanOptions)}
        unknown = sorted(set(obj) - names)
        if unknown:
            raise AutoparError(f"unknown planning options {unknown}", f"choose from {sorted(names)}")
        return PlanOptions(**dict(obj))


@dataclass(frozen=True)
class PlanHooks:
    """Test and benchmark hooks of ``make_plan``, kept apart from the user's options:
    ``force`` pins layer index -> decomposition (str or kind); ``choice_filter`` keeps only the
    candidates it accepts; ``profile`` / ``graph`` skip loading the profile / tracing (a sweep
    traces once); ``progress`` receives one line per stage."""
    force: Mapping[int, str] | None = None
    choice_filter: Callable[[Any], bool] | None = None
    profile: Any = None
    graph: Any = None
    progress: Callable[[str], None] | None = None
