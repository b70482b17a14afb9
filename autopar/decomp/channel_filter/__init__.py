"""Channel, filter and channel+filter parallelism (Dryden et al., SC 2019), with sample parallelism.

The weight of a convolution or linear layer ``w_FC*`` (F filters / outputs, C channels /
inputs, kernel ``*``) is split over a process grid, so that each rank keeps a shard of it and
the gradient allreduce over the world becomes a *segmented* allreduce: only the ``s`` ranks that
hold the same shard sum their gradients (``|W| / P_model`` bytes each), and the ``P_model``
groups run concurrently.

Legend: ``x`` input (N, C, *spatial) or (N, C) for linear; ``y`` output (N, F, *); the feature
dim is 1 for a convolution and the last dim for a linear layer. ``s`` sample parts, ``pc``
channel parts, ``pf`` filter parts; world ``P = s * pc * pf``. Grid coordinates of a rank::

    rank = (c_s * pc + c_c) * pf + c_f          (sample outermost, filter innermost)

so a channel group (varying ``c_c``) and a filter group (varying ``c_f``) are nearby ranks, and
the segmented gradient allreduce (varying ``c_s``) is the one that crosses nodes under block
placement; a local stride of ``pc * pf`` keeps it within a node instead (the planner's
placement search weighs the two, ``autopar.solve.placement``).

=================  ==========================  =========================  ========================
                   Channel(s, p)               Filter(s, p)               ChannelFilter(s, pc, pf)
=================  ==========================  =========================  ========================
in layout          ((0,s),(C,p))               ((0,s),), p replicas       ((0,s),(C,pc)), pf replicas
weight shard       dim C over c_c              dim F over c_f             F over c_f, C over c_c
local anchor       partial y, all F            y for local F (+bias)      partial y, local F
forward comm       reduce-scatter y along F    (incoming allgather of x   reduce-scatter y along N
                   over the channel group      is the transition's)       over the channel group
out layout         ((0,s),(F,p))               ((0,s),(F,p))              ((0,s*pc),(F,pf))
backward comm      allgather dy (adjoint)      the transition's adjoint   allgather dy along N
                                               reduce-scatters partial dx
bias, BN params    F shard of c_c              F shard of c_f             F shard of c_f
grad group         s ranks (same c_c)          s ranks (same c_f)         W: s ranks; bias, BN:
                                                                          s*pc ranks (same c_f)
=================  ==========================  =========================  ========================

Why these layouts: Filter's output layout equals Channel's input layout (F of one layer is C of
the next), so filter -> channel is a free edge, as is channel -> channel (the reduce-scatter
sits inside the layer) and channel+filter -> Channel(s*pc, pf). Filter's input is replicated over
its filter group (the innermost, replica axis of the layout), so an incoming C-sharded tensor is
allgathered by the generic transition (``autopar.runtime.comm.redistribute``), whose backward
adds the ranks' partial dx: that is the backward reduce-scatter, and it happens exactly once
because the layer itself never sums dx. Channel+filter reduce-scatters along N rather than F:
after the sum over the channel group each rank holds F shard ``c_f``, and splitting that shard
further by ``c_c`` would order the F blocks (c_f, c_c), which no Sharding (outermost mesh axis
first, replicas innermost) can express together with an input split (c_c, then c_f replicas);
splitting N keeps the output an ordinary layout whose sample groups are complete per channel.

Transparent ops after the anchor (batch norm, activations, dropout) run on the output shard;
batch norm statistics of a channel are complete within one F shard and are summed over the
ranks holding the same F shard (the output's sample group); its weight, bias and running
statistics are sharded by F like the anchor's bias (running statistics are updated in place in
this rank's slice of the full buffer the runtime passes).

Remainders are allowed: every split follows the ``tensor_split`` rule of ``Sharding``, and the
collectives pad uneven slices (``autopar.runtime.comm.reduce_scatter_dim``). Channel+filter additionally needs
the flat split of N into ``s*pc`` blocks to refine the split into ``s`` blocks (true whenever
``s*pc`` divides N); ``check`` says so otherwise.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..base import CostContext, Decomposition, LayerCost, ParamShard, divisors, register
from ..common import batch_dim_ok
from ..ir import BATCH_NORM, CONV, DROPOUT, LINEAR, UNARY, Layer, OpSpec
from ..sharding import Sharding, Partial, Shard, block_extent, block_start

ANCHORS = (CONV, LINEAR)


def _feature_dim(op: OpSpec) -> int:
    """Dim of the anchor's input/output that holds channels/filters: 1 (conv), last (linear)."""
    return 1 if op.kind == CONV else len(op.in_shapes[0]) - 1


