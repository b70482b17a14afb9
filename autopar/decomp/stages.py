"""Pipeline stages: a model cut into contiguous layer ranges, each on its own sub-mesh, run by one
of torch's pipeline schedules over M microbatches. Plan-time value types and the step-time and
memory formulas; pure (no torch, no process group).

Vocabulary: a *stage* is a contiguous range of layers ``[first_layer, stop_layer)`` placed on
``ranks`` (its sub-mesh, laid ``dp x tp``); a *cut* sits between stage k and k+1 and is crossed
by one or more values (residual stream, masks...), sent point to point from each rank of stage
k to its peer (same mesh coordinates) in stage k+1 in the forward, and their gradients back in
the backward: each value's move is planned as a redistribution between the two sub-meshes
(``plan_cut``: ``decomp.redistribute.plan_redistribution``, a ``MeshSend``), which
``cost.stages.planned_cut_s`` prices and torch's ``PipelineStage`` carries. A *schedule* orders, on every rank, the forward (F) and backward (B; or input-grad
I and weight-grad W for the zero-bubble schedules) of each microbatch on each stage it holds;
the orders are torch's (``torch.distributed.pipelining.Schedule*``), autopar writes none of its
own. With V *virtual* stages per rank (interleaved schedules) the model is cut into S*V chunks
and rank group r holds chunks r, r+S, ... (``loop``) or r and 2S-1-r (``v``-shaped).

Step-time formulas (written once, here; ``tests/test_stages_schedule.py`` checks each against a
discrete-event simulation of torch's own action order for the schedule). Per microbatch, stage s
(all its chunks together) takes ``f_s`` forward and ``b_s`` backward; crossing cut k costs
``c_k`` one way (the same bytes go back as gradients); after its last backward stage s
synchronises its gradients over its data-parallel sub-mesh in ``g_s``. With M microbatches and
S stages:

    GPipe (all forwards, then all backwards; a flow shop each way)
        T_pipe = sum_s (f_s + b_s) + 2 sum_k c_k + (M-1) (max_s f_s + max_s b_s)
    1F1B (torch's: stage s runs min(M, S-s) forwards first, then alternates B and F; c = mean c_k)
        T_pipe = sum_s (f_s + b_s) + (M-1) max_s (f_s + b_s) + 2 c ((S-1) M / S + S - 2)
    interleaved 1F1B, V chunks per rank (each chunk f_s/V, b_s/V; uniform stages f, b, c)
        T_pipe = M (f + b) + (S-1) (f + b) / V + 2 (S-1) c  ... when M is a multiple of S
    step = T_pipe + sum_s a_s + max(0, max_s (g_s - sum_{k<s} (b_k + c_k)))

``a_s`` is what stage s waits before its first forward besides its input: 0 when its dp axis
replicates the parameters; under FSDP2 (``Stage.data == "fsdp"``) the all-gathers of its units
that its forward cannot hide (``cost.stages.fsdp_unit_cost``). Each stage's wait delays the
first microbatch's path through every later stage, so they add.

The 1F1B send term: stage 0 keeps S microbatches in flight and starts microbatch j+S only after
the backward of j returned, a round trip of ``S (f + b) + 2 (S-1) c``; so in steady state every
microbatch costs ``f + b + 2 (S-1) c / S`` and the sends are *not* hidden (the simulation shows
it: exact for uniform stages when S divides M, within one c otherwise). GPipe exposes them
only in the fill and the drain.

With uniform stages and free cuts the 1F1B / GPipe form is ``(M + S - 1)(f + b)``: the *bubble* is
``(S-1)(f+b)``, a fraction ``(S-1)/(M+S-1)`` of the step, i.e. ``(S-1)/M`` of the useful work;
interleaving divides it by V. The gradient-sync term: stage s finishes its last backward at
least ``sum_{k<s}(b_k + c_k)`` before stage 0 (the last microbatch's gradient still has to
travel down), so its sync overlaps the drain below it; exact when the drain is unobstructed
(uniform stages), an upper bound otherwise. For stages that are not uniform the GPipe form stays
exact (free cuts); the 1F1B form is an upper bound (the bottleneck's period charged to every
microbatch; 0-21 % over the simulation on random stage times f in [0.5, 2], b in [1, 4]), which
the planner uses: balanced cuts, the ones it picks, are where it is tight.

For the zero-bubble schedules (``interleaved_zb``, ``zbv``) the backward splits into I (input
gradient, on the critical path) and W (weight gradient, fills bubbles); they are priced with
the 1F1B-interleaved form with the bubble shrunk to ``(S-1) * max(0, f + i - w) / V``
(Qi et al., ICLR'24: W fills what F + I leave), ``i = w = b/2`` unless stated.

Memory: a stage holds, besides its parameters, gradients and optimizer state, the activations
of the microbatches it has run forward but not yet backward. The most it keeps in flight, for
stage s (of S, V chunks per rank), checked against the simulation's peak:

    GPipe                 M
    1F1B                  min(M, S - s)
    interleaved (V)       min(M V, (S - s) + ... )  -> counted per chunk: see ``in_flight_chunks``

where one in-flight microbatch of a stage costs its activation bytes per microbatch (a chunk
costs 1/V of it). Under FSDP2 a stage also needs ``transient_bytes`` (the largest of its units':
the reduce-scatter's input, one unit at a time) after its last backward, when no activation is
left: the peak is static + max(transient, in-flight x activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import PipelineError
from .distspec import DistSpec, Replicate, Shard
from .mesh import Mesh
from .redistribute import MeshSend, Step, plan_redistribution, step_from_json, steps_str

#: schedule name -> (torch class in torch.distributed.pipelining, chunks per rank: 1, "V" any V>=2, or 2)
SCHEDULES: dict[str, tuple[str, object]] = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "V"),
    "looped_bfs": ("ScheduleLoopedBFS", "V"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", "V"),
    "zbv": ("ScheduleZBVZeroBubble", 2),
    "dualpipev": ("ScheduleDualPipeV", 2),
}
#: the schedules whose step formula and memory count are written above (the others run but are
#: priced as their nearest relative: looped_bfs as GPipe over chunks, dualpipev as zbv)
PRICED = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")
#: what a stage's data-parallel axis does with its parameters (``Stage.data``): "replicate" keeps
#: them whole on every replica and all-reduces the gradients after the schedule's step; "fsdp"
#: shards parameters, gradients and optimizer state over the stage's dp group with torch's FSDP2
#: (``fully_shard`` on every block and on the stage module; ``PipelineStage`` keeps the gradients
#: whole across the microbatches and reduce-scatters them once after the last backward, so the
#: memory and traffic are ``decomp.fsdp``'s level 1: ``cost.stages.fsdp_unit_cost``)
#: "plan": the stage's whole sub-mesh runs the solver's per-layer plan of the model on that many
#: ranks for one microbatch (``runtime.stage_program``; any decomposition kind inside a stage;
#: its dp x tp is then P x 1, the plan saying how each layer uses the P ranks)
STAGE_DATA = ("replicate", "fsdp", "plan")
#: the schedules that split each backward into input- and weight-gradient steps (zero bubble):
#: torch's weight step differentiates with respect to the stage module's parameters, which under
#: FSDP2 are the sharded DTensors, not the gathered tensors the forward used, so their gradients
#: stay None (seen with torch 2.13 at world 4): FSDP2 stages are refused under these
SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: its name (a key of ``SCHEDULES``), M microbatches, V chunks per rank."""

    name: str
    microbatches: int
    virtual: int = 1

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise PipelineError(f"unknown pipeline schedule {self.name!r}",
                            f"use one of {', '.join(SCHEDULES)}")
        if int(self.microbatches) < 1:
            raise PipelineError(f"microbatches must be >= 1, got {self.microbatches}", "pass --microbatches M >= 1")
        v = SCHEDULES[self.name][1]
        if v == "V" and int(self.virtual) < 2:
            raise PipelineError(f"schedule {self.name} needs V >= 2 chunks per rank, got {self.virtual}",
                            "pass virtual >= 2 or use gpipe / 1f1b")
        if v != "V" and int(self.virtual) != int(v):
            raise PipelineError(f"schedule {self.name} runs {v} chunk(s) per rank, got {self.virtual}",
                            f"use virtual={v}")

    @property
    def torch_class(self) -> str:
        return SCHEDULES[self.name][0]

    @property
    def multi(self) -> bool:
        """True for torch's multi-stage-per-rank schedules (a list of stages per rank)."""
        return self.virtual > 1

    def to_json(self) -> dict:
        return {"name": self.name, "microbatches": int(self.microbatches), "virtual": int(self.virtual),
                "torch_class": self.torch_class}

    @staticmethod
    def from_json(obj: dict) -> "Schedule":
        return Schedule(str(obj["name"]), int(obj["microbatches"]), int(obj.get("virtual", 1)))


