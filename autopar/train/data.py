"""What each rank loads: the plan's input and loss layouts applied to a global batch.

Legend: a *global batch* is ``B`` samples (``B`` = the plan's batch size: the traced shapes
fix it, so every step uses exactly ``B``); dim 0 of every input and of the target is the
sample dim. Under the plan each model input has a layout (``DistModel.input_layout``: e.g.
``N2`` sample shards, ``N1xH2`` spatial slabs, ``R`` a replicated copy) and the target follows
the loss layout (``DistModel.loss_layout``: a split of samples, possibly with replicas, or a
vocabulary-parallel loss's split of samples x logits). A rank needs, of global batch ``k``:

* for input ``i``: the samples ``[s_i, s_i + n_i)`` of its block and, of each, the slab
  ``bounds_i[1:]`` (``Sharding.local_bounds``, the ``tensor_split`` rule);
* for the target: the rows of its block of the loss layout. The target is cut along dim 0
  only, whatever its shape (class labels ``[B]``, a language model's tokens ``[B, S]``, dense
  per-pixel labels ``[B, H, W]``, one value per graph or per node): its rows are those of the
  output's dim 0 (``BatchSharding.output_shape``), and this rank's rows are the dim-0 block of
  the loss layout on the output (a vocabulary-parallel loss splits the output's last dim as
  well; every rank of that split reads the same whole target rows).

A batch or data-set item that does not fit the plan (the wrong number of fields, a wrong shape)
is ``BatchMismatch``, which lists what the plan expects for each input and the target.

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

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..decomp.sharding import Shard, Sharding
from ..errors import AutoparError
from ..runtime.model import target_rows


class BatchMismatch(AutoparError, ValueError):
    """A batch or data-set item that does not fit the plan: the wrong number of fields or a
    tensor of the wrong shape. The message lists what the plan expects for each input and the
    target."""


@dataclass(frozen=True)
class BatchSharding:
    """The slices of a global batch one rank needs (pure arithmetic on the plan's layouts).

    ``input_shapes``: the global shape of every model input (dim 0 = ``batch_size``);
    ``input_layouts``, ``target_layout``: the plan's layouts; ``rank``/``world``: mesh rank and
    size; ``output_shape``: the traced output's global shape, whose dim 0 gives the target's
    rows (() for a sharding built by hand: ``batch_size`` rows); ``target_shape``: the global
    target the plan's loss was traced with (the model file's ``example_targets``), None when
    unknown (then only its rows are checked); ``input_names``: the model's input names (for
    messages)."""

    batch_size: int
    input_shapes: tuple[tuple[int, ...], ...]
    input_layouts: tuple[Sharding, ...]
    target_layout: Sharding
    rank: int
    world: int
    output_shape: tuple[int, ...] = ()
    target_shape: tuple[int, ...] | None = None
    input_names: tuple[str, ...] = ()

    @staticmethod
    def of(dmodel, rank: int | None = None) -> "BatchSharding":
        """The sharding of a parallelized (or any ``DistModel``) model, for ``rank`` (default:
        this process's)."""
        plan = getattr(dmodel, "autopar_plan", None)
        if plan is not None and not hasattr(dmodel, "graph"):
            return BatchSharding._of_sharded(dmodel, plan, rank)
        g = dmodel.graph
        shapes = tuple(tuple(int(n) for n in gi.shape) for gi in g.inputs)
        return BatchSharding(
            # the traced batch size: a PyG batch's first input is x [N, F], N nodes, not graphs
            batch_size=int(g.batch_size or (shapes[0][0] if shapes else 0)), input_shapes=shapes,
            input_layouts=tuple(dmodel.input_layout(gi.name) for gi in g.inputs),
            target_layout=dmodel.loss_layout(), rank=dmodel.comm.rank if rank is None else rank,
            world=dmodel.comm.world, output_shape=tuple(int(n) for n in g.value_shape(g.output)),
            target_shape=getattr(dmodel, "target_shape", None),
            input_names=tuple(gi.name for gi in g.inputs))

    @staticmethod
    def _of_sharded(model, plan, rank: int | None) -> "BatchSharding":
        """A model that ``autopar.parallelize`` put on FSDP2 (a sharded plan,
        ``train.sharded``): every rank feeds the dim-0 block of every input and of the target."""
        g = plan.graph()
        world = torch.distributed.get_world_size()
        shapes = tuple(tuple(int(n) for n in gi.shape) for gi in g.inputs)
        by_samples = Sharding.of((Shard(0), world))
        return BatchSharding(
            batch_size=int(g.batch_size or (shapes[0][0] if shapes else 0)), input_shapes=shapes,
            input_layouts=tuple(by_samples for _ in shapes), target_layout=by_samples,
            rank=torch.distributed.get_rank() if rank is None else rank, world=world,
            output_shape=tuple(int(n) for n in g.value_shape(g.output)),
            target_shape=getattr(model, "target_shape", None), input_names=tuple(gi.name for gi in g.inputs))

    def for_rank(self, rank: int) -> "BatchSharding":
        return dataclasses.replace(self, rank=rank)

    def input_slices(self, i: int) -> tuple[slice, ...]:
        """Index of this rank's block of input ``i`` in the global batch tensor."""
        b = self.input_layouts[i].local_bounds(self.input_shapes[i], self.rank, self.world)
        return tuple(slice(s, s + e) for s, e in b)

    @property
    def target_rows(self) -> int:
        """Rows (dim 0) of the global target: those of the output's dim 0."""
        return int(self.output_shape[0]) if self.output_shape else int(self.batch_size)

    def target_samples(self) -> slice:
        """This rank's rows of the target, of any shape (module docstring): the dim-0 block of
        the loss layout on the output."""
        shape = list(self.output_shape or (self.batch_size,))
        # a sharding built by hand knows dim 0 only: the other split dims get extents that any
        # split divides (only dim 0's bounds are read)
        need = 1 + max(self.target_layout.shard_dims, default=0)
        shape += [self.world] * (need - len(shape))
        return target_rows(self.target_layout, shape, self.rank, self.world)

    # ---- what the plan expects, and the checks ---------------------------------------------
    def expected(self) -> str:
        """What the plan expects of a global batch, and of one data-set item, for each input
        and the target."""
        parts = []
        for i, shape in enumerate(self.input_shapes):
            name = f" ({self.input_names[i]})" if i < len(self.input_names) else ""
            parts.append(f"input {i}{name} {list(shape)}, an item's {list(shape[1:])}")
        if self.target_shape is not None:
            parts.append(f"target {list(self.target_shape)}, an item's {list(self.target_shape[1:])}")
        else:
            parts.append(f"target [{self.target_rows}, ...] (one row per row of the output's dim 0)")
        return "; ".join(parts)

    def _mismatch(self, what: str, hint: str = "") -> BatchMismatch:
        return BatchMismatch(f"{what}; the plan expects (global batch {self.batch_size}): {self.expected()}",
                             hint or "give batches (and data-set items) of the shapes the plan was made "
                                     "for, or re-plan: autopar plan MODEL.py with --batch-size and the "
                                     "model file's example_inputs / example_targets of your data")

    def check_batch(self, xs: Sequence[torch.Tensor], target: torch.Tensor | None) -> None:
        """``BatchMismatch`` unless ``xs`` and ``target`` are a whole global batch of the plan."""
        if len(xs) != len(self.input_shapes):
            raise self._mismatch(f"the batch has {len(xs)} input(s), the plan's model takes "
                                 f"{len(self.input_shapes)}")
        for i, x in enumerate(xs):
            if tuple(x.shape) != tuple(self.input_shapes[i]):
                raise self._mismatch(f"input {i} has shape {list(x.shape)}")
        if target is not None:
            self._check_target(tuple(target.shape), "the target")

    def _check_target(self, shape: tuple[int, ...], what: str, item: bool = False) -> None:
        want = self.target_shape
        if want is not None:
            want = tuple(want[1:]) if item else tuple(want)
            if shape != want:
                raise self._mismatch(f"{what} has shape {list(shape)}")
        elif not item and (not shape or shape[0] != self.target_rows):
            raise self._mismatch(f"{what} has shape {list(shape)}")

    def check_item(self, fields: Sequence, index: int | None = None) -> None:
        """``BatchMismatch`` unless a data-set item holds ``(x_1, ..., x_k[, target])`` of one
        sample each (``index``: its position in the data set, for the message)."""
        n_in = len(self.input_shapes)
        at = f"data-set item {index}" if index is not None else "a data-set item"
        if len(fields) not in (n_in, n_in + 1):
            raise self._mismatch(f"{at} has {len(fields)} field(s); the plan's model takes {n_in} "
                                 f"input(s), then optionally the target")
        for i in range(n_in):
            shape = tuple(getattr(fields[i], "shape", ()))
            if shape != tuple(self.input_shapes[i][1:]):
                raise self._mismatch(f"{at}: input {i} has shape {list(shape)}")
        if len(fields) == n_in + 1:
            self._check_target(tuple(torch.as_tensor(fields[n_in]).shape), f"{at}: the target", item=True)

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
                    "a sample shard" if all(d == 0 for d in lay.shard_dims) else "a spatial/channel slab")
            out.append(f"input {i} {tuple(shape)} placement {lay}: {what} "
                       + "[" + ", ".join(f"{s.start}:{s.stop}" for s in sl) + "]")
        t = self.target_samples()
        out.append(f"target placement {self.target_layout}: samples [{t.start}:{t.stop}]")
        return out


