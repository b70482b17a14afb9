"""Checkpoints of a parallelized model and its optimizer, movable between plans and world sizes.

Format: ``torch.distributed.checkpoint`` (DCP). Keys, all in single-process terms::

    model.<qual>               every parameter (global shape) and every buffer
    optim.state.<qual>.<key>   optimizer state of a parameter: tensors shaped like it are
                               sharded with it (exp_avg, momentum_buffer...), others (Adam's
                               scalar ``step``) are saved once
    optim.param_groups         hyper-parameters of each group and the names of its parameters
    extra                      the caller's picklable objects (scheduler state, step, ...)
    autopar                    what saved it: model name, world size, plan decisions

A sharded parameter is written by the owner of each shard only (the lowest rank of its
``grad_group``), as a ``ShardedTensor`` whose shards carry their exact offsets (the plan's
``tensor_split`` blocks, which DTensor's chunk rule cannot express when a dim does not divide
evenly). A rank's block that is several boxes of the parameter (a *segmented* shard: a fused
q|k|v weight split by heads holds a block of each of q, k and v) is several shards of that
rank; a rank holding nothing of a parameter (a branch held by another group) writes no shard,
so each parameter is covered by its owners' shards exactly once; whole parameters and buffers are plain tensors, which DCP writes once. Loading
asks DCP for the blocks of the *loading* plan (owners read them, then broadcast to the other
holders of the same shard), so a checkpoint saved under one plan or world size loads under
any other: DCP reads the overlap of every saved chunk with every wanted block.

Atomic save. A checkpoint ``PATH`` is a directory holding data directories and a ``LATEST``
file naming the current one. ``save`` writes a new data directory, then rank 0 replaces
``LATEST`` atomically (``autopar.io.atomic_write_text``: temporary file + ``os.replace``)
and removes the previous data directory. A crash at any point leaves ``LATEST`` naming a
complete checkpoint (the previous one until the replace, the new one after it); stale data
directories of a crashed save are removed by the next save. ``load`` also reads a plain DCP
directory (one holding ``.metadata``).

``full_state_dict`` / ``load_full_state_dict``: the single-process ``model.state_dict()``
assembled on every rank, and the reverse (each rank keeps its shard);
``full_optimizer_state_dict`` / ``load_full_optimizer_state_dict`` likewise for the optimizer,
keyed by parameter name (the form of ``torch.distributed.checkpoint.state_dict``'s
``get_optimizer_state_dict`` with ``full_state_dict=True``).
"""

from __future__ import annotations

import contextlib
import json
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutoparError
from .mismatch import FIRST_MISMATCHES, ModelMismatch, first_of, mismatches
from .stages import PipelineModule, load as stages_load, save as stages_save
from ..io import atomic_write_text
from .optim import check_optimizer

FORMAT = "autopar.checkpoint/1"
LATEST = "LATEST"


class CheckpointError(AutoparError):
    """A checkpoint that is missing, incomplete, or cannot be written."""


@contextlib.contextmanager
def _quiet():
    # DCP warns that ShardedTensor is deprecated in favour of DTensor; DTensor cannot express
    # the plan's uneven blocks (module docstring), so the warning says nothing actionable here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*TypedStorage.*", category=UserWarning)
        yield


def _need_default_group(dmodel) -> None:
    if dmodel.comm.world > 1 and not dmodel.comm.is_default_group:
        raise CheckpointError("checkpoints of a plan on a sub-mesh are not supported",
                              "run the plan on the whole process group")


