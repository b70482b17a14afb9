"""Gradient synchronisation: bucketed SUM-allreduce per gradient group, overlapped with backward.

Each parameter belongs to a gradient group (the ranks holding the same shard; the whole world
for a replicated weight). Parameters come in the order of the layers that use them; they are
packed, in reverse (the order backward produces them), into buckets of whole layers of at most
``bucket_cap_bytes`` (``layer_buckets``; a layer larger than the cap gets a bucket of its own),
as torch DDP buckets parameters. The plan's cost model uses the same ``layer_buckets``: a
bucket's allreduce starts when the gradients of its last layer (in backward order) exist. A post-accumulate-grad hook counts arrivals; when a bucket is complete its flattened
gradients are all-reduced asynchronously while backward goes on. ``finish()`` waits for every
bucket and copies the sums back. Groups that are disjoint run their allreduces concurrently
(the segmented allreduce of channel/filter parallelism).

Every rank issues the same all-reduces in the same order, whatever order backward produces
gradients in on it (ranks of one plan run different graphs: a bias added on one rank of a
row-parallel layer gets its gradient only there, in backward, elsewhere its bucket completes in
``finish``). So (1) the buckets of a group launch in bucket order, as torch DDP's reducer
launches them: a complete bucket waits for the earlier ones of its group; (2) they run on the
group's gradient twin (``Comm.grad_group``), not on the group that forward and backward use for
their synchronous collectives (a transition's all-to-all, a partial sum's all-reduce): an
all-reduce launched mid-backward on one rank and in ``finish`` on another would otherwise sit
between different collectives of the shared group on the two ranks and hang (gnn_pcqm4m's
``channel(2,2)`` plan at world 4 did; ``tests/test_backward_order.py``).

Cost model twin: ``autopar.cost.primitives.grad_sync_time_s`` prices the same allreduces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..decomp.buckets import DEFAULT_BUCKET_CAP_BYTES, layer_buckets  # noqa: F401  (re-export)
from .comm import Comm


@dataclass
class _Bucket:
    ranks: tuple[int, ...]
    params: list[torch.nn.Parameter] = field(default_factory=list)
    nbytes: int = 0
    arrived: int = 0
    work: Any = None
    flat: torch.Tensor | None = None
    ready: bool = False


class GradSync:
    def __init__(self, comm: Comm, params_and_groups: list[tuple],
                 bucket_cap_bytes: int = 25 * 1024 * 1024, overlap: bool = True) -> None:
        self.comm = comm
        self.overlap = overlap
        self.buckets: list[_Bucket] = []
        open_by_group: dict[tuple[int, ...], _Bucket] = {}
        self._bucket_of: dict[int, _Bucket] = {}
        last_bucket: dict[tuple[int, ...], Any] = {}
        for entry in reversed(params_and_groups):
            p, ranks = entry[0], entry[1]
            bucket_id = entry[2] if len(entry) > 2 else None
            if len(ranks) <= 1 or not p.requires_grad:
                continue
            b = open_by_group.get(ranks)
            size = p.numel() * p.element_size()
            if bucket_id is not None:
                new = last_bucket.get(ranks, object()) != bucket_id
            else:
                new = bool(b is not None and b.nbytes and b.nbytes + size > bucket_cap_bytes)
            last_bucket[ranks] = bucket_id
            if b is None or new:
                b = _Bucket(ranks)
                self.buckets.append(b)
                open_by_group[ranks] = b
            b.params.append(p)
            b.nbytes += size
            self._bucket_of[id(p)] = b
        self.bytes_per_step = sum(b.nbytes for b in self.buckets)
        # per group, its buckets in launch order and the next one to launch
        self._order: dict[tuple[int, ...], list[_Bucket]] = {}
        for b in self.buckets:
            self._order.setdefault(b.ranks, []).append(b)
        self._next: dict[tuple[int, ...], int] = {r: 0 for r in self._order}
        self._handles = []
        if overlap:
            for b in self.buckets:
                for p in b.params:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, p: torch.nn.Parameter) -> None:
        b = self._bucket_of[id(p)]
        b.arrived += 1
        if b.arrived == len(b.params):
            b.ready = True
            self._launch_ready(b.ranks, everything=False)

    def _launch_ready(self, ranks: tuple[int, ...], everything: bool) -> None:
        """Launch the group's buckets in bucket order: the complete ones at the head of the
        queue (``everything``: all that are left, in ``finish``)."""
        seq, i = self._order[ranks], self._next[ranks]
        while i < len(seq) and (everything or seq[i].ready):
            self._launch(seq[i])
            i += 1
        self._next[ranks] = i

    def _launch(self, b: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        b.flat = torch.cat([g.reshape(-1) for g in grads])
        b.work = dist.all_reduce(b.flat, group=self.comm.grad_group(b.ranks), async_op=True)

    def finish(self, write_back: bool = True) -> None:
        """Wait for every bucket (launching those whose hooks did not all fire, in bucket
        order) and write the sums back (``write_back=False``: drop them, e.g. a micro-batch of
        gradient accumulation, ``train.api``)."""
        for ranks in self._order:
            self._launch_ready(ranks, everything=True)
        for b in self.buckets:
            b.work.wait()
            if write_back:
                off = 0
                for p in b.params:
                    n = p.numel()
                    g = b.flat[off:off + n].view_as(p)
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
                    off += n
            b.work, b.flat, b.arrived, b.ready = None, None, 0, False
        self._next = {r: 0 for r in self._order}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def hand_over(self) -> None:
        """Stop synchronising (hooks removed, no bucket left: ``finish`` does nothing) because
        another reducer took the same all-reduces over (``runtime.native``: torch DDP's reducer
        with a SUM hook); ``bytes_per_step`` keeps what a step sends."""
        self.remove()
        self.buckets = []
        self._bucket_of = {}
        self._order, self._next = {}, {}
