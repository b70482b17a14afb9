"""Spatial and hybrid sample x spatial decomposition (Dryden et al., IPDPS 2019).

``Spatial(sample, spatial)`` splits the samples (dim 0) into ``sample`` blocks and spatial dim
``2 + i`` (D/H/W) into ``spatial[i]`` blocks, on a grid of ``sample * prod(spatial) == world``
ranks: layout ``((0, sample), (2, spatial[0]), (3, spatial[1]), ...)`` (trivial splits dropped),
e.g. ``Spatial(2, (2, 1))`` = 2 sample groups x 2 parts of H at world 4. Weights are whole on
every rank; their gradients are SUMMED over the world (``ParamShard()``).

Values and their layouts (``value_layouts``): a tensor with ``2 + len(spatial)`` dims and some
spatial extent > 1 is *spatial* and carries the full layout; a global reduction over the spatial
dims (adaptive average pooling to size 1, mean over every spatial dim) yields a *reduced* value
with layout ``((0, sample),)``, replicated over the ``prod(spatial)`` ranks of a spatial group
(its loss share must then be scaled by 1/replicas, as ``DistModel.local_loss`` does). So
``out_placement`` is the full layout for a layer ending on a spatial tensor and ``N<sample>`` for a
layer ending after global pooling.

Halos on the placements: a conv or pool reads its input as ``HaloShard(d, lo, hi)`` on each
split spatial dim d (``window_placement``; lo/hi the widest halo any block reads on each side,
``geometry.halo_widths``), so ``in_placement`` of a layer input that a window op reads (the plan
file's ``in_placements``) states it, e.g. ``[Shard(0), HaloShard(2, 1, 1), Replicate()]`` for a
3x3 convolution split in H. The owned blocks are the layout's: a transition into such an input
compares owned blocks (``Sharding.owned``) and moves nothing more; the exchange is the layer's
own (priced below as fwd_comm_s, run by ``runtime.layers.halo``), its per-block windows the
geometry's, checked against the stated widths (``geometry.plan_halo``).

How each op runs on local blocks (``run``):

=============  =================================================================================
conv           halo exchange (plan: ``.geometry``, run: ``.exchange``) to the input window of the local output
               block, then the local convolution with padding 0 along windowed dims (native
               padding along unsplit dims with symmetric padding)
pool max/avg   window along every spatial dim (fill -inf / 0), pool with padding 0, no ceil;
               average = window sum / count of counted positions (count_include_pad, ceil_mode
               and divisor_override reproduced exactly)
batch_norm     global statistics: over every rank holding a different block (``Sharding.data_group``);
               local: per group of samples, over the ranks holding the same samples' other
               spatial blocks
unary, binary  local (operands: same-layout tensors, reduced (N, C, 1.., 1) tensors, scalars,
               parameters without spatial extent)
dropout        local, only when p == 0 or not training (random masks would differ)
adaptive_pool  output size 1, average: local sum, all_reduce_sum over the spatial group, / count
mean           over exactly the spatial dims: likewise
=============  =================================================================================

Legality (``check``) is named and plan-time, e.g. ``layer3.0.conv1: local H extent 3 < halo
radius 4 at 8 parts``; the halo rules are in ``.exchange``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from ..base import CostContext, Decomposition, LayerCost, divisors, register
from ..common import price_replicated_weights
from ..ir import (ADAPTIVE_POOL, BATCH_NORM, BINARY, CONV, DROPOUT, MEAN, POOL, UNARY, Layer,
                 OpSpec, takes_input_grad)
from .geometry import (WindowGeom, axis_pieces, axis_problem, dim_name, halo_widths, plan_halo,
                       window_bounds)
from ..sharding import HaloShard, Sharding, Shard

WINDOW_OPS = (CONV, POOL)


# ---------------------------------------------------------------------------------------------
# window geometry of conv and pool ops (pure)
# ---------------------------------------------------------------------------------------------
def _expand(v, k: int, default: int) -> list[int]:
    if v is None or v == []:
        return [default] * k
    if isinstance(v, int):
        return [int(v)] * k
    v = [int(a) for a in v]
    return v * k if len(v) == 1 else v


def window_params(op: OpSpec, k: int) -> list[tuple[int, int, int, int]]:
    """Per spatial dim ``(pad_lo, pad_hi, stride, k_eff)`` of a conv or pool op.

    conv: kernel from the weight, padding ints or "valid"/"same" (torch's "same": total
    ``dilation*(K-1)``, lower side ``total // 2``); pool: padding symmetric, stride [] = kernel.
    """
    a = op.attrs
    if op.kind == CONV:
        ks = list(op.params["weight"])[2:]
    else:
        ks = _expand(a.get("kernel"), k, 1)
    stride = _expand(a.get("stride"), k, 1) if op.kind == CONV else _expand(a.get("stride") or ks, k, 1)
    dil = _expand(a.get("dilation"), k, 1)
    pad = a.get("padding", 0)
    out = []
    for i in range(k):
        k_eff = dil[i] * (ks[i] - 1) + 1
        if pad == "valid":
            lo = hi = 0
        elif pad == "same":
            total = dil[i] * (ks[i] - 1)
            lo, hi = total // 2, total - total // 2
        else:
            lo = hi = _expand(pad, k, 0)[i]
        out.append((lo, hi, stride[i], k_eff))
    return out


# ---------------------------------------------------------------------------------------------
# the decomposition
# ---------------------------------------------------------------------------------------------
@register
@dataclass(frozen=True)
class Spatial(Decomposition):
    sample: int = 1
    spatial: tuple[int, ...] = (1,)
    kind = "spatial"
    scaling_series = "spatial-only"
    supported_ops = frozenset({CONV, POOL, BATCH_NORM, UNARY, BINARY, DROPOUT, ADAPTIVE_POOL, MEAN})

    def in_scaling_series(self) -> bool:
        """The spatial-only series splits space alone (no sample axis)."""
        return self.sample == 1

    # ---- layouts ---------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return len(self.spatial)

    @property
    def spatial_dims(self) -> list[int]:
        return [2 + i for i in range(self.k)]

    def sharding(self) -> Sharding:
        """Sharding of a spatial value: N<sample> x D/H/W<spatial[i]>."""
        return Sharding.of((Shard(0), self.sample), *((Shard(2 + i), p) for i, p in enumerate(self.spatial)))

    def reduced_layout(self) -> Sharding:
        """Sharding of a value after a global spatial reduction: samples only."""
        return Sharding.of((Shard(0), self.sample))

    def is_spatial_shape(self, shape) -> bool:
        return len(shape) == 2 + self.k and math.prod(int(s) for s in shape[2:]) > 1

    def value_layouts(self, layer: Layer) -> dict[str, Sharding]:
        """Sharding of every value of the layer: its inputs by shape, then op by op (a global
        spatial reduction, or any op on reduced inputs only, yields the reduced layout)."""
        full, red = self.sharding(), self.reduced_layout()
        spatial: dict[str, bool] = {}
        for op in layer.ops:
            for v, s in zip(op.inputs, op.in_shapes):
                if v not in spatial:
                    spatial[v] = self.is_spatial_shape(s)
            if op.kind in (ADAPTIVE_POOL, MEAN):
                spatial[op.name] = False
            else:
                spatial[op.name] = any(spatial[v] for v in op.inputs) and \
                    len(op.out_shape) == 2 + self.k
        return {v: (full if sp else red) for v, sp in spatial.items()}

    def window_placement(self, op: OpSpec) -> Sharding:
        """The sharding window op ``op`` (conv, pool) reads its input in: the layout with
        ``HaloShard(d, lo, hi)`` on each split spatial dim (``geometry.halo_widths``; a dim no
        window reaches across stays ``Shard(d)``)."""
        full = self.sharding()
        halos = {d: halo_widths(g, full.parts_of(d)) for d, g in self.window_geoms(op)}
        return full.with_placements([HaloShard(p.dim, *halos[p.dim]) if p.dim in halos else p
                                     for p in full.placements])

    def in_placement(self, layer: Layer, value: str) -> Sharding:
        """A layer input's sharding as the layer reads it: ``window_placement`` of the window ops
        reading it (the widest halo of each side), else its ``value_layouts`` entry."""
        lay = self.value_layouts(layer).get(value, self.sharding())
        if lay != self.sharding():
            return lay
        reads = [self.window_placement(op) for op in layer.ops
                 if op.kind in WINDOW_OPS and op.inputs and op.inputs[0] == value]
        if not reads:
            return lay
        return lay.with_placements([HaloShard(p.dim, max(r.halo(p.dim)[0] for r in reads),
                                              max(r.halo(p.dim)[1] for r in reads))
                                    for p in lay.placements])

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        return self.value_layouts(layer)[value or layer.output]

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        """Batch norm: groups of ranks holding different blocks of its input (the world for a
        spatial input, the sample group for a reduced one: global statistics) and the spatial
        groups of its input (local statistics); global pooling: spatial groups."""
        lays = self.value_layouts(layer)
        out: list[list[list[int]]] = []

        def part(fn) -> list[list[int]]:
            return [list(g) for g in sorted({tuple(fn(r)) for r in range(world)})]

        for op in layer.ops:
            if op.kind == BATCH_NORM:
                lay = lays[op.inputs[0]]
                out.append(part(lambda r, lay=lay: lay.data_group(r, world)))
                # local statistics: the ranks holding the other spatial blocks of the same samples
                spatial = [d for d in lay.shard_dims if d >= 2]
                if spatial:
                    out.append(part(lambda r, lay=lay, sp=tuple(spatial): lay.split_group(list(sp), r, world)))
            elif op.kind in (ADAPTIVE_POOL, MEAN) and lays[op.inputs[0]] == self.sharding():
                full = self.sharding()
                out.append(part(lambda r: full.split_group(self.spatial_dims, r, world)))
        return out

    def bn_placement(self, layer: Layer, op: OpSpec) -> Sharding:
        return self.value_layouts(layer)[op.inputs[0]]

    # ---- legality --------------------------------------------------------------------------
    @staticmethod
    def spatial_rank(layer: Layer) -> int:
        """Number of spatial dims of the layer's anchor input (0: nothing to split)."""
        shapes = layer.anchor.in_shapes
        if not shapes:
            return 0
        k = len(shapes[0]) - 2
        return k if 1 <= k <= 3 else 0

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        """For each spatial degree s > 1 dividing the world (sample = world / s): the balanced
        factorisation of s over the spatial dims (largest smallest local extent; ties: more
        parts on the outer dim), then all of s on one dim (D, H, W). Listed balanced-first for
        every s, then single-dim splits; legal ones first, illegal ones (whose ``check`` names
        the reason) fill the rest; capped at ``ctx.max_candidates``."""
        k = cls.spatial_rank(layer)
        if k == 0:
            return []
        ext = [int(e) for e in layer.anchor.in_shapes[0][2:]]
        tiers: list[list[tuple[int, ...]]] = [[], []]
        for s in divisors(ctx.world):
            if s == 1:
                continue
            facts = [f for f in itertools.product(divisors(s), repeat=k) if math.prod(f) == s]
            best = max(facts, key=lambda f: (min(e // p for e, p in zip(ext, f)),
                                             -max(f) / min(f), f))
            tiers[0].append(best)
            for i in range(k):
                one = tuple(s if j == i else 1 for j in range(k))
                tiers[1].append(one)
        legal: list[Decomposition] = []
        illegal: list[Decomposition] = []
        seen = set()
        for tier in tiers:
            for f in tier:
                cand = cls(ctx.world // math.prod(f), f)
                if cand not in seen:
                    seen.add(cand)
                    (legal if cand.check(layer, ctx) is None else illegal).append(cand)
        # illegal ones fill any room left, so that the cost table can report why they failed
        return (legal + illegal)[:ctx.max_candidates]

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        where = layer.module or layer.name
        why = super().check(layer, ctx)
        if why:
            return f"{where}: {why}"
        if self.sample < 1 or not self.spatial or any(p < 1 for p in self.spatial) or self.k > 3:
            return f"{where}: bad spatial decomposition {self}"
        if self.sample * math.prod(self.spatial) != ctx.world:
            return (f"{where}: {self.sample} samples x {'x'.join(map(str, self.spatial))} spatial "
                    f"parts != world size {ctx.world}")
        if self.spatial_rank(layer) != self.k:
            nsp = len(layer.anchor.in_shapes[0]) - 2 if layer.anchor.in_shapes else 0
            return f"{where}: the layer's input has {nsp} spatial dims, the decomposition splits {self.k}"
        lays = self.value_layouts(layer)
        full = self.sharding()
        for op in layer.ops:
            name = op.module or where
            why = self._check_op(op, lays, full, ctx.world)
            if why:
                return f"{name}: {why}"
        return None

    def _check_values(self, op: OpSpec, lays: dict[str, Sharding], world: int) -> str | None:
        named = list(zip(op.inputs, op.in_shapes)) + [(op.name, op.out_shape)]
        for v, shape in named:
            lay = lays[v]
            if not shape or int(shape[0]) < self.sample:
                return f"value {v} has {shape[0] if shape else 0} samples < {self.sample} sample parts"
            for d in lay.shard_dims:
                p = lay.parts_of(d)
                if d > 0 and int(shape[d]) < p:
                    return (f"local {dim_name(d, len(shape))} extent 0 ({v}: extent {shape[d]} < "
                            f"{p} parts)")
        return None

    def _check_op(self, op: OpSpec, lays: dict[str, Sharding], full: Sharding, world: int) -> str | None:
        why = self._check_values(op, lays, world)
        if why:
            return why
        x_sp = bool(op.inputs) and lays[op.inputs[0]] == full
        out_sp = lays[op.name] == full
        if op.kind in WINDOW_OPS:
            if op.kind == CONV and op.attrs.get("transposed", False):
                return "transposed convolution is not supported by spatial decomposition"
            if op.kind == POOL and op.attrs.get("pool") not in ("max", "avg"):
                return f"pool {op.attrs.get('pool')!r} is not supported"
            if not x_sp or not out_sp:
                return "window op on a tensor without spatial extent to split"
            for dim, g in self.window_geoms(op, all_dims=True):
                why = axis_problem(g, full.parts_of(dim), dim_name(dim, 2 + self.k))
                if why:
                    return why
        elif op.kind == DROPOUT:
            p = float(op.attrs.get("p", op.args[1] if len(op.args) > 1 else 0.0))
            train = bool(op.attrs.get("train", op.args[2] if len(op.args) > 2 else True))
            if p > 0 and train:
                return (f"dropout with p={p} in training: each rank would draw its own random "
                        f"mask for its block (use p=0 or eval)")
        elif op.kind == ADAPTIVE_POOL:
            if op.attrs.get("pool", "avg") != "avg":
                return "only average adaptive pooling is supported"
            if any(o != 1 for o in op.attrs.get("output_size", [])):
                return (f"adaptive pooling to {op.attrs.get('output_size')} (only output size 1, "
                        f"global average pooling, is supported)")
        elif op.kind == MEAN:
            nd = len(op.in_shapes[0])
            dims = sorted({int(d) % nd for d in op.attrs.get("dims", [])})
            if x_sp and dims != self.spatial_dims:
                return (f"mean over dims {dims}: only the mean over every spatial dim "
                        f"{self.spatial_dims} is supported")
            if not x_sp and 0 in dims and self.sample > 1:
                return "mean over the sample dim of a sample-split tensor"
        elif op.kind == BINARY:
            out = [int(s) for s in op.out_shape]
            for v, s in zip(op.inputs, op.in_shapes):
                s = [int(a) for a in s]
                if lays[v] == full:
                    if len(s) != len(out) or s[0] != out[0] or s[2:] != out[2:]:
                        return f"operand {v} {s} does not match the output {out} in samples and space"
                else:
                    why = self._broadcast_ok(s, out, out_sp, is_value=True)
                    if why:
                        return f"operand {v}: {why}"
            for role, s in op.params.items():
                why = self._broadcast_ok([int(a) for a in s], out, out_sp, is_value=False)
                if why:
                    return f"parameter {role}: {why}"
        return None

    def _broadcast_ok(self, s: list[int], out: list[int], out_sp: bool, is_value: bool) -> str | None:
        """A reduced value or a parameter broadcast against a local block: no extent > 1 may
        align with a split dim (values keep their own sample split on dim 0)."""
        off = len(out) - len(s)
        for i, e in enumerate(s):
            d = off + i
            if e <= 1:
                continue
            if d == 0 and self.sample > 1 and not (is_value and e == out[0]):
                return f"shape {s} broadcasts over the sample-split dim 0"
            if d >= 2 and out_sp:
                return f"shape {s} has spatial extent against a spatially split output {out}"
        return None

    # ---- geometry shared by run and cost ---------------------------------------------------
    def window_geoms(self, op: OpSpec, all_dims: bool = False):
        """(tensor dim, WindowGeom) of the dims whose window is built explicitly: conv: split
        dims and dims with asymmetric padding; pool: every spatial dim. ``all_dims``: every
        spatial dim (for legality)."""
        full = self.sharding()
        x, y = op.in_shapes[0], op.out_shape
        out = []
        for i, (lo, hi, s, k_eff) in enumerate(window_params(op, self.k)):
            d = 2 + i
            explicit = op.kind == POOL or full.parts_of(d) > 1 or lo != hi or all_dims
            if explicit:
                out.append((d, WindowGeom(int(x[d]), int(y[d]), lo, s, k_eff)))
        return tuple(out)

    def native_padding(self, op: OpSpec) -> list[int]:
        """Padding passed to the local conv: 0 along windowed dims, the op's own elsewhere."""
        explicit = {d for d, _ in self.window_geoms(op)}
        return [0 if 2 + i in explicit else lo
                for i, (lo, _, _, _) in enumerate(window_params(op, self.k))]

    def plan(self, op: OpSpec, rank: int, world: int):
        """``rank``'s halo exchange for window op ``op``: the geometry's, checked against the
        halo ``window_placement`` states (``geometry.plan_halo``)."""
        return plan_halo(tuple(int(s) for s in op.in_shapes[0]), self.window_placement(op),
                         self.window_geoms(op), rank, world)

    # ---- cost ------------------------------------------------------------------------------
    def _halo_cost(self, op: OpSpec, ctx: CostContext, itemsize: int) -> tuple[float, float]:
        """(exchange seconds, halo buffer bytes) of one window op, forward; an upper bound over
        ranks, exact when the splits are even.

        Dims are exchanged in order; along split dim d with ``p_d`` parts, block c sends and
        receives slices of ``len * cross`` elements per neighbour, where ``len`` comes from
        ``halo.axis_pieces`` (the depth the neighbour's window needs) and ``cross`` is the
        product of the other extents when the step runs: the samples ``N/p_N`` (block 0), the
        channels C, the (largest) window extent of dims exchanged earlier, the (largest) block
        extent of later dims. Each message is a p2p on the link between the two ranks::

            T_step(c) = max( sum_sends T_p2p(bytes, level(r, nbr)),
                             sum_recvs T_p2p(bytes, level(r, nbr)) )      (ours: one injection
                                                                            link per rank)
            T_halo    = sum_d max_c T_step(c)
            buffers   = sum_d max_c (sent + received bytes)
        """
        from ...cost import primitives as prim  # plan-time half: the runtime never loads cost
        geoms = self.window_geoms(op)
        full = self.sharding()
        x = [int(s) for s in op.in_shapes[0]]
        ext = list(full.max_local_shape(x))
        total_t = total_b = 0.0
        prof = ctx.profile
        world = ctx.world
        for dim, g in geoms:
            p = full.parts_of(dim)
            cross = math.prod(e for d, e in enumerate(ext) if d != dim)
            best_t = best_b = 0.0
            if p > 1:
                axis = full.shard_dims.index(dim)
                for c in range(p):
                    _, lo_len, _, _, hi_len, _, sends = axis_pieces(g, p, c)
                    coords = [0] * len(full.shard_axes)
                    coords[axis] = c
                    me = full.rank_of(coords, 0, world)

                    def t(q, n_elems):
                        cc = list(coords)
                        cc[axis] = q
                        nb = n_elems * cross * itemsize
                        level = ctx.level([me, full.rank_of(cc, 0, world)])
                        return prof.collective_time_s("p2p", 2, nb, level)

                    t_send = sum(t(q, ln) for q, _, ln in sends)
                    t_recv = (t(c - 1, lo_len) if lo_len else 0.0) + (t(c + 1, hi_len) if hi_len else 0.0)
                    nbytes = (sum(ln for _, _, ln in sends) + lo_len + hi_len) * cross * itemsize
                    best_t = max(best_t, t_send, t_recv)
                    best_b = max(best_b, nbytes)
            if p > 1 and best_b > 0:   # one blocking exchange round per split dim that moves
                # data (latency as met in a step); windows that need no neighbour's rows (a
                # pooling whose stride equals its kernel, split on window boundaries) send nothing
                best_t += max(0.0, prim.insitu_latency_s(prof, 2, ctx.ranks_on_node, "p2p") - prof.collective_time_s("p2p", 2, 0.0, "intra"))
            total_t += best_t * prim.correction(prof, "blocking_comm_scale")
            total_b += best_b
            ext[dim] = max(b - a for a, b in (window_bounds(g, p, c) for c in range(p)))
        return total_t, total_b

    def _local_shapes(self, op: OpSpec, lays: dict[str, Sharding]):
        """Local (largest block) input and output shapes the runtime computes on: windows for
        conv/pool inputs, blocks otherwise."""
        ins = [list(lays[v].max_local_shape(s)) for v, s in zip(op.inputs, op.in_shapes)]
        out = list(lays[op.name].max_local_shape(op.out_shape))
        if op.kind in WINDOW_OPS and ins:
            full = self.sharding()
            for d, g in self.window_geoms(op):
                p = full.parts_of(d)
                ins[0][d] = max(b - a for a, b in (window_bounds(g, p, c) for c in range(p)))
        return ins, out

    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """``price_replicated_weights`` (weights whole, gradients allreduced over the world)
        on the shapes the runtime computes on, plus the spatial terms:

        compute   = sum_ops op_compute_s(local shapes): conv and pool on their input window
                    ``(N/p_N, C, w_1.., w_k)``, ``w_d = (On_d - 1)*s_d + k_eff_d`` along
                    windowed dims (the block grows by the halo), with padding 0 there (the
                    shape key of what runs); other ops on the largest block
        fwd comm  = sum_window_ops T_halo (``_halo_cost``)             (no overlap: the runtime
                    waits for the halos before computing)
                  + per global pooling: allreduce(N/p_N * C words, spatial group)
                  + batch norm statistics over the data group of its input (the world for a
                    spatial input, the sample group after global pooling), by the formula of
                    ``common.price_replicated_weights``
        bwd comm  = the same: backward-data sends the halo gradients back (same volume; none
                    for an op whose input carries no gradient, ``decomp.ir.mark_input_grads``),
                    global pooling's backward allreduces, batch norm's backward allreduce
        grad      = allreduce(param bytes, world)                                -> grad_sync_s
        memory    = params + grads + optimizer state (whole) + saved activations (windows for
                    conv/pool) + workspace = largest halo send+receive buffers of one op
        """
        from ...cost import primitives as prim  # plan-time half: the runtime never loads cost
        lays = self.value_layouts(layer)
        item = layer.itemsize
        halo_t = halo_bwd = work = gap_t = bn_fwd = bn_bwd = 0.0
        shapes: dict[str, tuple[list, list]] = {}
        priced_ops = []
        hook = lambda op, ins, out: shapes[op.name]  # noqa: E731
        for op in layer.ops:
            shapes[op.name] = self._local_shapes(op, lays)
            if op.kind in WINDOW_OPS:
                t, b = self._halo_cost(op, ctx, item)
                halo_t += t
                if takes_input_grad(op):   # else no halo gradient flows back
                    halo_bwd += t
                work = max(work, b)
            if op.kind == CONV:
                a = dict(op.attrs)
                a["padding"] = self.native_padding(op)
                op = replace(op, attrs=a)
            if op.kind in (ADAPTIVE_POOL, MEAN) and lays[op.inputs[0]] == self.sharding():
                x = shapes[op.name][0][0]
                grp = self.sharding().split_group(self.spatial_dims, 0, ctx.world)
                gap_t += prim.allreduce_s(ctx, x[0] * x[1] * item, grp)
            if op.kind == BATCH_NORM:
                # statistics over the data group of the BN's input layout, priced by the shared
                # formula of common.price_replicated_weights on that op alone
                lay = lays[op.inputs[0]]
                one = Layer(index=layer.index, name=op.name, ops=[op], inputs=list(op.inputs),
                            output=op.name, module=layer.module)
                bn = price_replicated_weights(one, lay, ctx, compute_shapes=hook,
                                              bn_group_size=len(lay.data_group(0, ctx.world)))
                bn_fwd += bn.fwd_comm_s
                bn_bwd += bn.bwd_comm_s
            priced_ops.append(op)
        priced = Layer(index=layer.index, name=layer.name, ops=priced_ops, inputs=layer.inputs,
                       output=layer.output, module=layer.module)
        return price_replicated_weights(
            priced, self.reduced_layout(), ctx, extra_fwd_comm_s=halo_t + gap_t + bn_fwd,
            extra_bwd_comm_s=halo_bwd + gap_t + bn_bwd, workspace_bytes=work, bn_group_size=1,
            compute_shapes=hook)