class _WeightGrid(Decomposition):
    """Shared machinery of the three algorithms: a (s, pc, pf) grid (see module docstring).

    Subclasses are frozen dataclasses that define ``grid()`` and nothing else differs except
    where the reduce-scatter splits (F when pf == 1, N otherwise).
    """

    supported_ops = frozenset({CONV, LINEAR, BATCH_NORM, UNARY, DROPOUT})

    # ---- grid arithmetic ----------------------------------------------------------------
    def grid(self) -> tuple[int, int, int]:
        raise NotImplementedError

    def world(self) -> int:
        return math.prod(self.grid())

    def coords(self, rank: int) -> tuple[int, int, int]:
        _, pc, pf = self.grid()
        return rank // (pc * pf), (rank // pf) % pc, rank % pf

    def rank_of(self, cs: int, cc: int, cf: int) -> int:
        _, pc, pf = self.grid()
        return (cs * pc + cc) * pf + cf

    def group(self, rank: int, vary: str) -> list[int]:
        """Ranks equal to ``rank`` except along the grid axes in ``vary`` ("s", "c", "f")."""
        return _group(self.grid(), self.coords(rank), vary)

    def partition(self, vary: str) -> tuple[tuple[int, ...], ...]:
        """All groups of ``vary`` (each rank in exactly one), sorted; cached per grid (read-only)."""
        return _partition(self.grid(), vary)

    def mesh(self) -> Sharding:
        s, pc, pf = self.grid()
        """The s x c x f grid as a mesh whose axes carry labels (Shard(0/1/2) name which grid
        axis, not a tensor dim; the axes are named N, C, H after them): ``ParamShard.on`` reads
        only its sizes and names."""
        return Sharding.of((Shard(0), s), (Shard(1), pc), (Shard(2), pf))

    def _axis(self, label: int) -> int:
        return self.mesh().shard_dims.index(label)

    @property
    def rs_along_batch(self) -> bool:
        """Channel+filter reduce-scatters along N, channel-only along F."""
        _, pc, pf = self.grid()
        return pc > 1 and pf > 1

    @property
    def out_f_vary(self) -> str:
        """The grid axis that indexes the output's F shard (and the bias / BN shards)."""
        return "f" if self.grid()[2] > 1 else "c"

    # ---- layouts --------------------------------------------------------------------------
    def in_placement(self, layer: Layer, value: str) -> Sharding:
        s, pc, _ = self.grid()
        return Sharding.of((Shard(0), s), (Shard(_feature_dim(layer.anchor)), pc))

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        s, pc, pf = self.grid()
        fo = _feature_dim(layer.anchor)
        if self.rs_along_batch:
            return Sharding.of((Shard(0), s * pc), (Shard(fo), pf))
        return Sharding.of((Shard(0), s), (Shard(fo), pc * pf))

    def param_shard(self, op: OpSpec, role: str) -> ParamShard:
        _, pc, pf = self.grid()
        if op.kind in ANCHORS and role == "weight":
            dims = []
            if pf > 1:
                dims.append((0, self._axis(2)))
            if pc > 1:
                dims.append((1, self._axis(1)))
            return ParamShard.on(self.mesh(), tuple(dims))
        # anchor bias, batch-norm weight/bias: sharded like the output's F
        label = 2 if self.out_f_vary == "f" else 1
        return ParamShard.on(self.mesh(), ((0, self._axis(label)),))

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        """Channel groups (reduce-scatter), the output's sample groups (batch-norm statistics,
        bias / BN gradients) and the weight-shard groups (weight gradients)."""
        parts = []
        if self.grid()[1] > 1:
            parts.append(self.partition("c"))
        parts.append(self.partition("s" + ("c" if self.rs_along_batch else "")))
        parts.append(self.partition("s"))
        return [[list(g) for g in p] for p in parts if any(len(g) > 1 for g in p)]

    # ---- legality -------------------------------------------------------------------------
    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        name = layer.module or layer.name
        why = super().check(layer, ctx)
        if why:
            return f"{name}: {why}"
        s, pc, pf = self.grid()
        if min(s, pc, pf) < 1:
            return f"{name}: grid {self.grid()} has a factor < 1"
        if self.world() != ctx.world:
            return f"{name}: grid {s}x{pc}x{pf} = {self.world()} ranks, world size is {ctx.world}"
        a = layer.anchor
        if a.kind not in ANCHORS:
            return f"{name}: {self.kind} needs a conv or linear anchor, got {a.kind}"
        if any(op.kind in ANCHORS for op in layer.ops[1:]):
            return f"{name}: more than one conv/linear op in the layer"
        if a.kind == CONV and int(a.attrs.get("groups", 1)) != 1:
            return f"{name}: grouped convolution (groups={a.attrs.get('groups')}) is not supported"
        w = a.params.get("weight")
        if not w or len(w) < 2:
            return f"{name}: anchor has no 2-d (or larger) weight"
        f, c = int(w[0]), int(w[1])
        fo = _feature_dim(a)
        if any(op.kind == BATCH_NORM for op in layer.ops) and fo != 1:
            return f"{name}: batch norm after a linear layer on a {len(a.in_shapes[0])}-d input"
        why = batch_dim_ok(layer)
        if why:
            return f"{name}: {why}"
        n = int(a.in_shapes[0][0])
        if c < pc:
            return f"{name}: {c} channels < {pc} channel parts (some rank would hold no channel)"
        f_parts = pf if self.rs_along_batch else pc * pf
        if f < f_parts:
            return f"{name}: {f} filters < {f_parts} filter parts (some rank would hold no filter)"
        n_parts = s * pc if self.rs_along_batch else s
        if n < n_parts:
            return f"{name}: batch {n} < {n_parts} sample parts (some rank would hold no sample)"
        if self.rs_along_batch:
            for cs in range(s):
                if block_start(n, s, cs) != block_start(n, s * pc, cs * pc):
                    return (f"{name}: batch {n} split into {s * pc} blocks does not refine its split "
                            f"into {s} blocks (use a batch divisible by {s * pc})")
        return None

    # ---- shapes (block 0 is the largest: the slowest rank) ----------------------------------
    def local_shapes(self, layer: Layer) -> dict[str, tuple[int, ...]]:
        """x: local input, y_part: local anchor result before the reduce-scatter, w: local
        weight, y: local output of the layer (what the transparent ops see)."""
        s, pc, pf = self.grid()
        a = layer.anchor
        fi = _feature_dim(a)
        x = list(a.in_shapes[0])
        x[0], x[fi] = block_extent(x[0], s, 0), block_extent(x[fi], pc, 0)
        w = list(a.params["weight"])
        w[0], w[1] = block_extent(w[0], pf, 0), block_extent(w[1], pc, 0)
        y_part = list(a.out_shape)
        y_part[0], y_part[fi] = x[0], w[0]
        y = self.out_placement(layer).max_local_shape(a.out_shape)
        return {"x": tuple(x), "w": tuple(w), "y_part": tuple(y_part), "y": tuple(y)}

    # ---- cost -----------------------------------------------------------------------------
    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """Per rank; block 0 (the largest) stands for the slowest rank.

        compute  = op_compute_s(anchor, x_loc -> y_part, w_shape=w_loc)
                   + sum over transparent ops of op_compute_s(y_loc -> y_loc)
                   x_loc = (N/s, C/pc, *), w_loc = (F/pf, C/pc, *k), y_part = (N/s, F/pf, *),
                   y_loc = out_placement block 0 (see local_shapes)
        fwd comm = T_reduce_scatter(pc, |y_part| bytes) on the channel group   (0 when pc == 1)
        bwd comm = T_allgather(pc, |y_part| bytes)                             (its adjoint)
                   The allgather of x that Filter / ChannelFilter need (and its backward
                   reduce-scatter) is the incoming edge's transition, priced by
                   ``autopar.decomp.transition``; zero when the producer already holds x so.
        bn       = per training batch norm (runtime ``run_batch_norm``) over the G ranks holding
                   the same F shard (s, or s*pc for channel+filter): forward T_allreduce(G,
                   4 G (2 F_loc + 1)) (a table of per-rank count, mean, M2), backward
                   T_allreduce(G, 4 * 2 F_loc); zero when G = 1, and zero under local statistics
                   (every rank holds whole sample groups of its channels)
        grad     = sum over this rank's gradient groups of T_allreduce(|group|, local shard bytes):
                   the weight's |W|/(pc*pf) among its s replicas; bias and BN parameters
                   (|b|/F_parts) among the ranks with the same F shard. The P_model groups of
                   one kind run concurrently on disjoint ranks: the slowest (block 0) group,
                   not the sum. grad_sync_bytes = those local shard bytes (0 for groups of 1).
        memory   = (params + grads) local shards + optimizer_state_per_param * params
                   + saved activations (local shapes) + workspace |y_part| (the partial sum
                   before the reduce-scatter; in backward the gathered dy of the same size)
        """
        from ...cost import primitives as prim  # plan-time half: the runtime never loads cost
        item = layer.itemsize
        sh = self.local_shapes(layer)
        a = layer.anchor
        fwd, bwd, src = prim.op_compute_s(a, [sh["x"]], sh["y_part"], ctx, w_shape=sh["w"],
                                          itemsize=item)
        sources = {src}
        saved = prim.saved_bytes(a, [sh["x"]], sh["y_part"], item)
        y_loc = sh["y"]
        bn_groups = self.partition("s" + ("c" if self.rs_along_batch else ""))
        bn_size, bn_level = len(bn_groups[0]), _worst_level(ctx, bn_groups)
        if getattr(ctx, "batch_norm", None) is not None and ctx.batch_norm.local:
            bn_size = 1   # local statistics: each rank holds whole groups of its channels
        bn_fwd = bn_bwd = 0.0
        for op in layer.ops[1:]:
            f, b, src = prim.op_compute_s(op, [y_loc], y_loc, ctx, itemsize=item)
            fwd, bwd = fwd + f, bwd + b
            sources.add(src)
            saved += prim.saved_bytes(op, [y_loc], y_loc, item)
            if op.kind == BATCH_NORM and bn_size > 1 and op.attrs.get("training", True):
                c_loc = y_loc[1]
                bn_fwd += prim.blocking_s(ctx, "allreduce", bn_size,
                                                        bn_size * (2 * c_loc + 1) * 4, bn_level)
                bn_bwd += prim.blocking_s(ctx, "allreduce", bn_size, 2 * c_loc * 4, bn_level)
        # activation reduce-scatter (forward) and its adjoint allgather (backward)
        pc = self.grid()[1]
        y_part_bytes = math.prod(sh["y_part"]) * item
        fwd_comm = bwd_comm = workspace = 0.0
        if pc > 1:
            chan = self.partition("c")
            level = _worst_level(ctx, chan)
            fwd_comm = prim.blocking_s(ctx, "reduce_scatter", pc, y_part_bytes, level)
            bwd_comm = prim.blocking_s(ctx, "allgather", pc, y_part_bytes, level)
            workspace = float(y_part_bytes)
        # segmented gradient allreduce
        w_bytes, other_bytes = self.local_param_bytes(layer)
        grad_s = grad_bytes_synced = 0.0
        latency: list = []
        for nbytes, vary in ((w_bytes, "s"), (other_bytes, "s" + ("c" if self.rs_along_batch else ""))):
            groups = self.partition(vary)
            if nbytes and len(groups[0]) > 1:
                level = _worst_level(ctx, groups)
                grad_s += prim.grad_allreduce_s(ctx, nbytes, len(groups[0]), level)
                grad_bytes_synced += nbytes
                # the partition's groups run side by side; the runtime buckets per group
                sig = "world" if len(groups[0]) == ctx.world else f"allreduce {len(groups[0])} {level} {groups[0]}"
                latency.append((sig, *prim.grad_latencies_s(ctx, len(groups[0]), level)))
        pbytes = float(w_bytes + other_bytes)
        return LayerCost(fwd_compute_s=fwd, bwd_compute_s=bwd,
                         fwd_comm_s=fwd_comm + bn_fwd, bwd_comm_s=bwd_comm + bn_bwd,
                         grad_sync_s=grad_s, grad_sync_bytes=grad_bytes_synced,
                         grad_sync_latency=tuple(latency),
                         param_bytes=pbytes, grad_bytes=pbytes,
                         optim_bytes=prim.optimizer_bytes(ctx, pbytes),
                         activation_bytes=saved, workspace_bytes=workspace,
                         source=sources.pop() if len(sources) == 1 else "mixed")

    def local_param_bytes(self, layer: Layer) -> tuple[float, float]:
        """(bytes of the local weight shard, bytes of the local bias + BN parameter shards) of
        rank 0 (the largest shards)."""
        w = other = 0.0
        for op in layer.ops:
            for role, shape in op.params.items():
                n = math.prod(self.param_shard(op, role).local_shape(shape, 0, self.world()))
                if op.kind in ANCHORS and role == "weight":
                    w += n * layer.itemsize
                else:
                    other += n * layer.itemsize
        return w, other


