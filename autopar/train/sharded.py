"""Checkpoints of a model run on torch's engines (FSDP2 ``fully_shard``, DTensor tensor
parallelism: ``runtime.fsdp``), in the same format as every other plan's (``train.checkpoint``).

The keys are those of ``train.checkpoint``: ``model.<qual>`` (single-process name and shape),
``optim.state.<qual>.<key>``, ``optim.param_groups``, ``extra``, ``autopar``. A parameter is the
DTensor FSDP2 / DTensor hold (DCP writes each rank's chunk with its global offsets, the uneven
torch.chunk rows included), optimizer state shaped like it is a DTensor alike, buffers are whole.
DCP stores chunks by offset whatever wrote them, so a checkpoint saved here loads under an
autopar plan (``ShardedTensor`` blocks) at another world size, and the reverse: DCP reads the
overlap of every saved chunk with every wanted one.

ZeRO-1 on DDP (``runtime.fsdp.make_optimizer``: a ``ZeroRedundancyOptimizer``): parameters whole
on every rank (DCP writes each once), and each rank writes the optimizer state of the tensors its
partition holds, whole, under the same keys: the union over the ranks is every key once. On load
each rank reads the state of the tensors its own partition holds (at any world size, any plan).

Atomic as ``train.checkpoint.save``: a new data directory, then ``LATEST`` replaced by rank 0;
a rank dying during the save leaves ``LATEST`` naming the previous complete checkpoint.

Runtime side: imports torch's checkpoint and ``train.checkpoint``'s helpers only.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..artifacts import load_plan
from ..errors import AutoparError, PlanFileError
from ..runtime import fsdp as rf
from ..runtime.fsdp import check_optimizer as check_sharded_optimizer, check_zero1_optimizer, is_zero1
from ..runtime.dtensor import local, whole
from ..runtime.model import param_aliases
from .api import _model_file_loss, check_model, check_model_file
from .checkpoint import FORMAT, CheckpointError, _blob, _commit, _data_dir, _quiet, _unblob
from .mismatch import ModelMismatch, first_of, mismatches
from .optim import check_optimizer
from .stages import PipelineModule


def is_torch_sharded(model: Any) -> bool:
    """Whether ``model`` holds DTensor parameters (FSDP2 / DTensor) or runs ZeRO-1 on DDP
    (``runtime.fsdp.is_zero1``), not an autopar plan's (a pipeline plan's stages may be FSDP2
    inside: ``train.stages`` saves those whole, by single-process name)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(model, torch.nn.Module) or hasattr(model, "comm") or isinstance(model, PipelineModule):
        return False
    return is_zero1(model) or any(isinstance(p, DTensor) for p in model.parameters())


def _local_state(optimizer):
    """The optimizer's state and the parameters it holds state for on this rank: all of them,
    or a ZeroRedundancyOptimizer's partition (its local optimizer's)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer.optim.state, {id(p) for g in optimizer.optim.param_groups for p in g["params"]}
    return optimizer.state, {id(p) for g in optimizer.param_groups for p in g["params"]}


def _quals(model, optimizer) -> dict[int, str]:
    mine = {id(p): q for q, p in model.named_parameters()}
    out = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in mine:
                raise CheckpointError("the optimizer holds a tensor that is not a parameter of the model",
                                      "build the optimizer over model.parameters() after parallelizing")
            out[id(p)] = mine[id(p)]
    return out


def state_dict(model, optimizer=None, extra: dict | None = None) -> dict[str, Any]:
    """The checkpoint's entries (module docstring)."""
    sd: dict[str, Any] = {f"model.{q}": p.detach() for q, p in model.named_parameters()}
    sd.update({f"model.{q}": b.detach() for q, b in model.named_buffers()})
    if optimizer is not None:
        check_optimizer(optimizer)
        quals = _quals(model, optimizer)
        sd["optim.param_groups"] = _blob([{**{k: v for k, v in g.items() if k != "params"},
                                           "params": [quals[id(p)] for p in g["params"]]}
                                          for g in optimizer.param_groups])
        state, mine = _local_state(optimizer)
        for g in optimizer.param_groups:
            for p in g["params"]:
                for k, v in (state.get(p, {}) if id(p) in mine else {}).items():
                    key = f"optim.state.{quals[id(p)]}.{k}"
                    sd[key] = v.detach() if isinstance(v, torch.Tensor) else _blob(v)
    sd["extra"] = _blob(dict(extra or {}))
    world = dist.get_world_size() if dist.is_initialized() else 1
    sd["autopar"] = _blob({"format": FORMAT, "model": type(model).__name__, "world_size": world,
                           "runtime": "torch (FSDP2 / DTensor)",
                           "units": {k: str(v) for k, v in getattr(model, "_autopar_units", {}).items()}})
    return sd