def _boxes(dmodel, qual: str, global_shape) -> list[tuple[list[int], list[int], tuple]]:
    """This rank's block of ``qual`` as boxes of the global tensor: ``(offsets, sizes,
    local_index)`` with ``local[local_index]`` the box's values. One box for a plain shard,
    one per contiguous run of rows for a segmented one (a fused q|k|v weight split by heads
    holds a block of each segment); boxes of no volume (a branch parameter held by another
    group) are left out."""
    sh = dmodel.param_shard(qual)
    comm = dmodel.comm
    shape = [int(n) for n in global_shape]
    if not (sh.segments and len(sh.segments) > 1):
        b = sh.local_bounds(shape, comm.rank, comm.world)
        out = [([s for s, _ in b], [e for _, e in b], tuple(slice(None) for _ in b))]
    else:
        idx = sh.index(shape, comm.rank, comm.world)
        seg = next(d for d, i in enumerate(idx) if isinstance(i, list))
        offs, sizes = [], []
        for d, i in enumerate(idx):
            if d == seg:
                offs.append(0)
                sizes.append(0)
            else:
                a, z, _ = i.indices(shape[d])
                offs.append(a)
                sizes.append(max(z - a, 0))
        out, rows, start = [], idx[seg], 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and rows[end] == rows[end - 1] + 1:
                end += 1
            o, z = list(offs), list(sizes)
            o[seg], z[seg] = rows[start], end - start
            li = [slice(None)] * len(shape)
            li[seg] = slice(start, end)
            out.append((o, z, tuple(li)))
            start = end
    return [b for b in out if all(n > 0 for n in b[1]) or not b[1]]


def _sharded(dmodel, qual: str, local: torch.Tensor, global_shape, fill: bool = False) -> Any:
    """``local`` (this rank's block of ``qual``'s layout) as what DCP saves or fills: a plain
    tensor when the parameter is whole, else a ShardedTensor of the owners' boxes
    (``_boxes``). Saving (``fill`` False): the boxes are views of ``local`` (copies where a
    view would not be contiguous).
    Loading (``fill`` True): the boxes are fresh tensors; ``_unbox`` copies them into
    ``local`` after ``dcp.load``."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
    sh = dmodel.param_shard(qual)
    if not sh.dims or dmodel.comm.world == 1:
        return local
    comm = dmodel.comm
    shards = []
    if dmodel.shard_owner(qual):
        for offs, sizes, li in _boxes(dmodel, qual, global_shape):
            t = torch.empty(sizes, dtype=local.dtype, device=local.device) if fill \
                else local[li].detach().contiguous()
            md = ShardMetadata(offs, sizes, f"rank:{comm.global_rank(comm.rank)}/{local.device}")
            shards.append(Shard(t, md))
    return init_from_local_shards(shards, *[int(n) for n in global_shape])


def _unbox(dmodel, qual: str, st: Any, local: torch.Tensor, global_shape) -> None:
    """Copy the boxes of ``st`` (``_sharded(..., fill=True)`` after ``dcp.load``) into
    ``local``."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    if not isinstance(st, ShardedTensor):
        return
    boxes = {tuple(o): li for o, _, li in _boxes(dmodel, qual, global_shape)}
    with torch.no_grad():
        for shard in st.local_shards():
            local[boxes[tuple(shard.metadata.shard_offsets)]] = shard.tensor


def _broadcast_shard(dmodel, qual: str, t: torch.Tensor) -> None:
    """Copy the owner's block of ``qual`` to every rank holding the same block."""
    comm = dmodel.comm
    grp = dmodel.param_shard(qual).grad_group(comm.rank, comm.world)
    if len(grp) > 1:
        dist.broadcast(t, src=comm.global_rank(min(grp)), group=comm.group(grp))


# ---------------------------------------------------------------------------------------------
# state dicts in DCP form
# ---------------------------------------------------------------------------------------------
def _buffers(dmodel) -> dict[str, torch.Tensor]:
    """Every buffer, floating ones assembled in full (a channel-sharded batch norm's running
    statistics are valid only in each rank's slice: ``full_buffers``)."""
    full = dmodel.full_buffers()
    return {q: (full[q] if q in full else b.detach().clone()) for q, b in dmodel.bufs.items()}


def sharded_state_dict(dmodel) -> dict[str, Any]:
    """The model's state dict in DCP form, keyed by single-process names (what
    ``dmodel.state_dict()`` returns, as an FSDP2 module's does): a sharded parameter is a
    ShardedTensor of its owners' blocks that *shares storage* with the parameters (so
    ``dcp.load`` fills them in place), a whole parameter the parameter's tensor, a buffer its
    full value. Collective (buffers are assembled)."""
    shapes = dmodel.global_shapes()
    sd: dict[str, Any] = {}
    for qual, p in dmodel.local_params().items():
        sd[qual] = _sharded(dmodel, qual, p.detach(), shapes[qual])
    sd.update(_buffers(dmodel))
    return sd