def _group(grid: tuple[int, int, int], coords: tuple[int, int, int], vary: str) -> list[int]:
    s, pc, pf = grid
    cs, cc, cf = coords
    return [(a * pc + b) * pf + c
            for a in (range(s) if "s" in vary else [cs])
            for b in (range(pc) if "c" in vary else [cc])
            for c in (range(pf) if "f" in vary else [cf])]


@functools.lru_cache(maxsize=4096)
def _partition(grid: tuple[int, int, int], vary: str) -> tuple[tuple[int, ...], ...]:
    """One group per representative (coordinates 0 along ``vary``): O(world) in all."""
    s, pc, pf = grid
    reps = [(a, b, c) for a in (range(s) if "s" not in vary else [0])
            for b in (range(pc) if "c" not in vary else [0])
            for c in (range(pf) if "f" not in vary else [0])]
    return tuple(sorted(tuple(_group(grid, r, vary)) for r in reps))


def _worst_level(ctx: CostContext, groups) -> str:
    """"inter" if any group of the partition crosses nodes (they run side by side)."""
    return ctx.worst_level(groups)


def _anchor_ok(layer: Layer) -> bool:
    return bool(layer.ops) and layer.anchor.kind in ANCHORS


def _one_axis_candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
    """(world / p, p) for every divisor p > 1 of the world: the model axis takes p ranks."""
    if not _anchor_ok(layer):
        return []
    return [cls(ctx.world // p, p) for p in divisors(ctx.world) if p > 1]


@register
@dataclass(frozen=True)
class Channel(_WeightGrid):
    """Input and weight split by C over ``parts`` ranks; partial y reduce-scattered along F."""

    sample: int = 1
    parts: int = 2
    kind = "channel"

    def grid(self) -> tuple[int, int, int]:
        return self.sample, self.parts, 1

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        return _one_axis_candidates(cls, layer, ctx)


@register
@dataclass(frozen=True)
class Filter(_WeightGrid):
    """Input whole in C within the filter group; weight and output split by F."""

    sample: int = 1
    parts: int = 2
    kind = "filter"

    def grid(self) -> tuple[int, int, int]:
        return self.sample, 1, self.parts

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        return _one_axis_candidates(cls, layer, ctx)


@register
@dataclass(frozen=True)
class ChannelFilter(_WeightGrid):
    """2-D weight grid: C over ``pc`` (reduce-scatter along N), F over ``pf`` (x replicated)."""

    sample: int = 1
    pc: int = 2
    pf: int = 2
    kind = "channel_filter"

    def grid(self) -> tuple[int, int, int]:
        return self.sample, self.pc, self.pf

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        if not _anchor_ok(layer):
            return []
        out = []
        for m in divisors(ctx.world):
            for pc in divisors(m):
                pf = m // pc
                if pc > 1 and pf > 1:
                    out.append(cls(ctx.world // m, pc, pf))
        return out


@register
@dataclass(frozen=True)
class RowParallel(Channel):
    """Megatron's row-parallel linear (or convolution): input and weight split by C over
    ``parts`` ranks as in ``Channel``, but the partial products are *left* as a partial sum
    (``Partial("sum")`` on the channel axis: layout ``N<s>xP<parts>``) instead of being
    reduce-scattered inside the layer. The consumer resolves it where it needs to (the edge's
    redistribution: an all-reduce to a replicated tensor, a reduce-scatter to a split one),
    priced per step, so the ILP pays one collective per column -> row pair (``filter`` leaves
    ``Shard(-1)``, which is exactly this layer's input). The bias is whole on every rank and
    added by partial index 0 only; its gradient is summed over the world like any whole
    parameter. Only a lone anchor: no op may run on a partial sum inside the layer.

    Cost: compute as ``Channel`` (x_loc (N/s, .., C/p) x w_loc (F, C/p)); no forward or
    backward communication inside the layer; gradients: the weight shard among its ``s``
    replicas, the bias over the world.
    """

    kind = "row_parallel"

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        return Sharding.of((Shard(0), self.sample), (Partial(), self.parts))

    def param_shard(self, op: OpSpec, role: str) -> ParamShard:
        if op.kind in ANCHORS and role == "weight":
            return super().param_shard(op, role)
        return ParamShard()

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        """The weight shards' sample groups (gradients)."""
        return [[list(g) for g in self.partition("s")]] if self.sample > 1 else []

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        why = super().check(layer, ctx)
        if why:
            return why
        if len(layer.ops) != 1:
            return (f"{layer.module or layer.name}: {len(layer.ops) - 1} op(s) after the anchor would "
                    f"run on a partial sum")
        return None

    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        from ...cost import primitives as prim  # plan-time half: the runtime never loads cost
        item = layer.itemsize
        sh = self.local_shapes(layer)
        a = layer.anchor
        fwd, bwd, src = prim.op_compute_s(a, [sh["x"]], sh["y_part"], ctx, w_shape=sh["w"], itemsize=item)
        w_bytes = float(math.prod(sh["w"]) * item)
        b_bytes = float(math.prod(a.params["bias"]) * item) if "bias" in a.params else 0.0
        grad_s = synced = 0.0
        latency: list = []
        groups = self.partition("s")
        if len(groups[0]) > 1:
            level = _worst_level(ctx, groups)
            grad_s += prim.grad_allreduce_s(ctx, w_bytes, len(groups[0]), level)
            synced += w_bytes
            sig = "world" if len(groups[0]) == ctx.world else f"allreduce {len(groups[0])} {level} {groups[0]}"
            latency.append((sig, *prim.grad_latencies_s(ctx, len(groups[0]), level)))
        if b_bytes and ctx.world > 1:
            grad_s += prim.grad_sync_time_s(ctx, b_bytes, range(ctx.world))
            synced += b_bytes
            latency.extend(prim.grad_sync_latency(ctx, range(ctx.world), "world"))
        pbytes = w_bytes + b_bytes
        return LayerCost(fwd_compute_s=fwd, bwd_compute_s=bwd, grad_sync_s=grad_s,
                         grad_sync_bytes=synced, grad_sync_latency=tuple(latency),
                         param_bytes=pbytes, grad_bytes=pbytes,
                         optim_bytes=prim.optimizer_bytes(ctx, pbytes),
                         activation_bytes=prim.saved_bytes(a, [sh["x"]], sh["y_part"], item),
                         source=src)