def save(path: str | Path, model, optimizer=None, extra: dict | None = None) -> Path:
    """Save atomically (module docstring). Collective."""
    import torch.distributed.checkpoint as dcp
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    name = [f"ckpt-{uuid.uuid4().hex[:12]}" if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    data = path / name[0]
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    with _quiet():
        dcp.save(state_dict(model, optimizer, extra), checkpoint_id=str(data))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        _commit(path, data.name)
    if dist.is_initialized():
        dist.barrier()
    return data


def load(path: str | Path, model, optimizer=None) -> dict[str, Any]:
    """Load a checkpoint of any plan or world size into ``model`` (and ``optimizer``); returns
    the saved ``extra``. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    d = _data_dir(Path(path))
    md = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    want = {q: tuple(p.shape) for q, p in model.named_parameters()}
    want.update({q: tuple(b.shape) for q, b in model.named_buffers()})
    have = {k[len("model."):]: tuple(v.size) for k, v in md.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    bad = mismatches(want, have)
    if bad:
        raise ModelMismatch(f"checkpoint {path} is of another model: " + first_of(bad),
                            "load a checkpoint saved from this model (same parameter names and shapes)")
    params = dict(model.named_parameters())
    dest: dict[str, Any] = {f"model.{q}": torch.empty_like(p.detach()) for q, p in params.items()}
    dest.update({f"model.{q}": torch.empty_like(b) for q, b in model.named_buffers()})
    opt_keys: dict[str, tuple[str, str]] = {}
    state, mine = _local_state(optimizer) if optimizer is not None else ({}, set())
    if optimizer is not None:
        if "optim.param_groups" not in md:
            raise CheckpointError(f"checkpoint {path} holds no optimizer state", "load without the optimizer")
        dest["optim.param_groups"] = b""
        for key, m in md.items():
            if not key.startswith("optim.state."):
                continue
            qual, _, k = key[len("optim.state."):].rpartition(".")
            if qual not in params:
                raise ModelMismatch(f"checkpoint {path} has optimizer state for {qual}, which the model lacks",
                                    "load a checkpoint of this model")
            if id(params[qual]) not in mine:        # ZeRO-1: another rank's partition
                continue
            opt_keys[key] = (qual, k)
            if isinstance(m, TensorStorageMetadata):
                p = params[qual].detach()
                if tuple(m.size) == tuple(p.shape) and len(m.size) > 0:
                    dest[key] = torch.empty_like(p, dtype=m.properties.dtype)
                else:
                    dest[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            else:
                dest[key] = b""
    dest["extra"] = b""
    with _quiet():
        dcp.load(dest, checkpoint_id=str(d))
    with torch.no_grad():
        for q, p in params.items():
            v = dest[f"model.{q}"]
            local(p).copy_(local(v))
        for q, b in model.named_buffers():
            b.copy_(dest[f"model.{q}"])
    if optimizer is not None:
        groups = _unblob(dest["optim.param_groups"])
        if len(groups) != len(optimizer.param_groups):
            raise CheckpointError(f"checkpoint {path} has {len(groups)} optimizer parameter group(s), the "
                                  f"optimizer {len(optimizer.param_groups)}", "build the optimizer with the same groups")
        for g, sg in zip(optimizer.param_groups, groups):
            g.update({k: v for k, v in sg.items() if k != "params"})
        inner = getattr(optimizer, "optim", None)
        if inner is not None and state is inner.state:       # ZeRO-1: its local groups alike
            for g, sg in zip(inner.param_groups, groups):
                g.update({k: v for k, v in sg.items() if k != "params"})
        state.clear()
        for key, (qual, k) in opt_keys.items():
            v = dest[key]
            state[params[qual]][k] = v if isinstance(v, torch.Tensor) else _unblob(v)
    return _unblob(dest["extra"]) if dest["extra"] else {}


# ---- autopar.parallelize of a sharded plan ------------------------------------------------------

def is_sharded_plan(plan) -> bool:
    """Whether the plan file ``plan`` runs on torch's FSDP2 (plan.json ``runtime.expected``)."""
    p = load_plan(Path(plan))
    return p.runtime is not None and p.runtime.expected.startswith("fsdp")


_HOOKED = False


def _refuse_non_elementwise(optimizer, args, kwargs):
    """A global optimizer step pre-hook: an optimizer over sharded (DTensor) parameters that is
    not elementwise is refused at its first step, named (``runtime.fsdp.check_optimizer``)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
        check_sharded_optimizer(optimizer)
    check_zero1_optimizer(optimizer)


def parallelize(model, plan, *, sync_module_states: bool = True, **_unused):
    """``autopar.parallelize`` of a sharded plan: the user's module itself on FSDP2, units as
    plan.json says (``runtime.fsdp.parallelize``; a unit with ``ac`` checkpointed, its forward run
    again in backward, parameter names unchanged), trainable in the user's loop (any elementwise
    optimizer (a ZeRO-1 plan: ``model.make_optimizer(torch.optim.AdamW, lr=...)``, torch's
    ``ZeroRedundancyOptimizer``; a plain one is refused at its first step, named),
    ``autopar.train.clip_grad_norm_``, schedulers, ``set_requires_gradient_sync`` for
    gradient accumulation, ``autopar.save``/``load``). Each rank feeds its block of the batch
    (dim 0, ``batch.chunk(model.data_parts)[model.data_rank]``: ``chunk(world)[rank]`` without a
    tensor axis; on a (dp, tp) mesh the tp ranks of a group feed the same block) and
    back-propagates its block's mean loss (FSDP2 averages over the data axis). Refused, naming both sizes, under a process group of another world size."""
    global _HOOKED
    plan_path = Path(plan)
    p = load_plan(plan_path)
    if not (dist.is_available() and dist.is_initialized()):
        raise AutoparError(f"autopar.parallelize needs a process group: plan {plan_path} runs on {p.world_size} ranks",
                           f"start with torchrun --nproc-per-node {p.world_size} and init_process_group first")
    world = dist.get_world_size()
    if world != p.world_size:
        raise PlanFileError(f"sharded plan {plan_path} was made for world size {p.world_size}, this process group "
                            f"has {world} ranks", f"run with {p.world_size} processes, or re-plan with "
                                                  f"--world-size {world}")
    check_model_file(p, plan_path)
    check_model(model, p)
    rec = rf.sharded_record(p)
    units, root = rf.units_of(rec)
    tp, styles = rf.mesh_of(rec)
    if sync_module_states and world > 1:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)
    dev = next((t.device.type for t in model.parameters()), "cpu")
    rf.parallelize(model, rf.make_mesh(world, tp, dev), {k: v for k, v in units.items() if k}, styles, root=root)
    model.data_parts, model.data_rank = world // tp, dist.get_rank() // tp     # the block this rank feeds
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(_refuse_non_elementwise)
        _HOOKED = True
    model.autopar_plan = p
    file_loss, target_shape = _model_file_loss(p, plan_path)
    loss_fn = _unused.get("loss_fn")
    _attach_loop_api(model, loss_fn or file_loss, target_shape if loss_fn is None else None)
    return model


