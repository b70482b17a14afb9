"""The user's own loop under a pipeline-stage plan (issue 41 item 6): what ``autopar.parallelize``
returns for a plan whose runtime is ``"stages"``, and its checkpoints.

The step is the schedule's step: ``dmodel.loss(inputs, target)`` runs torch's schedule over the
whole batch (every rank passes the same batch; each stage's dp group takes its rows), i.e. the
forward AND the backward of every microbatch, averages the gradients over the stage's dp group,
and returns the global loss (mean over microbatches and dp groups) on every rank. The returned
tensor requires grad so that the loop's ``loss.backward()`` runs, but it is a no-op: the
gradients are already in ``.grad``. ``dmodel.parameters()`` are the parameters this rank's stage
holds (whole tensors; dp replicas hold equal copies), what the optimizer steps.

Checkpoints (``save`` / ``load``) use torch.distributed.checkpoint with single-process names and
whole tensors: each rank writes the parameters and buffers of its stage (replicas deduplicated
by DCP), so a checkpoint covers the whole model and loads into any plan that reads
single-process names (``autopar.train.checkpoint.load`` of a plan without stages, at any world
size), and back. The optimizer's entries (``train.checkpoint``: each stage's parameters' state,
groups gathered from every stage) are passed in as ``entries``. With tp > 1 inside a stage each
rank holds a tp slice (``runtime.stages.shard_of``) of the split block weights: ``whole`` gathers
the slices over the stage's tp group into the single-process tensor before writing (so the
checkpoint is the same whatever the plan), and ``part`` cuts this rank's slice out of the whole
tensor read back. Under FSDP2 stages (``Stage.data == "fsdp"``) each parameter and each of its
optimizer states is a DTensor shard over the stage's dp group: ``whole`` gathers it first
(``runtime.dtensor.whole``) and ``part`` places the rows read back as the parameter's shard
(``runtime.stages.shard_like``).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..artifacts import Plan
from ..decomp.stages import StageLayout
from ..errors import AutoparError, PlanFileError
from ..runtime.model import param_aliases
from ..runtime.dtensor import local, whole
from ..runtime.stages import build_runner, shard_like, shard_of
from ..runtime.stage_program import build_program_runner
from ..io import atomic_write_text


class PipelineModule(nn.Module):
    """This rank's stage of a pipeline plan, driven by torch's schedule (module docstring)."""

    #: ``loss`` takes the whole batch on every rank (no ``shard_batch``)
    whole_batch = True

    def __init__(self, model: nn.Module, plan: Plan, loss_fn: Callable, example_inputs: torch.Tensor):
        super().__init__()
        rt = plan.runtime
        extra = dict(rt.extra) if rt is not None else {}
        if "stages" not in extra:
            raise PlanFileError("plan.json has no pipeline stages (runtime.stages)", "re-plan with --pipeline")
        self.plan = plan
        self.layout = StageLayout.from_json(extra["stages"])
        self.rank = dist.get_rank()
        st = self.layout.stage_of(self.rank)
        mb = example_inputs.shape[0] // st.dp // self.layout.schedule.microbatches
        self.full = model                                   # every name kept (checkpoints), own stage trained
        self._aliases = param_aliases(model)                # a tied weight's other names -> its own
        self._order = list(model.state_dict().keys())       # single-process names, in its order
        #: the stages run the solver's plan (``runtime.stage_program``): each parameter is this
        #: rank's shard of it under that plan (``dm.shards``), the buffers its stage's copies
        self.dm = None
        if st.data == "plan":
            self.runner = build_program_runner(model, self.layout, extra.get("stage_plan") or {}, self.rank, loss_fn)
            self.dm = self.runner.dm
            self._held = self.runner.held_parameters()
            self._bufs = dict(self.dm.bufs)
            return
        self.runner = build_runner(model, self.layout, self.rank, loss_fn, heads=extra.get("heads"),
                                   example_microbatch=example_inputs[:mb])
        self._held = self.runner.held_parameters(model)
        mods = {id(b) for _, m in self.runner.modules for b in m.buffers()}
        self._bufs = {n: b for n, b in model.named_buffers() if id(b) in mods}

    def parameters(self, recurse: bool = True):          # what the optimizer steps: this stage's
        return iter(self._held.values())

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return iter((prefix + n, p) for n, p in self._held.items())

    def loss(self, inputs, target) -> torch.Tensor:
        """The schedule's step on the whole batch; the global loss, the same on every rank."""
        x = inputs[0] if isinstance(inputs, (tuple, list)) and self.dm is None else inputs
        value = self.runner.step(x, target)
        return value.detach().clone().requires_grad_(True)   # backward(): a no-op (grads are in .grad)

    def forward(self, *args, **kwargs):
        raise AutoparError("a pipeline plan runs forward and backward together in the schedule",
                           "call dmodel.loss(inputs, target) in the training loop")

    # ---- checkpoints --------------------------------------------------------------------
    def whole(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The single-process tensor of ``t``, this rank's part of parameter ``name`` or of a state
        shaped like it: itself, or for a tp slice every tp rank's slice gathered and put back in
        place (the inverse of ``shard_of``). Collective over the stage's tp group for a slice; for a
        stage plan's shard, over the stage's mesh (every rank of it calls this for the same names)."""
        if self.dm is not None:
            return self.dm.whole_param(name, t.detach())
        t = whole(t)                   # an FSDP2 shard gathered over the stage's dp group first
        spec = self.runner.sharded.get(name)
        if spec is None:
            return t.detach()
        dim, blocks, _ = spec
        tp = self.layout.stage_of(self.rank).tp
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=self.runner.groups.tp)
        pieces = [p.chunk(blocks, dim) for p in parts]           # slice t of block b: pieces[t][b]
        return torch.cat([pieces[i][b] for b in range(blocks) for i in range(tp)], dim)

    def part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the single-process tensor ``full`` of parameter ``name``: its tp
        slice, then under FSDP2 its dp rows as a DTensor placed like the parameter; under a stage
        plan, its shard (``ParamShard.index``)."""
        if self.dm is not None:
            sh = self.dm.shards.get(name)
            if name not in self._held or sh is None or not sh.dims:
                return full
            return full[sh.index(full.shape, self.dm.comm.rank, self.dm.comm.world)].clone()
        spec = self.runner.sharded.get(name)
        if spec is not None:
            full = shard_of(full, spec, self.layout.stage_of(self.rank).tp).contiguous()
        return shard_like(self._held[name], full) if name in self._held else full

    def whole_shape(self, name: str, t: torch.Tensor) -> tuple[int, ...]:
        if self.dm is not None:
            return tuple(self.dm._global_param_shape(name, t)) if name in self._held else tuple(t.shape)
        spec = self.runner.sharded.get(name)
        shape = list(t.shape)
        if spec is not None:
            shape[spec[0]] *= self.layout.stage_of(self.rank).tp
        return tuple(shape)

    # ---- gradient clipping (``train.optim.clip_grad_norm_``) ---------------------------------
    def norm_pieces(self) -> list[torch.Tensor]:
        """The gradient pieces this rank counts in the global norm, so that every element of
        every single-process gradient is counted once over the world: a replicated dp axis
        counts at d = 0 (its replicas hold equal copies), an FSDP2 one everywhere (each rank
        its own rows); a tp slice on every tp rank, a weight whole on every tp rank at t = 0; a
        weight tied across stages (summed over them after the step) on its first stage only."""
        st = self.layout.stage_of(self.rank)
        d, t = self.runner.groups.coords
        first_of_tied = {id(p): min(dist.get_process_group_ranks(g)) == self.rank for p, g in self.runner.tied}
        out = []
        for name, p in self._held.items():
            if p.grad is None:
                continue
            if self.dm is not None:     # a stage plan: the lowest rank holding each shard counts it
                sh = self.dm.shards.get(name)
                grp = sh.grad_group(self.dm.comm.rank, self.dm.comm.world) if sh is not None else [0]
                if self.dm.comm.rank == min(grp) and first_of_tied.get(id(p), True):
                    out.append(p.grad)
                continue
            if st.data != "fsdp" and d != 0:
                continue
            if name not in self.runner.sharded and t != 0:
                continue
            if not first_of_tied.get(id(p), True):
                continue
            out.append(local(p.grad))
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-process ``model.state_dict()`` (every parameter and buffer whole, a tied
        weight under each of its names), on every rank: each stage's whole tensors
        (``state_dict_local``) from its rank at (d, t) = (0, 0), exchanged over the world.
        Collective."""
        stage_whole = self.state_dict_local()
        mine = ({n: v.detach().cpu().clone() for n, v in stage_whole.items()}
                if self.runner.groups.coords == (0, 0) else {})
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out: dict[str, torch.Tensor] = {}
        for part in every:
            out.update(part)
        for alias, name in self._aliases.items():
            out[alias] = out[name]
        return {k: out[k] for k in self._order if k in out}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Fill this rank's stage from a single-process state dict (every rank passes the same
        one): its tp slice and FSDP2 rows of each parameter (``part``), its buffers whole; a
        missing or misshapen entry is a named error."""
        mine = {**dict(self._held), **dict(self._bufs)}
        for k, v in mine.items():
            have = state_dict.get(k)
            if have is None or tuple(have.shape) != self.whole_shape(k, v):
                raise AutoparError(f"the state dict has no entry {k} of shape {self.whole_shape(k, v)}",
                                   "pass the state_dict() of this model")
        with torch.no_grad():
            for k, v in mine.items():
                v.copy_(self.part(k, state_dict[k].to(v.dtype)))

    def state_dict_local(self) -> dict[str, torch.Tensor]:
        """This stage's parameters (whole: tp slices gathered, ``whole``) and buffers under their
        single-process names. Collective over the tp group when tp > 1 (over the stage's mesh
        under a stage plan, whose buffers may be valid in each rank's slice only: assembled)."""
        if self.dm is not None:
            bufs = {**self._bufs, **self.dm.full_buffers()}
            return {**{n: self.whole(n, p) for n, p in sorted(self._held.items())}, **bufs}
        return {**{n: self.whole(n, p) for n, p in sorted(self._held.items())}, **dict(self._bufs)}


def save(path: str | Path, dmodel: PipelineModule, entries: dict[str, Any] | None = None) -> Path:
    """Every rank writes its stage's parameters and buffers (single-process names, whole
    tensors); ``path/LATEST`` names the data directory (written last, by rank 0). Collective."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    name = [f"ckpt-{uuid.uuid4().hex[:12]}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    data = path / name[0]
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    sd: dict[str, Any] = {f"model.{k}": v for k, v in dmodel.state_dict_local().items()}
    sd.update(entries or {})           # opaque entries every rank writes alike (the saved ``extra``)
    dcp.save(sd, checkpoint_id=str(data))
    dist.barrier()
    if dist.get_rank() == 0:
        atomic_write_text(path / "LATEST", data.name + "\n")
    dist.barrier()
    return data


def load(path: str | Path, dmodel: PipelineModule) -> None:
    """Fill this rank's stage from a checkpoint saved under any plan (single-process names);
    a missing or misshapen entry is a named error. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    path = Path(path)
    latest = path / "LATEST"
    d = path / latest.read_text().strip() if latest.is_file() else path
    md = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    mine = {**dict(dmodel._held), **dict(dmodel._bufs)}          # this rank's tensors (tp slices)
    for k, v in mine.items():
        shape = dmodel.whole_shape(k, v)
        have = md.get(f"model.{k}")
        if have is None or tuple(getattr(have, "size", ())) != shape:
            raise AutoparError(f"checkpoint {path} has no entry model.{k} of shape {shape}",
                               "load a checkpoint saved from this model")
    dest = {f"model.{k}": torch.empty(dmodel.whole_shape(k, v), dtype=v.dtype) for k, v in mine.items()}
    dcp.load(dest, checkpoint_id=str(d))
    with torch.no_grad():
        for k, v in mine.items():
            v.copy_(dmodel.part(k, dest[f"model.{k}"]))


__all__ = ["PipelineModule", "load", "save"]
