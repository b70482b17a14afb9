"""What each rank loads: the plan's input and loss layouts applied to a global batch.

Legend: a *global batch* is ``B`` samples (``B`` = the plan's batch size: the traced shapes
fix it, so every step uses exactly ``B``); dim 0 of every input and of the target is the
sample dim. Under the plan each model input has a layout (``DistModel.input_layout``: e.g.
``N2`` sample shards, ``N1xH2`` spatial slabs, ``R`` a replicated copy) and the target has the
loss layout (``DistModel.loss_layout``, always a split of samples only, possibly with
replicas). A rank needs, of global batch ``k``:

* for input ``i``: the samples ``[s_i, s_i + n_i)`` of its block and, of each, the slab
  ``bounds_i[1:]`` (``Layout.local_bounds``, the ``tensor_split`` rule);
* for the target: the samples of its block of the loss layout.

``BatchSharding`` is that arithmetic (pure: no process group), ``shard_batch`` slices a full
global batch with it, and ``PlanSampler`` / ``plan_loader`` are the ``DistributedSampler``
analogue for a map-style ``torch.utils.data.Dataset``: per global batch the sampler yields the
dataset indices this rank needs (the union over inputs and target, ascending) and the loader's
collate stacks those samples and cuts each rank's slabs, so a rank reads only the samples its
first layers and its loss need (each of those samples is read whole by the dataset's
``__getitem__`` and then cut to the rank's slab).

Epochs and shuffling: epoch ``e`` visits ``perm_e = randperm(len(dataset))`` drawn from a
``torch.Generator`` seeded with ``seed + e`` (``shuffle=False``: ``0..len-1``); global batch
``k`` is ``perm_e[k*B : (k+1)*B]``. Every rank draws the same permutation. Drop-last: the
``len(dataset) % B`` samples left after the last full batch of an epoch are skipped (a plan
runs one batch size only); ``len(sampler) = len(dataset) // B``. Call ``set_epoch(e)`` before
each epoch, as with ``DistributedSampler``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..decomp.layout import Layout


@dataclass(frozen=True)
class BatchSharding:
    """The slices of a global batch one rank needs (pure arithmetic on the plan's layouts).

    ``input_shapes``: the global shape of every model input (dim 0 = ``batch_size``);
    ``input_layouts``, ``target_layout``: the plan's layouts; ``rank``/``world``: mesh rank and
    size."""

    batch_size: int
    input_shapes: tuple[tuple[int, ...], ...]
    input_layouts: tuple[Layout, ...]
    target_layout: Layout
    rank: int
    world: int

    @staticmethod
    def of(dmodel, rank: int | None = None) -> "BatchSharding":
        """The sharding of a parallelized (or any ``DistModel``) model, for ``rank`` (default:
        this process's)."""
        g = dmodel.graph
        shapes = tuple(tuple(int(n) for n in gi.shape) for gi in g.inputs)
        return BatchSharding(
            # the traced batch size: a PyG batch's first input is x [N, F], N nodes, not graphs
            batch_size=int(g.batch_size or (shapes[0][0] if shapes else 0)), input_shapes=shapes,
            input_layouts=tuple(dmodel.input_layout(gi.name) for gi in g.inputs),
            target_layout=dmodel.loss_layout(), rank=dmodel.comm.rank if rank is None else rank,
            world=dmodel.comm.world)

    def for_rank(self, rank: int) -> "BatchSharding":
        return BatchSharding(self.batch_size, self.input_shapes, self.input_layouts,
                             self.target_layout, rank, self.world)

    def input_slices(self, i: int) -> tuple[slice, ...]:
        """Index of this rank's block of input ``i`` in the global batch tensor."""
        b = self.input_layouts[i].local_bounds(self.input_shapes[i], self.rank, self.world)
        return tuple(slice(s, s + e) for s, e in b)

    def target_samples(self) -> slice:
        """This rank's samples of the target (the loss layout splits samples only)."""
        shape = (self.batch_size,)
        (s, e), = self.target_layout.local_bounds(shape, self.rank, self.world)[:1]
        return slice(s, s + e)

    def samples_needed(self) -> list[int]:
        """Positions in the global batch (0..B-1) this rank reads, ascending: the union of the
        sample blocks of every input and of the target."""
        need: set[int] = set()
        for i in range(len(self.input_shapes)):
            sl = self.input_slices(i)[0]
            need.update(range(sl.start, sl.stop))
        t = self.target_samples()
        need.update(range(t.start, t.stop))
        return sorted(need)

    def describe(self) -> list[str]:
        """One line per tensor: what this rank loads (for logs and docs)."""
        out = []
        for i, (shape, lay) in enumerate(zip(self.input_shapes, self.input_layouts)):
            sl = self.input_slices(i)
            what = ("a replicated copy" if lay.is_replicated() else
                    "a sample shard" if all(d == 0 for d, _ in lay.splits) else "a spatial/channel slab")
            out.append(f"input {i} {tuple(shape)} layout {lay}: {what} "
                       + "[" + ", ".join(f"{s.start}:{s.stop}" for s in sl) + "]")
        t = self.target_samples()
        out.append(f"target layout {self.target_layout}: samples [{t.start}:{t.stop}]")
        return out


def shard_batch(dmodel_or_sharding, inputs: torch.Tensor | Sequence[torch.Tensor],
                target: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """This rank's share of a full global batch: (its block of every input, its target block)."""
    sh = dmodel_or_sharding if isinstance(dmodel_or_sharding, BatchSharding) else BatchSharding.of(dmodel_or_sharding)
    xs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    if len(xs) != len(sh.input_shapes):
        raise ValueError(f"the plan's model takes {len(sh.input_shapes)} input(s), got {len(xs)}")
    for i, x in enumerate(xs):
        if tuple(x.shape) != sh.input_shapes[i]:
            raise ValueError(f"input {i} has shape {tuple(x.shape)}; the plan was made for "
                             f"{sh.input_shapes[i]} (global batch {sh.batch_size})")
    if getattr(dmodel_or_sharding, "_graph_roles", None) is not None:
        # a graph-parallel plan (``decomp.graph.graphs``): whole graphs of a PyG batch per rank
        local = dmodel_or_sharding.shard_inputs(xs)
    else:
        local = [x[sh.input_slices(i)] for i, x in enumerate(xs)]
    t = target[sh.target_samples()] if target is not None else None
    return local, t


class PlanSampler(torch.utils.data.Sampler):
    """Batch sampler: per global batch, the dataset indices this rank needs (module docstring:
    seed, epochs, drop-last). ``global_batch(k)`` gives all ``B`` indices of batch ``k`` (what
    one process would load)."""

    def __init__(self, dataset_len: int, sharding: BatchSharding, shuffle: bool = True, seed: int = 0) -> None:
        if sharding.batch_size < 1:
            raise ValueError("the plan has no batch dimension")
        if dataset_len < sharding.batch_size:
            raise ValueError(f"the data set has {dataset_len} samples, fewer than one global batch "
                             f"of {sharding.batch_size} (the plan's batch size)")
        self.n = int(dataset_len)
        self.sharding = sharding
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self._need = sharding.samples_needed()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n // self.sharding.batch_size

    def permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def global_batch(self, k: int, perm: list[int] | None = None) -> list[int]:
        b = self.sharding.batch_size
        perm = perm if perm is not None else self.permutation()
        return perm[k * b:(k + 1) * b]

    def __iter__(self) -> Iterator[list[int]]:
        perm = self.permutation()
        for k in range(len(self)):
            batch = self.global_batch(k, perm)
            yield [batch[j] for j in self._need]


class _Collate:
    """Stack this rank's samples and cut each tensor's block (picklable for worker processes)."""

    def __init__(self, sharding: BatchSharding) -> None:
        self.sh = sharding
        self.pos = {j: i for i, j in enumerate(sharding.samples_needed())}

    def __call__(self, items: list) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        sh = self.sh
        n_in = len(sh.input_shapes)
        items = [tuple(it) if isinstance(it, (tuple, list)) else (it,) for it in items]
        if len(items[0]) not in (n_in, n_in + 1):
            raise ValueError(f"dataset items have {len(items[0])} fields; the plan's model takes "
                             f"{n_in} input(s) (+ 1 target)")
        xs = []
        for i in range(n_in):
            sl = sh.input_slices(i)
            rows = [items[self.pos[j]][i][sl[1:]] for j in range(sl[0].start, sl[0].stop)]
            xs.append(torch.stack(rows) if rows else torch.empty(0))
        t = None
        if len(items[0]) == n_in + 1:
            ts = sh.target_samples()
            rows = [torch.as_tensor(items[self.pos[j]][n_in]) for j in range(ts.start, ts.stop)]
            t = torch.stack(rows)
        return xs, t


def plan_loader(dataset, dmodel, *, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                num_workers: int = 0, **loader_kw) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` over a map-style ``dataset`` (items ``(x_1, ..., x_k, target)`` or
    ``(x_1, ..., x_k)``) that yields ``(inputs, target)``: this rank's blocks of each global
    batch of the plan's size. ``loader.batch_sampler.set_epoch(e)`` before each epoch."""
    sh = BatchSharding.of(dmodel)
    sampler = PlanSampler(len(dataset), sh, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=_Collate(sh),
                                       num_workers=num_workers, **loader_kw)