@dataclass(frozen=True)
class Stage:
    """Layers ``[first_layer, stop_layer)`` on global ``ranks`` laid row-major over ``dp x tp``."""

    index: int
    first_layer: int
    stop_layer: int
    ranks: tuple[int, ...]
    dp: int = 0
    tp: int = 1
    data: str = "replicate"           # the dp axis: "replicate" (all-reduce) or "fsdp" (FSDP2 over dp)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if self.data not in STAGE_DATA:
            raise PipelineError(f"stage {self.index}: data axis {self.data!r} is not one of {STAGE_DATA}",
                                "use replicate or fsdp")
        if self.dp == 0:
            object.__setattr__(self, "dp", len(self.ranks) // max(1, int(self.tp)))
        if not 0 <= self.first_layer < self.stop_layer:
            raise PipelineError(f"stage {self.index}: empty or negative layer range "
                            f"[{self.first_layer}, {self.stop_layer})", "give each stage >= 1 layer")
        if self.dp * self.tp != len(self.ranks) or not self.ranks:
            raise PipelineError(f"stage {self.index}: dp {self.dp} x tp {self.tp} != {len(self.ranks)} ranks",
                            "lay the stage's ranks as dp x tp")

    @property
    def layers(self) -> int:
        return self.stop_layer - self.first_layer

    def peer(self, rank: int, other: "Stage") -> int:
        """The rank of ``other`` at the same (dp, tp) coordinates as ``rank`` of this stage."""
        return other.ranks[self.ranks.index(int(rank))]

    def to_json(self) -> dict:
        d = {"index": self.index, "layers": [self.first_layer, self.stop_layer],
             "ranks": list(self.ranks), "dp": self.dp, "tp": self.tp}
        if self.data != "replicate":
            d["data"] = self.data
        return d

    @staticmethod
    def from_json(obj: dict) -> "Stage":
        lo, hi = obj["layers"]
        return Stage(int(obj["index"]), int(lo), int(hi), tuple(obj["ranks"]), int(obj.get("dp", 0)),
                     int(obj.get("tp", 1)), str(obj.get("data", "replicate")))


@dataclass(frozen=True)
class StageLayout:
    """S stages covering layers ``[0, n_layers)`` in order, on disjoint equal-size sub-meshes."""

    stages: tuple[Stage, ...]
    schedule: Schedule

    def __post_init__(self) -> None:
        st = self.stages
        if not st:
            raise PipelineError("a stage layout needs at least one stage", "give S >= 1")
        for k, s in enumerate(st):
            if s.index != k:
                raise PipelineError(f"stage {k} carries index {s.index}", "number the stages 0..S-1 in order")
            if k and s.first_layer != st[k - 1].stop_layer:
                raise PipelineError(f"stage {k} starts at layer {s.first_layer} but stage {k - 1} stops at "
                                f"{st[k - 1].stop_layer}", "stages must cover contiguous layer ranges")
        seen: set[int] = set()
        for s in st:
            if seen & set(s.ranks):
                raise PipelineError(f"stage {s.index} shares ranks {sorted(seen & set(s.ranks))} with an earlier "
                                "stage", "give each stage its own ranks")
            seen |= set(s.ranks)
        if len({(s.dp, s.tp) for s in st}) != 1:
            raise PipelineError("stages have different sub-mesh shapes "
                            f"{[(s.dp, s.tp) for s in st]}", "peers across a cut need the same dp x tp")
        if self.schedule.name == "1f1b" and self.schedule.microbatches < len(st):
            raise PipelineError(f"1F1B needs microbatches >= stages ({len(st)}), got {self.schedule.microbatches}",
                            f"pass --microbatches >= {len(st)}")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def world(self) -> int:
        return sum(len(s.ranks) for s in self.stages)

    def stage_of(self, rank: int) -> Stage:
        for s in self.stages:
            if int(rank) in s.ranks:
                return s
        raise PipelineError(f"rank {rank} is in no stage", f"stages hold ranks 0..{self.world - 1}")

    def to_json(self) -> dict:
        return {"stages": [s.to_json() for s in self.stages], "schedule": self.schedule.to_json()}

    @staticmethod
    def from_json(obj: dict) -> "StageLayout":
        return StageLayout(tuple(Stage.from_json(s) for s in obj["stages"]), Schedule.from_json(obj["schedule"]))


def even_layout(n_layers: int, world: int, num_stages: int, schedule: Schedule, tp: int = 1,
                cuts: Sequence[int] | None = None, data: str | Sequence[str] = "replicate") -> StageLayout:
    """S stages on consecutive blocks of ``world // S`` ranks (so that a stage stays on as few nodes
    as possible and only the cuts cross node links), cut at ``cuts`` (the first layer of stages
    1..S-1) or evenly. Raises a ``PlanError`` listing the feasible stage counts otherwise."""
    feasible = feasible_stage_counts(n_layers, world, schedule.virtual)
    if num_stages not in feasible:
        raise PipelineError(f"--pipeline {num_stages} is not feasible for {n_layers} layers on {world} ranks "
                        f"({schedule.virtual} chunk(s) per rank)",
                        f"use one of the feasible stage counts {feasible}")
    per = world // num_stages
    if per % tp:
        raise PipelineError(f"tp {tp} does not divide the {per} ranks of a stage", "pick tp dividing world/S")
    if cuts is None:
        cuts = [round(k * n_layers / num_stages) for k in range(1, num_stages)]
    bounds = [0, *[int(c) for c in cuts], n_layers]
    datas = [data] * num_stages if isinstance(data, str) else list(data)      # one for all, or per stage
    if len(datas) != num_stages:
        raise PipelineError(f"{len(datas)} data axes for {num_stages} stages", "give one, or one per stage")
    stages = tuple(Stage(k, bounds[k], bounds[k + 1], tuple(range(k * per, (k + 1) * per)), per // tp, tp,
                         datas[k] if per // tp > 1 or datas[k] == "plan" else "replicate")
                   for k in range(num_stages))
    return StageLayout(stages, schedule)


#: what the stage runtime says of a model it cannot cut (``pipeline_structure`` None)
CANNOT_CUT_HINT = ("stages run sequential block models: the plain GPT (tok/pos/blocks/ln/head), HF GPT-2, "
                   "HF Llama, or a module with pipeline_parts() -> (pre, blocks, post)")


def pipeline_structure(model) -> str | None:
    """Which sequential block model ``model`` is, as ``runtime.stages.pipeline_parts`` cuts it
    into (pre, blocks, post): "parts" (it offers ``pipeline_parts()``), "gpt" (tok, pos, blocks,
    ln, head), "hf_gpt2" (transformer.wte/wpe/h/ln_f + lm_head), "hf_llama" (model.embed_tokens /
    layers / norm / rotary_emb + lm_head); None for any other. Attribute checks only: the planner
    asks it of a model built on the meta device."""
    if hasattr(model, "pipeline_parts"):
        return "parts"
    if all(hasattr(model, a) for a in ("tok", "pos", "blocks", "ln", "head")):
        return "gpt"
    tr = getattr(model, "transformer", None)
    if tr is not None and all(hasattr(tr, a) for a in ("wte", "wpe", "h", "ln_f")) and hasattr(model, "lm_head"):
        return "hf_gpt2"
    base = getattr(model, "model", None)
    if base is not None and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            and hasattr(model, "lm_head"):
        return "hf_llama"
    return None


def chunk_ranges(layout: StageLayout) -> list[tuple[int, int, int]]:
    """(chunk index, first layer, stop layer) of every model chunk, in model order: the stages'
    own ranges when V = 1; else the layers cut evenly into S*V chunks."""
    s_count, v = layout.num_stages, layout.schedule.virtual
    if v == 1:
        return [(s.index, s.first_layer, s.stop_layer) for s in layout.stages]
    n = layout.stages[-1].stop_layer
    bounds = [round(k * n / (s_count * v)) for k in range(s_count * v + 1)]
    return [(k, bounds[k], bounds[k + 1]) for k in range(s_count * v)]


def chunk_layers(layout: StageLayout, units: Sequence[int]) -> dict[int, list[int]]:
    """{chunk: the graph layers it runs} (a chunk's unit range, ``chunk_ranges``)."""
    return {c: [li for li, u in enumerate(units) if lo <= u < hi] for c, lo, hi in chunk_ranges(layout)}


def chunks_of_stage(layout: StageLayout, stage: int) -> list[int]:
    """Chunk indices held by rank group ``stage``: itself (V = 1), ``stage + k S`` (looped
    schedules) or ``stage`` and ``2S - 1 - stage`` (V-shaped: zbv, dualpipev)."""
    s_count, v = layout.num_stages, layout.schedule.virtual
    if v == 1:
        return [stage]
    if layout.schedule.name in ("zbv", "dualpipev"):
        return [stage, 2 * s_count - 1 - stage]
    return [stage + k * s_count for k in range(v)]


def chunk_holder(layout: StageLayout, chunk: int) -> int:
    """The rank group (stage index) holding model chunk ``chunk`` (``chunks_of_stage``'s inverse)."""
    for s in range(layout.num_stages):
        if chunk in chunks_of_stage(layout, s):
            return s
    raise PipelineError(f"chunk {chunk} is held by no stage", f"chunks run 0..{layout.num_stages * layout.schedule.virtual - 1}")


def feasible_stage_counts(n_layers: int, world: int, virtual: int = 1) -> list[int]:
    """Stage counts S that divide the world and leave every chunk (S*V of them) >= 1 layer."""
    return [s for s in range(1, world + 1) if world % s == 0 and s * max(1, virtual) <= n_layers]


# ------------------------------------------------------------------------------------------
# Pricing
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StageCost:
    """One stage's per-microbatch costs: forward ``fwd_s`` and backward ``bwd_s`` of all its
    layers on its sub-mesh (their own collectives included), its gradient sync ``grad_sync_s``
    after the last backward, the activation bytes one microbatch keeps alive until its backward,
    and the bytes that do not depend on M (parameters, gradients, optimizer state)."""

    fwd_s: float
    bwd_s: float
    grad_sync_s: float = 0.0
    act_bytes_per_microbatch: float = 0.0
    static_bytes: float = 0.0
    fill_s: float = 0.0               # exposed before the stage's first forward (FSDP's all-gathers)
    transient_bytes: float = 0.0      # one unit's buffer after the last backward (FSDP2's reduce-scatter
                                      # input): the max over units, not a sum, and not with activations


@dataclass(frozen=True)
class PipelinePrice:
    """The priced step of a stage layout: ``step_s`` = ``pipe_s`` + ``sync_tail_s``; ``ideal_s`` =
    M * max_s (f_s + b_s) (no bubble, no sends); ``bubble_s`` = what the schedule adds beyond it
    on the bottleneck stage besides the sends; per-stage peak bytes and in-flight microbatches."""

    step_s: float
    pipe_s: float
    ideal_s: float
    bubble_s: float
    send_s: float
    sync_tail_s: float
    peak_bytes: tuple[float, ...]
    in_flight: tuple[float, ...]

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.step_s if self.step_s > 0 else 0.0

    def to_json(self) -> dict:
        return {"step_s": self.step_s, "pipe_s": self.pipe_s, "ideal_s": self.ideal_s,
                "bubble_s": self.bubble_s, "bubble_fraction": self.bubble_fraction, "send_s": self.send_s,
                "sync_tail_s": self.sync_tail_s, "peak_bytes": list(self.peak_bytes),
                "in_flight_microbatches": list(self.in_flight)}


def in_flight_microbatches(schedule: Schedule, num_stages: int, stage: int) -> float:
    """Most microbatches whose activations stage ``stage`` holds at once (in units of a whole
    stage's microbatch: a chunk counts 1/V). See the module docstring; checked in the test."""
    m, s_count, v = schedule.microbatches, num_stages, schedule.virtual
    if schedule.name in ("gpipe", "looped_bfs"):
        return float(m)
    if schedule.name == "1f1b":
        return float(min(m, s_count - stage))
    # interleaved and V-shaped: torch's warm-up runs (V-1)*min(M, S) + 2*(S-1-r) chunk forwards
    # (capped at M*V) before the first backward of rank r; one more while the first backward runs
    warm = min(m * v, (v - 1) * min(m, s_count) + 2 * (s_count - 1 - stage) + 1)
    return warm / v


def price_pipeline(costs: Sequence[StageCost], cut_send_s: Sequence[float], schedule: Schedule,
                   input_grad_fraction: float = 0.5) -> PipelinePrice:
    """Price one step of ``len(costs)`` stages under ``schedule`` (formulas in the module docstring).

    ``cut_send_s[k]``: one microbatch's values crossing cut k one way. For V > 1 the stages are
    taken as uniform (their mean), as the interleaved formula is written for."""
    s_count, m, v = len(costs), schedule.microbatches, schedule.virtual
    if len(cut_send_s) != s_count - 1:
        raise ValueError(f"{s_count} stages need {s_count - 1} cut send times, got {len(cut_send_s)}")
    f = [c.fwd_s for c in costs]
    b = [c.bwd_s for c in costs]
    send = 2.0 * sum(cut_send_s)
    ideal = m * max(fi + bi for fi, bi in zip(f, b))
    if schedule.name in ("gpipe", "looped_bfs"):
        fb = sum(f) + sum(b) + (m - 1) * (max(f) + max(b))
        if schedule.name == "looped_bfs":  # V chunks per rank run one after another: GPipe over chunks
            fb = sum(f) / v + sum(b) / v + (m * v - 1) * (max(f) + max(b)) / v
        pipe = fb + send
    elif schedule.name == "1f1b":
        c_mean = sum(cut_send_s) / (s_count - 1) if s_count > 1 else 0.0
        send = 2.0 * c_mean * ((s_count - 1) * m / s_count + s_count - 2) if s_count > 1 else 0.0
        pipe = sum(f) + sum(b) + (m - 1) * max(fi + bi for fi, bi in zip(f, b)) + send
    else:
        fm, bm = sum(f) / s_count, sum(b) / s_count
        if schedule.name in ("interleaved_zb", "zbv", "dualpipev"):
            i, w = input_grad_fraction * bm, (1 - input_grad_fraction) * bm
            bubble = (s_count - 1) * max(0.0, fm + i - w) / v
        else:
            bubble = (s_count - 1) * (fm + bm) / v
        pipe = m * (fm + bm) + bubble + send
    tail = 0.0
    below = 0.0
    for k, c in enumerate(costs):
        tail = max(tail, c.grad_sync_s - below)
        below += b[k] + (cut_send_s[k] if k < s_count - 1 else 0.0)
    pipe += sum(c.fill_s for c in costs)
    in_flight = tuple(in_flight_microbatches(schedule, s_count, k) for k in range(s_count))
    peak = tuple(c.static_bytes + max(c.transient_bytes, n * c.act_bytes_per_microbatch)
                 for c, n in zip(costs, in_flight))
    step = pipe + tail
    return PipelinePrice(step, pipe, ideal, max(0.0, pipe - ideal - send), send, tail, peak, in_flight)


def cut_send_time_s(profile, nbytes: float, src_ranks: Sequence[int], dst_ranks: Sequence[int]) -> float:
    """One microbatch's values (``nbytes`` per sending rank) over one cut: every rank of the
    sending stage sends to its peer at the same time, so the time is one p2p message at the link
    level the pair crosses (``profile.level_of``: 'inter' when the two stages' ranks span nodes)."""
    level = "intra"
    for a, b in zip(src_ranks, dst_ranks):
        if profile.level_of([a, b]) == "inter":
            level = "inter"
            break
    return profile.collective_time_s("p2p", 2, float(nbytes), level=level)


# ------------------------------------------------------------------------------------------
# Values crossing a cut, planned as redistributions between the two stages' meshes
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CutValue:
    """One value crossing a cut for one microbatch: its global ``shape`` -- dim 0 the
    microbatch's samples of every dp replica together (``dp x samples``) when ``batched``, else a
    value without a batch dim (a mask, a position table) that every rank holds whole -- and
    ``itemsize`` bytes per element."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    batched: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "itemsize": self.itemsize, "batched": self.batched}

    @staticmethod
    def from_json(obj: dict) -> "CutValue":
        return CutValue(str(obj["name"]), tuple(obj["shape"]), int(obj["itemsize"]), bool(obj.get("batched", True)))


def stage_mesh(stage: Stage) -> Mesh:
    """The stage's sub-mesh: its global ranks laid row-major over ``(dp, tp)``."""
    return Mesh(stage.ranks, (stage.dp, stage.tp), ("dp", "tp"))


def cut_value_spec(stage: Stage, value: CutValue) -> DistSpec:
    """Where a cut value lives on ``stage``: a batched value's samples split over the stage's dp
    axis (replica d holds rows ``[d B/D, (d+1) B/D)``, what ``runtime.stages`` feeds it) and
    replicated over its tp axis (every tp rank of a Megatron block ends with the whole residual
    stream); a value without a batch dim replicated on both axes."""
    first = Shard(0) if value.batched and value.shape else Replicate()
    return DistSpec(stage_mesh(stage), (first, Replicate()), value.shape)


@dataclass(frozen=True)
class CutPlan:
    """Cut ``index`` (stage ``index`` -> ``index + 1``): every value crossing it with its planned
    redistribution from the producing stage's sub-mesh to the consuming stage's
    (``decomp.redistribute.plan_redistribution``; a ``MeshSend`` of point-to-point boxes)."""

    index: int
    values: tuple[CutValue, ...]
    steps: tuple[tuple[Step, ...], ...]        # per value, in the order of ``values``
    src_stage: int | None = None               # the rank groups either side (None: index, index + 1);
    dst_stage: int | None = None               # with V chunks per rank, cut c joins chunks c and c + 1

    def messages(self) -> dict[tuple[int, int], tuple[tuple[int, ...], ...]]:
        """{(sender, receiver) global ranks: the shape of every box it sends, value by value}: what
        the plan says each rank pair exchanges for one microbatch (local copies left out)."""
        out: dict[tuple[int, int], list[tuple[int, ...]]] = {}
        for steps in self.steps:
            for st in steps:
                if isinstance(st, MeshSend):
                    for t in st.transfers:
                        if t.src_rank != t.dst_rank:
                            out.setdefault((t.src_rank, t.dst_rank), []).append(tuple(e for _, e in t.box))
        return {k: tuple(v) for k, v in sorted(out.items())}

    def to_json(self) -> dict:
        src = self.index if self.src_stage is None else self.src_stage
        dst = self.index + 1 if self.dst_stage is None else self.dst_stage
        return {"cut": self.index, "from_stage": src, "to_stage": dst,
                "values": [{**v.to_json(), "steps_str": steps_str(st), "steps": [s.to_json() for s in st]}
                           for v, st in zip(self.values, self.steps)]}

    @staticmethod
    def from_json(obj: dict) -> "CutPlan":
        vals = obj["values"]
        src, dst = obj.get("from_stage"), obj.get("to_stage")
        return CutPlan(int(obj["cut"]), tuple(CutValue.from_json(v) for v in vals),
                       tuple(tuple(step_from_json(s) for s in v["steps"]) for v in vals),
                       None if src is None else int(src), None if dst is None else int(dst))


def plan_cut(index: int, src: Stage, dst: Stage, values: Sequence[CutValue]) -> CutPlan:
    """The planned steps of every value crossing from stage ``src`` to stage ``dst``
    (``cut_value_spec`` on each side). With equal sub-mesh shapes each rank sends its block to
    its peer (same coordinates): one message per value and rank pair, what torch's
    ``PipelineStage`` sends; other shapes (a dp change) give the boxes the planner computes."""
    steps = tuple(plan_redistribution(cut_value_spec(src, v), cut_value_spec(dst, v)) for v in values)
    return CutPlan(int(index), tuple(values), steps, src.index, dst.index)


def plan_program_cut(index: int, src: Stage, dst: Stage, values: Sequence[tuple[CutValue, object]]) -> CutPlan:
    """A cut of stages running one plan (``Stage.data == "plan"``): each value ``(CutValue, its
    producer's Sharding)`` crosses as that layout's owned blocks on both sub-meshes (each rank
    sends its block to its peer, the next stage moving it into its consumer's layout itself; a
    partial block crosses as it is, so its messages are those of the layout without the partial
    axis)."""
    steps = []
    for v, lay in values:
        lay = lay.owned().without_partial()
        steps.append(plan_redistribution(lay.to_spec(v.shape, Mesh(src.ranks, (len(src.ranks),), ("p",))),
                                         lay.to_spec(v.shape, Mesh(dst.ranks, (len(dst.ranks),), ("p",)))))
    return CutPlan(int(index), tuple(v for v, _ in values), tuple(steps), src.index, dst.index)


def plan_cuts(layout: StageLayout, values: Sequence[Sequence[CutValue]]) -> tuple[CutPlan, ...]:
    """``plan_cut`` of every cut of ``layout`` (``values[k]``: the values crossing cut k): the S - 1
    stage cuts, or with V chunks per rank the S V - 1 chunk cuts, cut c from the rank group
    holding chunk c to the one holding chunk c + 1 (``chunk_holder``; under a V-shaped schedule
    the middle cut stays on one rank group: no message)."""
    n_cuts = layout.num_stages * layout.schedule.virtual - 1
    if len(values) != n_cuts:
        raise ValueError(f"{layout.num_stages} stages x {layout.schedule.virtual} chunks have {n_cuts} cuts, "
                         f"got values for {len(values)}")
    st = layout.stages
    return tuple(plan_cut(k, st[chunk_holder(layout, k)], st[chunk_holder(layout, k + 1)], values[k])
                 for k in range(n_cuts))


def stage_counts_priced(prices: dict[int, PipelinePrice | str]) -> list[dict]:
    """plan.json's record of every stage count tried: its prediction or why it was refused."""
    out = []
    for s in sorted(prices):
        p = prices[s]
        out.append({"stages": s, **({"refused": p} if isinstance(p, str) else p.to_json())})
    return out


def bubble_fraction_uniform(schedule: Schedule, num_stages: int) -> float:
    """(S-1)/(M+S-1) for GPipe / 1F1B with uniform stages and free cuts; /V interleaved."""
    s, m, v = num_stages, schedule.microbatches, schedule.virtual
    if schedule.name in ("gpipe", "1f1b"):
        return (s - 1) / (m + s - 1)
    return (s - 1) / v / (m + (s - 1) / v)


__all__ = ["CANNOT_CUT_HINT", "chunk_layers", "PRICED", "SCHEDULES", "SPLIT_BACKWARD", "STAGE_DATA", "pipeline_structure", "chunk_holder", "chunk_ranges", "chunks_of_stage", "CutPlan", "CutValue", "PipelinePrice", "Schedule", "Stage", "StageCost",
           "StageLayout", "bubble_fraction_uniform", "cut_send_time_s", "cut_value_spec", "plan_cut", "plan_cuts", "plan_program_cut",
           "stage_mesh", "even_layout", "feasible_stage_counts",
           "in_flight_microbatches", "price_pipeline", "stage_counts_priced"]
