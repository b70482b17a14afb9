"""Optimizers and gradient clipping on a parallelized model.

Which optimizers are correct. Every rank holds, per parameter, either a shard (a block of a
sharded weight, ``ParamShard``) or a whole replica; after backward ``GradSync`` has summed
each gradient over the ranks holding the same shard, so every holder of a shard sees the
single-process gradient of that block. An *elementwise* optimizer (SGD with or without
momentum and weight decay, Adam, AdamW, Adagrad, RMSprop, Adamax, ...) updates each element
from that element's gradient and state only, so running it on every rank's shard gives each
block exactly its single-process update, its state (momentum, ``exp_avg``...) sharded with the
weight, and replicas stay equal. Learning-rate schedulers change ``lr`` only and work
unchanged. Optimizers that look across elements (LBFGS, Shampoo, LAMB/LARS trust ratios,
anything using a per-tensor norm) are **not** correct on shards: ``check_optimizer`` refuses
the known ones.

Clipping by the global norm. ``torch.nn.utils.clip_grad_norm_`` on one rank's shards uses
that rank's norm, which differs per rank and from one process. ``clip_grad_norm_`` here counts
every shard exactly once: ``||g||_p^p = sum_params sum_{shards s} ||g_s||_p^p`` where each
rank adds the shards it owns (the lowest rank of a shard's ``grad_group``; replicated
parameters: mesh rank 0), one all-reduce (SUM, or MAX for ``p = inf``) over the mesh, then the
same scale ``min(1, max_norm / (norm + 1e-6))`` as torch on every rank.
"""

from __future__ import annotations

import math

import torch
from ..errors import AutoparError
from ..runtime.dtensor import local
from .stages import PipelineModule

#: optimizers whose update is not elementwise (wrong on shards)
NON_ELEMENTWISE = ("LBFGS",)


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer known not to be elementwise (module docstring)."""
    name = type(optimizer).__name__
    if name in NON_ELEMENTWISE:
        raise AutoparError(f"{name} is not elementwise: on sharded parameters it computes another "
                           f"update than one process", "use SGD, Adam, AdamW or another elementwise optimizer")


def grad_norm(dmodel, norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm of ``dmodel`` (every shard counted once), on every rank: the
    pieces this rank counts (a plan's shard owners; a pipeline's ``norm_pieces``) reduced over
    the world."""
    import torch.distributed as dist
    norm_type = float(norm_type)
    if isinstance(dmodel, PipelineModule):
        pieces, device = dmodel.norm_pieces(), torch.device("cpu")
        reduce = dist.all_reduce
    else:
        comm = dmodel.comm
        pieces = [p.grad for qual, p in dmodel.local_params().items()
                  if p.grad is not None and dmodel.shard_owner(qual)]
        device = comm.device
        reduce = (lambda t, op: comm.all_reduce_(t, op=op)) if comm.world > 1 else None
    acc = torch.zeros((), dtype=torch.float64, device=device)
    for g in pieces:
        g = g.detach().to(torch.float64)
        if math.isinf(norm_type):
            acc = torch.maximum(acc, g.abs().max() if g.numel() else acc)
        else:
            acc = acc + g.abs().pow(norm_type).sum()
    if reduce is not None:
        reduce(acc, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    return acc if math.isinf(norm_type) else acc.pow(1.0 / norm_type)


def clip_grad_norm_(dmodel, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ``dmodel`` by their global norm (as
    ``torch.nn.utils.clip_grad_norm_`` does in one process); returns the norm before clipping.
    Collective: every rank calls it after backward."""
    total = grad_norm(dmodel, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in dmodel.parameters():               # a pipeline stage's FSDP2 shards: their local rows
        if p.grad is not None:
            local(p.grad).detach().mul_(coef.to(device=p.grad.device, dtype=p.grad.dtype))
    return total
