"""The torch DDP baseline of ``autopar execute``: the same model and batch, samples split over
the plan's mesh, timed like the plan (``execute.timing``) in the same processes.

Same function or not (``Baseline.equivalent``, said in the report): with local batch-norm
statistics over groups of G = N / world samples, plain DDP computes exactly the plan's function
(each rank normalises its own N / world samples); with global statistics the same function is
DDP + ``SyncBatchNorm``, used where the backend has it (CUDA); on CPU none exists, and the
baseline says so. A model without batch norm: plain DDP is always the same function.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

from ..artifacts import Baseline
from ..decomp.graph.graphs import graph_roles
from ..decomp.sharding import Sharding, Shard
from ..runtime.comm import local_slice
from ..runtime.graphs import graph_rows, split_graph_batch


@dataclass
class DDPRunner:
    """torch DDP on the plan's batch, ready to step (``ddp_runner``); ``result`` makes the
    ``Baseline`` of its timed steps."""
    model: object
    optim: object
    inputs: list
    loss_of: Callable
    equivalent: bool
    note: str
    sync_bn: bool
    allreduce_bytes: int
    bn_stats: object = None

    def step_args(self) -> tuple:
        """What ``execute.timing.timed_steps`` takes before ``n``."""
        return self.model, self.optim, self.inputs, self.loss_of, lambda: None

    def result(self, times: list[float]) -> Baseline:
        return Baseline(
            ddp_step_times_s=tuple(times), ddp_step_time_s=statistics.median(times),
            ddp_allreduce_bytes_per_step=self.allreduce_bytes, equivalent=self.equivalent, note=self.note,
            extra={"batch_norm": self.bn_stats.to_json() if self.bn_stats is not None else None,
                   "sync_batch_norm": self.sync_bn})


def ddp_runner(mf, xs, ys, loss_fn, comm, seed: int, lr: float, momentum: float, bn_stats=None,
               graph=None) -> DDPRunner:
    """torch DDP on the full batch ``xs``/``ys`` (float32), each rank its sample block. A PyG
    batch (``graph``'s inputs marked as nodes and edges with a batch vector,
    ``decomp.graph.graphs.graph_roles``) is split into whole graphs per rank by the generic
    split of graph parallelism (``runtime.graphs.split_graph_batch``) unless the model file
    says how (``ddp_shard``, an override). Collective: every rank calls it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = comm.device
    torch.manual_seed(seed)
    base, bx, by, rows, how = ddp_split(mf, xs, ys, comm, graph)
    base.train()
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in base.modules())
    equivalent, note, sync_bn = same_function(has_bn, bn_stats, int(xs[0].shape[0]), comm.world,
                                              device.type == "cuda")
    note += how
    if sync_bn:
        base = torch.nn.SyncBatchNorm.convert_sync_batchnorm(base, process_group=comm.mesh_group)
    ddp = DDP(base, device_ids=[device.index] if device.type == "cuda" else None,
              process_group=comm.mesh_group)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    if rows is not None:
        loss_of = (lambda o: loss_fn(rows(o), by)) if by is not None else (lambda o: loss_fn(rows(o)))
    else:
        loss_of = (lambda o: loss_fn(o, by)) if by is not None else (lambda o: loss_fn(o))
    nbytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    return DDPRunner(ddp, opt, bx, loss_of, equivalent, note, sync_bn, nbytes, bn_stats)


def same_function(has_bn: bool, bn_stats, batch: int, world: int, cuda: bool) -> tuple[bool, str, bool]:
    """(DDP computes the plan's function, the note the report prints, use SyncBatchNorm)."""
    if not has_bn:
        return True, "same function: torch DDP, samples split over the world (no batch norm)", False
    if bn_stats is not None and bn_stats.local:
        if batch % world == 0 and bn_stats.group == batch // world:
            return True, (f"same function: torch DDP, samples split over the world, each rank's batch "
                          f"norm over its {bn_stats.group} samples = the plan's local statistics (DDP's "
                          f"running statistics are rank 0's, the plan's the mean over the groups)"), False
        return False, (f"not the same function: torch DDP normalises over the {batch // world} samples "
                       f"of a rank, the plan over groups of {bn_stats.group}; DDP is a timing baseline only"), False
    if cuda:
        return True, "same function: torch DDP + SyncBatchNorm (global batch-norm statistics)", True
    return False, ("not the same function: with global batch-norm statistics the same-function baseline "
                   "is DDP + SyncBatchNorm, which has no CPU path, so none exists here; plain DDP (local "
                   "statistics) is a timing baseline only"), False


def ddp_split(mf, xs, ys, comm, graph=None):
    """What one DDP rank trains on: (the model, its inputs, its targets, the cut of its output
    rows or None, how the batch was split: a note). The model file's ``ddp_shard`` when it has
    one; else a PyG batch (``graph_split_roles``) as whole graphs per rank by the generic split
    of graph parallelism (``runtime.graphs.split_graph_batch``; the module's output cut to the
    rank's graphs); else dim 0 of every input in even blocks."""
    device = comm.device
    shard = mf.ddp_shard()
    roles = graph_split_roles(graph) if shard is None else None
    if shard is not None:
        # the model file splits its own batch (e.g. whole graphs of a PyG batch per rank)
        bx, by, base = shard(tuple(xs), ys, comm.rank, comm.world)
        return (base.to(device), [x.to(device) for x in bx], by.to(device) if by is not None else None,
                None, "; the batch split by the model file's ddp_shard")
    if roles is not None:
        # whole graphs per rank, split from the trace's node / edge marks (what a PyG user's
        # DistributedSampler over graphs gives each rank)
        bx, by, _ = split_graph_batch(roles, [x.to(device) for x in xs],
                                      ys.to(device) if ys is not None else None, comm.rank, comm.world)
        world = comm.world
        return (mf.build_model().to(device), bx, by, lambda o: graph_rows(o, roles.graphs, world),
                "; the batch split into whole graphs per rank (autopar's generic graph split)")
    lay = Sharding.of((Shard(0), comm.world))
    bx = [local_slice(x, lay, comm) for x in xs]
    by = local_slice(ys, lay, comm) if ys is not None else None
    return mf.build_model().to(device), bx, by, None, ""


def graph_split_roles(graph):
    """The roles of a PyG batch's inputs (``decomp.graph.graphs.GraphRoles``) when ``graph`` is
    one whose graphs can be split whole over the ranks, else None."""
    if graph is None:
        return None
    return graph_roles(graph)[0]