def _attach_loop_api(model, loss_fn, target_shape) -> None:
    """The same loop API as every other runtime's module (``train.api.ParallelModule``):
    ``loss(inputs, target)`` on this rank's dim-0 blocks returns the single-process loss on every
    rank (its gradient this rank's share: FSDP2 averages the gradients over the ranks, so the
    share is the block's own mean loss), ``reduce_loss``, ``reduce_sum``, and ``full_params`` /
    ``full_grads`` rebuilt in full on every rank."""
    import types

    def reduce_loss(self, loss_local):
        total = loss_local.detach().clone()
        dist.all_reduce(total)
        total = total / dist.get_world_size()
        return loss_local + (total - loss_local.detach())     # value: the global mean; grad: own

    def loss(self, inputs, target=None, loss_fn=None):
        xs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        out = self(*xs)
        fn = loss_fn or self.loss_fn_default
        return self.reduce_loss(fn(out, target) if target is not None else fn(out))

    def reduce_sum(self, local):
        dev = next((q.device for q in self.parameters()), torch.device("cpu"))
        t = torch.as_tensor(local, dtype=torch.float64, device=dev).clone()
        dist.all_reduce(t)
        return t

    def full_params(self):
        return {q: whole(p.detach()) for q, p in self.named_parameters()}

    def full_grads(self):
        return {q: whole(p.grad) if p.grad is not None else torch.zeros_like(whole(p.detach()))
                for q, p in self.named_parameters()}

    def full_buffers(self):
        # each rank's running statistics follow its own samples; the updates are linear in the
        # group statistics, so their mean over the ranks is the plan's (the mean over the groups)
        out = {}
        for q, b in self.named_buffers():
            if b.is_floating_point():
                t = b.detach().clone()
                dist.all_reduce(t)
                out[q] = t / dist.get_world_size()
            else:
                out[q] = b.detach().clone()
        return out

    def make_optimizer(self, optimizer_class, **defaults):
        return rf.make_optimizer(self, optimizer_class, **defaults)

    model.loss_fn_default = loss_fn
    model.target_shape = target_shape
    model.bufs = dict(model.named_buffers())      # what ``full_state_dict`` lists (as DistModel's)
    model.param_aliases = param_aliases(model)    # and a tied weight's other names
    for fn in (reduce_loss, loss, reduce_sum, full_params, full_grads, full_buffers, make_optimizer):
        setattr(model, fn.__name__, types.MethodType(fn, model))
