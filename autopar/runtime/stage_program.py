"""Pipeline stages that each run the solver's per-layer plan on their sub-mesh (``Stage.data ==
"plan"``, plan.json ``runtime.stage_plan``): any decomposition the op-by-op runtime executes
(sample, spatial with halos, channel / filter, tensor-parallel heads and rows...) inside a stage,
under torch's schedules. Unlike ``runtime.stages`` (torch modules cut at block boundaries) it
needs no block structure of the model's modules: a stage is a range of the traced program's
layers.

How: one plan (``stage_plan``: the whole model planned on ``P = world / S`` ranks for one
microbatch, ``B / M`` samples) runs on every stage's sub-mesh. Each rank builds a ``DistModel`` of
that plan on its stage's ranks holding only its layers' parameter shards (``DistModel(...,
layers=)``), and one ``ProgramChunk`` per model chunk it holds, which interprets that chunk's
layers (``decomp.program``: the steps the generated module writes out). The values crossing a
cut are every value a later chunk reads (residual streams, masks, graph inputs read later), each
as its producer's layout leaves it: stage k's rank i and stage k+1's rank i hold the same mesh
coordinate of the same plan, so torch's ``PipelineStage`` sends each local block unchanged to
its peer, and the next chunk moves it into its consumer's layout itself (``plan.json
runtime.cuts`` records these sends; ``check_cut_messages`` checks them).

One step (``ProgramRunner.step``): every rank passes the whole batch; the first chunk takes each
microbatch whole and cuts its own block (``DistModel.shard_inputs``); the last chunk's loss is
its rank's share of the microbatch loss (``DistModel.local_loss``, summing to the microbatch's
loss over the stage's mesh) divided by M; gradients accumulate over the microbatches and are
summed once after the schedule over each parameter's gradient group (``GradSync``, its hooks
off), then over the stages holding a tied weight. The loss returned on every rank is the mean
over microbatches. Batch-norm statistics are the plan's per microbatch (refused for now with
local statistics: their running statistics are deferred per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..artifacts import Plan, plan_from_decisions
from ..decomp.program import MoveStep, OpStep, crossing, loss_move, program, value_layout, var
from ..decomp.stages import StageLayout, chunk_layers, chunks_of_stage
from ..errors import PipelineError
from .comm import Comm, create_groups
from .launch import raise_peer_failure
from .model import DistModel, plan_groups
from .redistribute import redistribute
from .stages import StageGroups, _schedule_class, make_groups, peer_group


def stage_plan(record: dict) -> tuple[Plan, list[int]]:
    """The plan every stage runs (plan.json ``runtime.stage_plan``: world size, graph, per-layer
    decompositions) and each graph layer's unit (the layout's layer ranges count units)."""
    try:
        units = [int(u) for u in record["units"]]
        plan = plan_from_decisions(record, "plan.json runtime.stage_plan")
    except KeyError as e:
        raise PipelineError(f"plan.json runtime.stage_plan lacks {e}", "re-plan with --stage-data plan") from None
    return plan, units


class ProgramChunk(nn.Module):
    """Graph layers ``layers`` of the stage plan on this rank (``dm``): the crossing values of
    the cut before it in (local blocks; the first chunk: the microbatch's graph inputs whole),
    those of the cut after it out (a tensor for one, else a tuple); the last chunk returns the
    output in the layout the loss reads it in."""

    def __init__(self, dm: DistModel, layers: Sequence[int], ins: Sequence[str], outs: Sequence[str],
                 first: bool, last: bool, updates_buffers: bool):
        super().__init__()
        self.dm = [dm]                         # not a submodule: the stage's modules share one
        self.first, self.last, self.updates_buffers = first, last, updates_buffers
        decs = dm.decisions
        self.steps = [st for st in program(dm.graph, decs, layers) if isinstance(st, (MoveStep, OpStep))]
        self.ins, self.outs = list(ins), list(outs)
        self.shapes = {st.value: tuple(dm.graph.value_shape(st.value)) for st in self.steps if isinstance(st, MoveStep)}
        self.loss_move = loss_move(dm.graph, decs, dm.comm.world) if last else None
        self._wire: tuple | None = None          # (run dtype, each outgoing value's wire dtype)

    def forward(self, *values):
        dm = self.dm[0]
        if self.first:
            env = {var(gi.name): x for gi, x in zip(dm.graph.inputs, dm.shard_inputs(values))}
        else:
            env = {var(v): x for v, x in zip(self.ins, values)}
        if self.updates_buffers:
            dm.update_buffers()
        for st in self.steps:
            if isinstance(st, OpStep):
                env[st.out] = dm.op(st.name, *(env[a] for a in st.args))
            else:
                env[st.out] = redistribute(env[st.src_var], st.src, st.dst, self.shapes[st.value], dm.comm)
        if self.last:
            out = env[var(dm.graph.output)]
            lm = self.loss_move
            if lm is not None:
                out = redistribute(out, lm.src, lm.dst, dm.graph.value_shape(lm.value), dm.comm)
            return out
        res = tuple(_passed(env[var(v)], d) for v, d in zip(self.outs, self._wire_dtypes(dm)))
        return res[0] if len(res) == 1 else res

    def _wire_dtypes(self, dm: DistModel) -> tuple[torch.dtype, ...]:
        """Each outgoing value's ``wire_dtype`` for the run's dtype (the parameters'), kept until it changes."""
        run = next((p.dtype for p in dm.params.values() if p.is_floating_point()), torch.float32)
        if self._wire is None or self._wire[0] != run:
            self._wire = (run, tuple(wire_dtype(dm.graph.value_dtype(v), run) for v in self.outs))
        return self._wire[1]


def _passed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A value sent on: in its wire dtype (``wire_dtype``), contiguous (torch sends whole buffers:
    an ``expand``ed mask is copied), and a view when it is a received leaf (its gradient flows
    back through it)."""
    if t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype).contiguous()
    if not t.is_contiguous():
        return t.contiguous()
    return t.view_as(t) if t.is_leaf and t.requires_grad else t


def wire_dtype(traced: str, run: torch.dtype) -> torch.dtype:
    """The dtype a value crosses a cut in, which the receiver's buffer must have: a non-floating
    value its traced dtype; a floating one the wider of its traced dtype and the run's (the
    parameters'). A floating value is computed in the run's dtype except where the traced
    program casts explicitly (Hugging Face Llama's rotary tables stay float32 in a float64 run);
    such a value is widened for the trip, exactly, as the op consuming it would promote it."""
    t = getattr(torch, str(traced).replace("torch.", ""))
    return torch.promote_types(t, run) if t.is_floating_point else t


def local_metas(dm: DistModel, values: Sequence[str], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Empty tensors shaped as this rank's local blocks of ``values`` (each as its producer leaves
    it): what crosses a cut, for ``PipelineStage``'s static shapes, in its ``wire_dtype`` (``dtype``:
    the run's); floating ones carry a gradient."""
    prod = dm.graph.producer()
    out = []
    for v in values:
        lay = value_layout(dm.graph, dm.decisions, v, prod).owned()
        shape = lay.local_shape(tuple(dm.graph.value_shape(v)), dm.comm.rank, dm.comm.world)
        t = torch.empty(shape, dtype=wire_dtype(dm.graph.value_dtype(v), dtype))
        out.append(t.requires_grad_(t.is_floating_point()))
    return tuple(out)


@dataclass
class ProgramRunner:
    """One rank's part of a pipeline whose stages run a plan (module docstring): its chunks, its
    stage's ``DistModel``, its groups and torch's schedule. ``step(inputs, targets)`` takes the
    whole batch (every rank the same) and returns the loss (mean over microbatches) on every rank."""

    layout: StageLayout
    rank: int
    modules: list[tuple[int, ProgramChunk]]
    groups: StageGroups
    schedule: Any
    dm: DistModel
    tied: tuple = ()
    sharded: dict = None          # (``runtime.stages``' tp slices: none here; ``dm.shards`` says how)

    @property
    def stage(self):
        return self.layout.stage_of(self.rank)

    def parameters(self):
        return iter(self.dm.params.values())

    def held_parameters(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """This rank's parameter shards under their single-process names (``dm.shards``)."""
        return {self.dm.qualname[s]: p for s, p in self.dm.params.items()}

    def running_stats(self) -> list[torch.Tensor]:
        return []

    def step(self, inputs, targets: torch.Tensor) -> torch.Tensor:
        try:
            return self._step(inputs, targets)
        except Exception as e:
            raise_peer_failure(e, f"in stage {self.stage.index}'s schedule step (rank {self.rank})")
            raise

    def _step(self, inputs, targets: torch.Tensor) -> torch.Tensor:
        xs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        chunks = [c for c, _ in self.modules]
        first, last = 0 in chunks, (self.layout.num_stages * self.layout.schedule.virtual - 1) in chunks
        losses: list[torch.Tensor] = []
        before = [None if p.grad is None else p.grad.detach().clone() for p, _ in self.tied]
        self.schedule.step(*(xs if first else ()), **({"target": targets, "losses": losses} if last else {}))
        self.dm.gradsync.finish()              # each gradient summed over its group, once a step
        for (p, g), b in zip(self.tied, before):   # a weight used on several stages: this step's parts summed
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if b is not None:
                p.grad -= b
            dist.all_reduce(p.grad, group=g)
            if b is not None:
                p.grad += b
        contrib = torch.zeros((), dtype=torch.float64)
        if last:
            contrib = torch.stack([l.detach().to(torch.float64) for l in losses]).sum()
        dist.all_reduce(contrib)               # the last stage's shares: the loss, on every rank
        return contrib


def build_program_runner(model: nn.Module, layout: StageLayout, record: dict, rank: int,
                         loss_fn: Callable) -> ProgramRunner:
    """This rank's chunks of the stage plan ``record`` (plan.json ``runtime.stage_plan``) on its
    stage's sub-mesh, and torch's schedule over them. Every rank calls it (group creation is
    collective). ``model``: the single-process model, built identically on every rank."""
    from torch.distributed.pipelining import PipelineStage
    plan, units = stage_plan(record)
    graph = plan.graph()
    if plan.bn_stats().local and any(op.kind == "batch_norm" for lay in graph.layers for op in lay.ops):
        raise PipelineError("stages running a plan with local batch-norm statistics: their running statistics are "
                            "deferred to a step's end, which a pipeline schedule does not have",
                            "re-plan with --batch-norm global, or --stage-data replicate (block stages)")
    st = layout.stage_of(rank)
    if plan.world_size != len(st.ranks):
        raise PipelineError(f"the stage plan is for {plan.world_size} ranks, stage {st.index} has {len(st.ranks)}",
                            "re-plan the stages")
    chunks = chunk_layers(layout, units)
    decs = {d.layer: d.decomposition() for d in plan.layers}
    cuts = crossing(graph, decs, chunks)
    create_groups([g for s in layout.stages for g in plan_groups(plan, s.ranks)])
    groups = make_groups(layout, rank)
    mine = chunks_of_stage(layout, st.index)
    dm = DistModel(plan, model, comm=Comm.from_env(ranks=st.ranks), native=False,
                   layers=[li for c in mine for li in chunks[c]])
    dm.gradsync.remove()                       # gradients summed once after the schedule, not per microbatch
    run_dtype = next((p.dtype for p in dm.params.values() if p.is_floating_point()), torch.float32)
    n_chunks = layout.num_stages * layout.schedule.virtual
    modules = []
    for k, c in enumerate(mine):
        mod = ProgramChunk(dm, chunks[c], cuts.get(c - 1, []), cuts.get(c, []), c == 0, c == n_chunks - 1,
                           updates_buffers=k == 0)
        modules.append((c, mod))
    m = layout.schedule.microbatches
    stages = []
    for c, mod in modules:
        ins = local_metas(dm, cuts[c - 1], run_dtype) if c > 0 else tuple(
            torch.empty(gi.shape, dtype=wire_dtype(gi.dtype, run_dtype)) for gi in graph.inputs)
        outs = local_metas(dm, cuts[c], run_dtype) if c < n_chunks - 1 else (_output_meta(dm, run_dtype),)
        stages.append(PipelineStage(mod, c, n_chunks, torch.device("cpu"), group=groups.pipeline,
                                    input_args=ins, output_args=outs if len(outs) > 1 else outs[0]))

    def per_mb(out, target):
        return dm.local_loss(dm.structured(out), target, loss_fn) / m
    cls = _schedule_class(layout.schedule.name)
    schedule = cls(stages if layout.schedule.multi else stages[0], m, loss_fn=per_mb, scale_grads=False)
    tied = _tied(graph, layout, chunks, dm, rank)
    return ProgramRunner(layout, rank, modules, groups, schedule, dm, tied, {})


def _output_meta(dm: DistModel, dtype: torch.dtype) -> torch.Tensor:
    """This rank's block of the graph's output in the layout the loss reads it in."""
    out = dm.graph.output
    lm = loss_move(dm.graph, dm.decisions, dm.comm.world)
    lay = lm.dst if lm is not None else value_layout(dm.graph, dm.decisions, out)
    shape = lay.owned().local_shape(tuple(dm.graph.value_shape(out)), dm.comm.rank, dm.comm.world)
    return torch.empty(shape, dtype=wire_dtype(dm.graph.value_dtype(out), dtype), requires_grad=True)


def _tied(graph, layout: StageLayout, chunks: dict[int, list[int]], dm: DistModel, rank: int) -> tuple:
    """(parameter, group) for each parameter read by layers of several stages: its peers (same
    mesh index) over those stages, where its parts are summed. Every rank creates every group in
    name order (collective)."""
    stage_of_chunk = {c: s for s in range(layout.num_stages) for c in chunks_of_stage(layout, s)}
    holders: dict[str, set[int]] = {}
    for c, layers in chunks.items():
        for li in layers:
            for op in graph.layers[li].ops:
                for q in op.param_names.values():
                    holders.setdefault(q, set()).add(stage_of_chunk[c])
    out = []
    for q in sorted(holders):
        if len(holders[q]) > 1:
            g = peer_group(layout, sorted(holders[q]), rank)
            if g is not None:
                out.append((dm.param(q), g))
    return tuple(out)


__all__ = ["ProgramChunk", "ProgramRunner", "build_program_runner", "chunk_layers", "crossing", "local_metas",
           "stage_plan"]