def load_sharded_state_dict(dmodel, sd: dict[str, Any]) -> None:
    """Finish loading ``sd`` (``sharded_state_dict``'s dict after ``dcp.load``, or a full
    single-process state dict): whole tensors and buffers copied, each shard's owner block
    broadcast to the other ranks holding it. Collective."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    _same_model(dmodel, {k: tuple(v.size() if isinstance(v, ShardedTensor) else v.shape) for k, v in sd.items()})
    comm = dmodel.comm
    with torch.no_grad():
        for qual, p in dmodel.local_params().items():
            v = sd[qual]
            if isinstance(v, ShardedTensor):
                if dmodel.shard_owner(qual):
                    _unbox(dmodel, qual, v, p.data, tuple(v.size()))
                _broadcast_shard(dmodel, qual, p.data)
            else:
                blk = v[dmodel.param_shard(qual).index(v.shape, comm.rank, comm.world)]
                if blk.data_ptr() != p.data_ptr():
                    p.copy_(blk)
        for q, b in dmodel.bufs.items():
            if sd[q] is not b:
                b.copy_(sd[q])


def _state_dict(dmodel, optimizer=None, extra=None) -> dict[str, Any]:
    sd: dict[str, Any] = {f"model.{k}": v for k, v in sharded_state_dict(dmodel).items()}
    shapes = dmodel.global_shapes()
    if optimizer is not None:
        quals = _optimizer_quals(dmodel, optimizer)
        groups = []
        for g in optimizer.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [quals[id(p)] for p in g["params"]]})
        sd["optim.param_groups"] = _blob(groups)
        for g in optimizer.param_groups:
            for p in g["params"]:
                qual = quals[id(p)]
                for k, v in optimizer.state.get(p, {}).items():
                    key = f"optim.state.{qual}.{k}"
                    if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) and v.dim() > 0:
                        sd[key] = _sharded(dmodel, qual, v.detach(), shapes[qual])
                    else:
                        sd[key] = v.detach().clone() if isinstance(v, torch.Tensor) else _blob(v)
    sd["extra"] = _blob(dict(extra or {}))
    sd["autopar"] = _blob({"format": FORMAT, "model": dmodel.plan.model.name, "world_size": dmodel.comm.world,
                           "decisions": [d.choice for d in dmodel.plan.layers]})
    return sd


def _blob(obj: Any) -> bytes:
    """One opaque DCP entry for a nested object (DCP would flatten dicts and lists into one
    entry per leaf, and then load only into the same nesting), written as JSON: a checkpoint
    holds data, never code (tuples come back as lists; optimizers and schedulers accept both)."""
    try:
        return json.dumps(obj, allow_nan=True).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot save {type(obj).__name__} in a checkpoint: {e}",
                              "pass plain data (numbers, strings, lists, dicts) in extra=...") from None


def _unblob(data: Any) -> Any:
    """The object ``_blob`` wrote."""
    raw = bytes(data.tolist()) if isinstance(data, torch.Tensor) else data
    return json.loads(raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw)


def _optimizer_quals(dmodel, optimizer) -> dict[int, str]:
    mine = {id(p): q for q, p in dmodel.local_params().items()}
    out = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in mine:
                raise AutoparError("the optimizer holds a tensor that is not a parameter of the "
                                   "parallelized model", "build the optimizer over dmodel.parameters()")
            out[id(p)] = mine[id(p)]
    return out


# ---------------------------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------------------------
def _data_dir(path: Path) -> Path:
    """The data directory a checkpoint path stands for (``LATEST``, or a plain DCP dir)."""
    if (path / ".metadata").is_file():
        return path
    latest = path / LATEST
    if not latest.is_file():
        raise CheckpointError(f"no checkpoint at {path} (no {LATEST} file and no DCP .metadata)",
                              "give the path passed to autopar.train.save")
    d = path / latest.read_text().strip()
    if not (d / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} names {d.name}, which is incomplete", "save again")
    return d


def save(path: str | Path, dmodel, optimizer=None, extra: dict[str, Any] | None = None) -> Path:
    """Save the model (and optimizer, and ``extra``) to the checkpoint directory ``path``,
    atomically (module docstring). Collective: every rank calls it. Returns the data directory."""
    if isinstance(dmodel, PipelineModule):          # pipeline stages: whole tensors per stage
        return stages_save(path, dmodel, {**_pipeline_optimizer_entries(dmodel, optimizer),
                                          "extra": _blob(dict(extra or {})),
                                          "autopar": _blob({"format": FORMAT, "model": dmodel.plan.model.name,
                                                            "world_size": dist.get_world_size(),
                                                            "stages": dmodel.layout.to_json()})})
    _need_default_group(dmodel)
    import torch.distributed.checkpoint as dcp

    if optimizer is not None:
        check_optimizer(optimizer)
    path = Path(path)
    comm = dmodel.comm
    name = [f"ckpt-{uuid.uuid4().hex[:12]}" if comm.rank == 0 else None]
    if comm.world > 1:
        dist.broadcast_object_list(name, src=comm.global_rank(0))
    data = path / name[0]
    if comm.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    with _quiet():
        sd = _state_dict(dmodel, optimizer, extra)
        dcp.save(sd, checkpoint_id=str(data))
    comm.barrier()   # every rank's files and rank 0's .metadata are written
    if comm.rank == 0:
        _commit(path, data.name)
    comm.barrier()
    return data


def _pipeline_optimizer_entries(dmodel: PipelineModule, optimizer) -> dict[str, Any]:
    """The optimizer's entries under a pipeline plan, in the format above: each rank's state for
    the whole parameters of its stage (dp replicas write equal copies; DCP keeps one), and the
    groups' parameter names gathered from every stage (hyper-parameters must agree)."""
    if optimizer is None:
        return {}
    check_optimizer(optimizer)
    quals = {id(p): q for q, p in dmodel.named_parameters()}
    groups = []
    for g in optimizer.param_groups:
        if any(id(p) not in quals for p in g["params"]):
            raise AutoparError("the optimizer holds a tensor that is not a parameter of this stage",
                               "build the optimizer over dmodel.parameters()")
        groups.append(({k: v for k, v in g.items() if k != "params"}, [quals[id(p)] for p in g["params"]]))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [(_unblob(_blob(h)), names) for h, names in groups])
    merged = []
    for i, (hyper, _) in enumerate(groups):
        if any(len(o) != len(groups) or o[i][0] != _unblob(_blob(hyper)) for o in every):
            raise CheckpointError("the stages' optimizers differ in their parameter groups or hyper-parameters",
                                  "build the same optimizer (same groups and settings) on every rank")
        merged.append({**hyper, "params": sorted({q for o in every for q in o[i][1]})})
    sd: dict[str, Any] = {"optim.param_groups": _blob(merged)}
    for g in optimizer.param_groups:            # the same order on every tp rank of a stage (whole() gathers)
        for p in g["params"]:
            q = quals[id(p)]
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(p.shape):
                    sd[f"optim.state.{q}.{k}"] = dmodel.whole(q, v).clone()     # a tp slice: gathered whole
                else:
                    sd[f"optim.state.{q}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else _blob(v)
    return sd


def _load_pipeline_optimizer(path: str | Path, dmodel: PipelineModule, optimizer) -> None:
    """Fill ``optimizer`` (over this stage's parameters) from any checkpoint with optimizer state:
    whole tensors of this stage's parameters (DCP reads them from whatever shards were saved)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    d = _data_dir(Path(path))
    md = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    if "optim.param_groups" not in md:
        raise CheckpointError(f"checkpoint {path} holds no optimizer state", "load without the optimizer")
    params = dict(dmodel.named_parameters())
    quals = {id(p): q for q, p in params.items()}
    dest: dict[str, Any] = {"optim.param_groups": b""}
    mine: dict[str, tuple[str, str]] = {}
    for key, m in md.items():
        if key.startswith("optim.state."):
            qual, _, k = key[len("optim.state."):].rpartition(".")
            if qual in params:
                mine[key] = (qual, k)
                dest[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype) \
                    if isinstance(m, TensorStorageMetadata) else b""
    with _quiet():
        dcp.load(dest, checkpoint_id=str(d))
    saved_groups = _unblob(dest["optim.param_groups"])
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {path} has {len(saved_groups)} optimizer parameter group(s), the "
                              f"optimizer {len(optimizer.param_groups)}", "build the optimizer with the same parameter groups")
    for g, sg in zip(optimizer.param_groups, saved_groups):
        if not {quals.get(id(p)) for p in g["params"]} <= set(sg["params"]):
            raise CheckpointError(f"checkpoint {path}: an optimizer group holds other parameters than the saved one",
                                  "build the optimizer's groups as when saving")
        g.update({k: v for k, v in sg.items() if k != "params"})
    optimizer.state.clear()
    for key, (qual, k) in mine.items():
        v, p = dest[key], params[qual]
        if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == dmodel.whole_shape(qual, p):
            v = dmodel.part(qual, v)                  # this rank's tp slice of a whole state tensor
        optimizer.state[p][k] = v if isinstance(v, torch.Tensor) else _unblob(v)


def _load_extra(path: str | Path) -> dict[str, Any]:
    """The saved ``extra`` (every plan writes it; {} when the checkpoint has none). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    d = _data_dir(Path(path))
    if "extra" not in FileSystemReader(str(d)).read_metadata().state_dict_metadata:
        return {}
    dest: dict[str, Any] = {"extra": b""}
    with _quiet():
        dcp.load(dest, checkpoint_id=str(d))
    return _unblob(dest["extra"]) if dest["extra"] else {}


def _commit(path: Path, name: str) -> None:
    """Point ``LATEST`` at ``name`` atomically, then remove every other data directory."""
    import shutil

    atomic_write_text(path / LATEST, name + "\n")
    for d in path.iterdir():
        if d.is_dir() and d.name.startswith("ckpt-") and d.name != name:
            shutil.rmtree(d, ignore_errors=True)


def expected_keys(dmodel) -> dict[str, tuple[int, ...]]:
    """Single-process shape of every ``model.*`` entry a checkpoint of ``dmodel`` has."""
    out = {q: tuple(s) for q, s in dmodel.global_shapes().items()}
    out.update({q: tuple(b.shape) for q, b in dmodel.bufs.items()})
    return out


def check_checkpoint(path: str | Path, dmodel) -> dict[str, Any]:
    """The checkpoint's DCP metadata, after checking that its model entries have the names and
    shapes of ``dmodel``'s (``ModelMismatch`` lists the first mismatches)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    d = _data_dir(Path(path))
    md = FileSystemReader(str(d)).read_metadata().state_dict_metadata
    have = {k[len("model."):]: tuple(v.size) for k, v in md.items()
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    bad = mismatches(expected_keys(dmodel), have)
    if bad:
        raise ModelMismatch(f"checkpoint {path} is of another model: "
                            + first_of(bad),
                            "load a checkpoint saved from this model (same parameter names and shapes)")
    return md


def load(path: str | Path, dmodel, optimizer=None) -> dict[str, Any]:
    """Load a checkpoint saved under any plan or world size into ``dmodel`` (and
    ``optimizer``, built over ``dmodel.parameters()``); returns the saved ``extra``.
    Collective: every rank calls it."""
    if isinstance(dmodel, PipelineModule):
        stages_load(path, dmodel)
        if optimizer is not None:
            _load_pipeline_optimizer(path, dmodel, optimizer)
        return _load_extra(path)
    _need_default_group(dmodel)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = check_checkpoint(path, dmodel)
    d = _data_dir(Path(path))
    shapes = dmodel.global_shapes()
    params = dmodel.local_params()
    dest: dict[str, Any] = {}
    local: dict[str, torch.Tensor] = {}     # key -> this rank's block, filled by DCP or broadcast
    for qual, p in params.items():
        local[f"model.{qual}"] = torch.empty_like(p.detach())
    opt_state: dict[str, tuple[str, str, TensorStorageMetadata]] = {}
    if optimizer is not None:
        if "optim.param_groups" not in md:
            raise CheckpointError(f"checkpoint {path} holds no optimizer state", "load without the optimizer")
        quals = _optimizer_quals(dmodel, optimizer)
        dest["optim.param_groups"] = b""
        for key, m in md.items():
            if not key.startswith("optim.state."):
                continue
            rest = key[len("optim.state."):]
            qual, _, k = rest.rpartition(".")
            if qual not in params:
                raise ModelMismatch(f"checkpoint {path} has optimizer state for {qual}, which the "
                                    f"model lacks", "load a checkpoint of this model")
            opt_state[key] = (qual, k, m)
            if isinstance(m, TensorStorageMetadata):
                if tuple(m.size) == tuple(shapes[qual]) and len(m.size) > 0:
                    local[key] = torch.empty_like(params[qual].detach(), dtype=m.properties.dtype)
                else:
                    dest[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            else:
                dest[key] = b""
    for key, t in local.items():
        qual = key[len("model."):] if key.startswith("model.") else opt_state[key][0]
        dest[key] = _sharded(dmodel, qual, t, shapes[qual], fill=True)
    for q, b in dmodel.bufs.items():
        dest[f"model.{q}"] = torch.empty_like(b)
    dest["extra"] = b""
    with _quiet():
        dcp.load(dest, checkpoint_id=str(d))
    for key, t in local.items():
        qual = key[len("model."):] if key.startswith("model.") else opt_state[key][0]
        if dmodel.param_shard(qual).dims and dmodel.comm.world > 1:
            _unbox(dmodel, qual, dest[key], t, shapes[qual])
            _broadcast_shard(dmodel, qual, t)
    with torch.no_grad():
        for qual, p in params.items():
            p.copy_(local[f"model.{qual}"])
        for q, b in dmodel.bufs.items():
            b.copy_(dest[f"model.{q}"])
    if optimizer is not None:
        by_qual = {q: p for q, p in params.items()}
        saved_groups = _unblob(dest["optim.param_groups"])
        if len(saved_groups) != len(optimizer.param_groups):
            raise CheckpointError(f"checkpoint {path} has {len(saved_groups)} optimizer parameter "
                                  f"group(s), the optimizer {len(optimizer.param_groups)}",
                                  "build the optimizer with the same parameter groups")
        quals = _optimizer_quals(dmodel, optimizer)
        for g, sg in zip(optimizer.param_groups, saved_groups):
            if sorted(quals[id(p)] for p in g["params"]) != sorted(sg["params"]):
                raise CheckpointError(f"checkpoint {path}: an optimizer group holds other parameters "
                                      f"than the saved one", "build the optimizer's groups as when saving")
            g.update({k: v for k, v in sg.items() if k != "params"})
        optimizer.state.clear()
        for key, (qual, k, _) in opt_state.items():
            v = local[key] if key in local else dest[key]
            if not isinstance(v, torch.Tensor):
                v = _unblob(v)
            optimizer.state[by_qual[qual]][k] = v
    return _unblob(dest["extra"]) if dest["extra"] else {}


# ---------------------------------------------------------------------------------------------
# the single-process state dict
# ---------------------------------------------------------------------------------------------
def full_state_dict(dmodel) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` of the single-process model (parameters and buffers in full),
    on every rank. Collective."""
    if isinstance(dmodel, PipelineModule):          # pipeline stages: gathered from every stage
        return dmodel.full_state_dict()
    out = dict(dmodel.full_params())
    for alias, name in getattr(dmodel, "param_aliases", {}).items():   # a tied weight under each name
        if name in out:
            out[alias] = out[name]
    out.update(_buffers(dmodel))
    return out


def _same_model(dmodel, have: dict[str, tuple]) -> None:
    """``ModelMismatch`` listing the first differences when a state dict's names or shapes are
    not this model's."""
    bad = mismatches(expected_keys(dmodel), have)
    if bad:
        raise ModelMismatch("the state dict is of another model: " + first_of(bad),
                            "load a state dict of this model")


def load_full_state_dict(dmodel, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a single-process ``state_dict`` (every rank passes the same one): each rank keeps
    its block of every parameter (``ModelMismatch`` when names or shapes differ)."""
    if isinstance(dmodel, PipelineModule):
        dmodel.load_full_state_dict(state_dict)
        return
    aliases = getattr(dmodel, "param_aliases", {})     # a tied weight's other names: the same tensor
    state_dict = {k: v for k, v in state_dict.items() if k not in aliases}
    _same_model(dmodel, {k: tuple(v.shape) for k, v in state_dict.items()})
    comm = dmodel.comm
    with torch.no_grad():
        for qual, p in dmodel.local_params().items():
            full = state_dict[qual]
            p.copy_(full[dmodel.param_shard(qual).index(full.shape, comm.rank, comm.world)])
        for q, b in dmodel.bufs.items():
            b.copy_(state_dict[q])


def _assemble(dmodel, qual: str, local: torch.Tensor, global_shape) -> torch.Tensor:
    """The full tensor of ``qual``'s layout from every rank's block (collective over the mesh;
    each block added once, by its owner)."""
    sh = dmodel.param_shard(qual)
    comm = dmodel.comm
    if not sh.dims or comm.world == 1:
        return local.detach().clone()
    full = torch.zeros(tuple(global_shape), dtype=local.dtype, device=local.device)
    if dmodel.shard_owner(qual):
        full[sh.index(global_shape, comm.rank, comm.world)] = local.detach()
    return comm.all_reduce_(full)


def full_optimizer_state_dict(dmodel, optimizer) -> dict[str, Any]:
    """The single-process optimizer state, on every rank: ``{"state": {qual: {key: value}},
    "param_groups": [{..., "params": [qual, ...]}]}`` with every tensor shaped like its
    parameter assembled in full. Collective."""
    quals = _optimizer_quals(dmodel, optimizer)
    shapes = dmodel.global_shapes()
    state: dict[str, dict[str, Any]] = {}
    groups = []
    for g in optimizer.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [quals[id(p)] for p in g["params"]]})
        for p in g["params"]:
            qual = quals[id(p)]
            st = optimizer.state.get(p, {})
            out = {}
            for k in sorted(st):
                v = st[k]
                if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) and v.dim() > 0:
                    out[k] = _assemble(dmodel, qual, v, shapes[qual])
                else:
                    out[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
            if out:
                state[qual] = out
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state_dict(dmodel, optimizer, osd: dict[str, Any]) -> None:
    """Load ``full_optimizer_state_dict``'s form (every rank passes the same one): each rank
    keeps its block of every parameter-shaped state tensor."""
    quals = _optimizer_quals(dmodel, optimizer)
    params = dmodel.local_params()
    shapes = dmodel.global_shapes()
    unknown = [q for q in osd.get("state", {}) if q not in params]
    if unknown:
        raise ModelMismatch(f"optimizer state for parameters the model lacks: {unknown[:FIRST_MISMATCHES]}",
                            "load an optimizer state of this model")
    if len(osd["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{len(osd['param_groups'])} saved optimizer group(s), the optimizer has "
                              f"{len(optimizer.param_groups)}", "build the optimizer with the same groups")
    for g, sg in zip(optimizer.param_groups, osd["param_groups"]):
        if sorted(quals[id(p)] for p in g["params"]) != sorted(sg["params"]):
            raise CheckpointError("an optimizer group holds other parameters than the saved one",
                                  "build the optimizer's groups as when saving")
        g.update({k: v for k, v in sg.items() if k != "params"})
    comm = dmodel.comm
    optimizer.state.clear()
    for qual, st in osd.get("state", {}).items():
        p = params[qual]
        out = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(shapes[qual]) and v.dim() > 0:
                v = v[dmodel.param_shard(qual).index(v.shape, comm.rank, comm.world)]
            out[k] = v.detach().clone().to(p.device) if isinstance(v, torch.Tensor) else v
        optimizer.state[p] = out