def shard_batch(dmodel_or_sharding, inputs: torch.Tensor | Sequence[torch.Tensor],
                target: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """This rank's share of a full global batch: (its block of every input, its target block)."""
    sh = dmodel_or_sharding if isinstance(dmodel_or_sharding, BatchSharding) else BatchSharding.of(dmodel_or_sharding)
    xs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    sh.check_batch(xs, target)
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
        for it in items:
            sh.check_item(it)
        if len({len(it) for it in items}) > 1:
            raise sh._mismatch("the data set's items have " + " and ".join(
                str(n) for n in sorted({len(it) for it in items})) + " fields")
        xs = []
        for i in range(n_in):
            sl = sh.input_slices(i)
            rows = [items[self.pos[j]][i][sl[1:]] for j in range(sl[0].start, sl[0].stop)]
            xs.append(torch.stack(rows) if rows else torch.empty(0))
        t = None
        if len(items[0]) == n_in + 1:
            if sh.target_rows != sh.batch_size:
                raise sh._mismatch(f"data-set items carry one target each, but the plan's target has "
                                   f"{sh.target_rows} rows for {sh.batch_size} samples",
                                   "cut whole global batches with autopar.shard_batch instead")
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
    rows = [s[0] if s else None for s in sh.input_shapes] + [sh.target_rows]
    if getattr(dmodel, "_graph_roles", None) is not None or any(n != sh.batch_size for n in rows):
        raise sh._mismatch("plan_loader stacks one sample per data-set item, and this plan's inputs "
                           f"or target do not have the batch's {sh.batch_size} samples along dim 0 "
                           f"(rows {rows}: e.g. the nodes of a PyG batch)",
                           "cut whole global batches with autopar.shard_batch instead")
    sampler = PlanSampler(len(dataset), sh, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=_Collate(sh),
                                       num_workers=num_workers, **loader_kw)
