"""Training with a plan in the user's own loop (the runtime side: no solver, tracer or cost model).

* ``parallelize(model, "plan.json")`` -> this rank's part of the model (``api``);
* ``plan_loader`` / ``PlanSampler`` / ``shard_batch`` / ``BatchSharding``: what each rank loads
  of a global batch, ``BatchMismatch`` for a batch or item that does not fit the plan (``data``);
* ``clip_grad_norm_`` / ``grad_norm``: by the global norm, each shard counted once (``optim``);
* ``save`` / ``load`` (DCP, any plan or world size; a model on torch's FSDP2 / DTensor,
  ``runtime.fsdp``, in the same format: ``sharded``), ``full_state_dict`` /
  ``load_full_state_dict`` and ``full_optimizer_state_dict`` /
  ``load_full_optimizer_state_dict`` (the single-process state dicts) (``checkpoint``).
"""

from ..runtime import fsdp as _fsdp
from . import checkpoint as _checkpoint, optim as _optim, sharded as _sharded
from . import api as _api
from .api import ModelMismatch, ParallelModule, init_distributed
from .checkpoint import (CheckpointError, full_optimizer_state_dict, full_state_dict,
                         load_full_optimizer_state_dict, load_full_state_dict)
from .data import BatchMismatch, BatchSharding, PlanSampler, plan_loader, shard_batch
from .optim import check_optimizer, grad_norm


def parallelize(model, plan, **kwargs):
    """``api.parallelize``, or ``sharded.parallelize`` for a plan that runs on torch's FSDP2."""
    if _sharded.is_sharded_plan(plan):
        return _sharded.parallelize(model, plan, **kwargs)
    return _api.parallelize(model, plan, **kwargs)


def save(path, dmodel, optimizer=None, extra=None):
    """``checkpoint.save``, or ``sharded.save`` for a model on torch's FSDP2 / DTensor."""
    if _sharded.is_torch_sharded(dmodel):
        return _sharded.save(path, dmodel, optimizer, extra)
    return _checkpoint.save(path, dmodel, optimizer, extra)


def load(path, dmodel, optimizer=None):
    """``checkpoint.load``, or ``sharded.load`` for a model on torch's FSDP2 / DTensor."""
    if _sharded.is_torch_sharded(dmodel):
        return _sharded.load(path, dmodel, optimizer)
    return _checkpoint.load(path, dmodel, optimizer)


def clip_grad_norm_(dmodel, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
    """``optim.clip_grad_norm_``, or ``runtime.fsdp.clip_grad_norm_`` over every mesh for a
    model on torch's FSDP2 / DTensor."""
    if _sharded.is_torch_sharded(dmodel):
        total = _fsdp.clip_grad_norm_(dmodel.parameters(), max_norm, norm_type)
        if error_if_nonfinite and not bool(total.isfinite()):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
        return total
    return _optim.clip_grad_norm_(dmodel, max_norm, norm_type, error_if_nonfinite)

__all__ = ["BatchMismatch", "BatchSharding", "CheckpointError", "ModelMismatch", "ParallelModule", "PlanSampler",
           "check_optimizer", "clip_grad_norm_", "full_optimizer_state_dict", "full_state_dict", "grad_norm", "init_distributed",
           "load", "load_full_optimizer_state_dict", "load_full_state_dict", "parallelize", "plan_loader", "save", "shard_batch"]
