"""Training with a plan in the user's own loop (the runtime side: no solver, tracer or cost model).

* ``parallelize(model, "plan.json")`` -> this rank's part of the model (``api``);
* ``plan_loader`` / ``PlanSampler`` / ``shard_batch`` / ``BatchSharding``: what each rank loads
  of a global batch, ``BatchMismatch`` for a batch or item that does not fit the plan (``data``);
* ``clip_grad_norm_`` / ``grad_norm``: by the global norm, each shard counted once (``optim``);
* ``save`` / ``load`` (DCP, any plan or world size), ``full_state_dict`` /
  ``load_full_state_dict`` and ``full_optimizer_state_dict`` /
  ``load_full_optimizer_state_dict`` (the single-process state dicts) (``checkpoint``).
"""

from .api import ModelMismatch, ParallelModule, init_distributed, parallelize
from .checkpoint import (CheckpointError, full_optimizer_state_dict, full_state_dict, load,
                         load_full_optimizer_state_dict, load_full_state_dict, save)
from .data import BatchMismatch, BatchSharding, PlanSampler, plan_loader, shard_batch
from .optim import check_optimizer, clip_grad_norm_, grad_norm

__all__ = ["BatchMismatch", "BatchSharding", "CheckpointError", "ModelMismatch", "ParallelModule", "PlanSampler",
           "check_optimizer", "clip_grad_norm_", "full_optimizer_state_dict", "full_state_dict", "grad_norm", "init_distributed",
           "load", "load_full_optimizer_state_dict", "load_full_state_dict", "parallelize", "plan_loader", "save", "shard_batch"]
