"""The torch DDP baseline of ``autopar execute``: the same model and batch, samples split over
the plan's mesh, timed like the plan (``execute.timing``) in the same processes."""

from __future__ import annotations

import statistics
from typing import Callable

from ..artifacts import Baseline
from .timing import timed_steps


def ddp_baseline(mf, xs, ys, loss_fn, comm, seed: int, lr: float, momentum: float,
                 warmup: int, steps: int, sync: Callable[[], None],
                 barrier: Callable[[], None]) -> Baseline:
    """Time torch DDP on the full batch ``xs``/``ys`` (float32), each rank its sample block.
    Collective: every rank calls it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..decomp.layout import Layout
    from ..runtime.comm import local_slice

    device = comm.device
    torch.manual_seed(seed)
    base = mf.build_model().to(device)
    base.train()
    ddp = DDP(base, device_ids=[device.index] if device.type == "cuda" else None,
              process_group=comm.mesh_group)
    lay = Layout(((0, comm.world),))
    bx = [local_slice(x, lay, comm) for x in xs]
    by = local_slice(ys, lay, comm) if ys is not None else None
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=momentum)
    loss_of = (lambda o: loss_fn(o, by)) if by is not None else (lambda o: loss_fn(o))
    timed_steps(ddp, opt, bx, loss_of, lambda: None, warmup, comm, sync, barrier)
    times = timed_steps(ddp, opt, bx, loss_of, lambda: None, steps, comm, sync, barrier)
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in base.modules())
    return Baseline(
        ddp_step_times_s=tuple(times), ddp_step_time_s=statistics.median(times),
        ddp_allreduce_bytes_per_step=sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad),
        equivalent=not has_bn,
        note=("torch DDP with local batch-norm statistics (SyncBatchNorm has no CPU path): a timing "
              "baseline that computes a slightly different function")
        if has_bn else "torch DDP, samples split over the world")
