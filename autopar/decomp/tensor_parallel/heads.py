"""Head-parallel attention (Megatron-LM, Shoeybi et al. 2019), with data parallelism: ``head(s, p)``.

The unit is an attention sub-graph (``autopar.decomp.tensor_parallel.detect`` finds it in the
traced graph; a model file may also name it in ``PLANNING_UNITS``)::

    x -> q/k/v projections (column-parallel) -> view / transpose (/ rotary) -> SDPA
      -> transpose / reshape -> output projection (row-parallel) -> partial y

Legend: x_NSE (batch, sequence, width), q_NHSD (H query heads of width D), k/v_NKSD (K
key/value heads, K divides H: grouped-query attention), fused qkv output N S (H + 2K) D.
Mesh ``(s, p)``, ``rank = c_s * p + c_t`` (``tensor_parallel.common``).

Each rank of a tensor group takes H/p query heads and K/p key/value heads (block c_t of each),
and runs SDPA locally on them: heads are independent, and with K/p KV heads per rank the
grouping of query head h onto KV head h // (H/K) stays inside the rank. The weights follow:

* a column projection's weight rows (and bias) are split in p blocks; a *fused* projection
  (q|k|v in one Linear whose output the model slices) is split *by segment*: rank c_t holds
  block c_t of each of q, k and v (``ParamShard.segments``), so its local output is
  [q_c | k_c | v_c] and each slice of it is rescaled to the local segment;
* the output projection's weight columns are split in p blocks (the columns of the local
  heads), its bias is whole and added by tensor rank 0 only; its output is a partial sum
  (``Sharding(((0, s),), partial=p)``), resolved by the consumer's edge: an all-reduce into a
  replicated layer, a reduce-scatter into a sequence-parallel one. Reshapes and identity
  dropout (p = 0) may follow it inside the unit: they are linear, so they commute with the sum.

A projection is ``nn.Linear`` (weight w_FC: "rows" above are dim 0, "columns" dim 1) or
Hugging Face's ``Conv1D`` (``detect.projection``: ``view(-1, E)`` -> ``addmm(b, x, w_CF)`` ->
``view(N, S, F)``, the weight stored transposed): the same split on the transposed dims (a
column projection's w_CF by its LAST dim, by segment for GPT-2's fused ``c_attn`` [E, 3E]
whose output is sliced after the view back to (N, S, 3E); the output projection's by its
first), its ``N S`` rows split by samples as merged-batch rows (``common.batch_dim_ok``).
``MlpParallel`` (``mlp(s, p)``) runs the same analysis on a Conv1D MLP unit: column ``c_fc``,
the activation on the split features, row ``c_proj``.

Which dim of every value inside the unit holds the split is found by following it op by op
(``analyse``): through views by the prefix-product rule (a block of p along input dim d is a
block of p along output dim e when the dims before d and before e hold the same number of
elements and both extents divide by p), through permutations, elementwise ops (a broadcast
operand whose extent is 1 on the split dim is used whole), slices of another dim, and
concatenations along another dim. Anything else inside the unit makes it illegal, with the op
and the reason. Heads or KV heads that p does not divide are rejected at plan time
(``check``), naming the unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..base import CostContext, Decomposition, LayerCost, ParamShard, register
from ..common import batch_dim_ok
from ..ir import (ATTENTION, BINARY, CAT, DROPOUT, EXPAND, FLATTEN, LAYER_NORM, LINEAR, MATMUL,
                  PERMUTE, RMS_NORM, SLICE, SOFTMAX, SQUEEZE, UNARY, VIEW, Layer, OpSpec)
from ..sharding import Sharding, Partial, Shard, block_extent
from .common import grad_sync, mesh, mesh_check, partition, two_axis_candidates
from .detect import projection

_RESHAPES = (VIEW, FLATTEN, SQUEEZE)
SUPPORTED = frozenset({LINEAR, SLICE, VIEW, FLATTEN, SQUEEZE, EXPAND, PERMUTE, ATTENTION, UNARY,
                       BINARY, DROPOUT, CAT, MATMUL, SOFTMAX, LAYER_NORM, RMS_NORM})
_BIG = 2 ** 62


@dataclass(frozen=True)
class HeadSplit:
    """Where the head split sits in every value of one unit under p tensor parts."""

    split: dict = field(default_factory=dict)        # value -> tensor dim split into p blocks
    columns: tuple[str, ...] = ()                    # column-parallel projections
    row: str = ""                                    # the row-parallel output projection
    fused: str = ""                                  # the segmented (fused q|k|v) projection
    segments: tuple[int, ...] = ()                   # its output segments (global extents)
    slices: dict = field(default_factory=dict)       # slice op -> local (start, end)


def _norm_index(v, n: int, default: int) -> int:
    if v is None:
        return default
    v = int(v)
    if v < 0:
        v += n
    return max(0, min(n, v))


def _slice_args(op: OpSpec) -> tuple[int, int, int]:
    n = int(op.in_shapes[0][op.attrs["dim"]])
    a = op.args
    start = _norm_index(a[2] if len(a) > 2 else op.kwargs.get("start"), n, 0)
    end = _norm_index(a[3] if len(a) > 3 else op.kwargs.get("end", _BIG), n, n)
    step = int(a[4]) if len(a) > 4 and a[4] is not None else int(op.kwargs.get("step", 1) or 1)
    if op.target.startswith("aten.narrow"):
        end = start + int(a[3])
    return start, end, step


def _reshape_dim(in_shape, out_shape, d: int, p: int) -> int | None:
    """The output dim that holds input dim ``d``'s split into ``p`` blocks (prefix-product
    rule, module docstring), or None."""
    pre = math.prod(int(n) for n in in_shape[:d])
    acc = 1
    for e, n in enumerate(out_shape):
        if acc == pre and int(n) > 1:
            return e if int(n) % p == 0 else None
        acc *= int(n)
        if acc > pre:
            return None
    return None


def _slice_readers(name: str, users: dict[str, list[OpSpec]], last: int) -> list[OpSpec]:
    """The slices of dim ``last`` (the last dim) of value ``name``, also through reshapes that
    keep the last dim whole (Conv1D's ``view(N, S, 3E)`` of its ``(N S, 3E)`` result)."""
    out, todo = [], [(name, last)]
    while todo:
        v, d = todo.pop()
        for u in users.get(v, []):
            if u.kind == SLICE and u.attrs.get("dim") % len(u.in_shapes[0]) == d and not u.attrs.get("select"):
                out.append(u)
            elif u.kind in _RESHAPES and int(u.out_shape[-1]) == int(u.in_shapes[0][d]) and d == len(u.in_shapes[0]) - 1:
                todo.append((u.name, len(u.out_shape) - 1))
    return out


def _linear_in_partial(op: OpSpec) -> bool:
    """Ops that may run on the row-parallel projection's partial sum (each rank's share, summed
    later): reshapes, and dropout that is the identity (p = 0 or eval). A dropout with p > 0
    draws its mask per rank, and masked partial sums do not add up to the masked sum."""
    if op.kind in _RESHAPES:
        return True
    return op.kind == DROPOUT and (not float(op.attrs.get("p", 0.0)) or not op.attrs.get("train", True))


def analyse(layer: Layer, p: int) -> tuple[HeadSplit | None, str | None]:
    """(the head split of ``layer`` under ``p`` tensor parts, None) or (None, why not).
    Without an attention op this is the Megatron MLP pair's split (``MlpParallel``)."""
    attn = [op for op in layer.ops if op.kind == ATTENTION]
    for op in attn:
        q, k = op.in_shapes[0], op.in_shapes[1]
        if len(q) < 3 or len(k) < 3:
            return None, f"{op.name}: attention operands without a heads dim"
        h, kv = int(q[-3]), int(k[-3])
        if h % p:
            return None, f"{h} attention heads are not divisible by {p} tensor parts"
        if kv % p:
            return None, (f"{kv} key/value heads (grouped-query attention, {h} query heads) are not "
                          f"divisible by {p} tensor parts")
    users: dict[str, list[OpSpec]] = {}
    for op in layer.ops:
        for v in op.inputs:
            users.setdefault(v, []).append(op)
    split: dict[str, int] = {}
    segs: dict[str, tuple[int, ...]] = {}
    slices: dict[str, tuple[int, int]] = {}
    columns: list[str] = []
    row = fused = ""
    partial = ""                                            # the value holding the partial sum
    segments: tuple[int, ...] = ()
    for op in layer.ops:
        if row:
            if op.inputs[:1] == [partial] and len(op.inputs) == 1 and _linear_in_partial(op):
                partial = op.name
                continue
            return None, f"op {op.name} runs after the row-parallel projection {row} (on a partial sum)"
        k = op.kind
        d_in = [split.get(v) for v in op.inputs]
        proj = projection(op)
        if k == LINEAR and proj is None:
            return None, f"{op.name}: a linear op without a 2-d weight"
        if proj is not None:
            w = op.params[proj.weight]
            d = d_in[0] if d_in else None
            last = len(op.in_shapes[0]) - 1
            if d is None:
                f_out = int(w[proj.out_dim])
                bounds = {0, f_out}
                for u in _slice_readers(op.name, users, len(op.out_shape) - 1):
                    s0, s1, st = _slice_args(u)
                    if st != 1:
                        return None, f"{u.name}: a strided slice of the projection {op.name}"
                    bounds |= {s0, s1}
                sg = tuple(b - a for a, b in zip(sorted(bounds), sorted(bounds)[1:]))
                bad = [n for n in sg if n % p]
                if bad:
                    return None, (f"{op.name}: an output segment of {bad[0]} features is not divisible "
                                  f"by {p} tensor parts")
                if len(sg) > 1:
                    if fused:
                        return None, f"{op.name}: a second fused projection (after {fused})"
                    fused, segments = op.name, sg
                    segs[op.name] = sg
                split[op.name] = len(op.out_shape) - 1
                columns.append(op.name)
            elif d == last and op.inputs[0] not in segs:
                if int(w[proj.in_dim]) % p:
                    return None, f"{op.name}: {w[proj.in_dim]} input features not divisible by {p}"
                row = partial = op.name
            else:
                return None, f"{op.name}: its input is split along dim {d}, not its features"
            continue
        if all(d is None for d in d_in):
            if k in (LINEAR, ATTENTION) or proj is not None:
                return None, f"{op.name}: runs on whole operands inside the unit"
            continue                                        # whole values stay whole
        src = op.inputs[0]
        d = d_in[0]
        if src in segs and k in _RESHAPES and d == len(op.in_shapes[0]) - 1 \
                and int(op.out_shape[-1]) == int(op.in_shapes[0][d]):
            segs[op.name] = segs[src]                       # Conv1D's view back to (N, S, 3E)
            split[op.name] = len(op.out_shape) - 1
            continue
        if src in segs and k != SLICE:
            return None, f"{op.name} ({k}) reads the fused projection {src} other than by slicing it"
        if k == SLICE:
            if d is None:
                return None, f"{op.name}: slices a whole value"
            sd, sel = op.attrs.get("dim"), op.attrs.get("select")
            if sd != d:
                split[op.name] = d - 1 if (sel and sd < d) else d
                continue
            if sel:
                return None, f"{op.name}: selects one index of the split dim"
            s0, s1, _ = _slice_args(op)
            sg = segs.get(src, (int(op.in_shapes[0][d]),))
            starts = [sum(sg[:i]) for i in range(len(sg))]
            if (s0, s1) not in {(a, a + n) for a, n in zip(starts, sg)}:
                return None, f"{op.name}: slice [{s0}, {s1}) is not one segment of {src}"
            i = starts.index(s0)
            slices[op.name] = (sum(n // p for n in sg[:i]), sum(n // p for n in sg[:i + 1]))
            split[op.name] = d
        elif k in _RESHAPES:
            e = _reshape_dim(op.in_shapes[0], op.out_shape, d, p)
            if e is None:
                return None, (f"{op.name}: the split of dim {d} does not follow the reshape "
                              f"{list(op.in_shapes[0])} -> {list(op.out_shape)} in {p} parts")
            split[op.name] = e
        elif k == EXPAND:
            e = d + len(op.out_shape) - len(op.in_shapes[0])
            if int(op.out_shape[e]) != int(op.in_shapes[0][d]):
                return None, f"{op.name}: expands the split dim"
            split[op.name] = e
        elif k == PERMUTE:
            split[op.name] = list(op.attrs["perm"]).index(d)
        elif k in (UNARY, DROPOUT, BINARY, CAT, MATMUL, ATTENTION, SOFTMAX, LAYER_NORM, RMS_NORM):
            r = len(op.out_shape)
            if k == MATMUL:
                if len(d_in) != 2 or d_in[0] is None or d_in[1] is None:
                    return None, f"{op.name}: a matmul with a whole operand inside the unit"
                dims = {d_in[0] + r - len(op.in_shapes[0]), d_in[1] + r - len(op.in_shapes[1])}
                if len(dims) != 1 or next(iter(dims)) >= r - 2:
                    return None, f"{op.name}: a matmul over the split dim"
                split[op.name] = dims.pop()
                continue
            if k == ATTENTION:
                if any(x is None or x != len(s) - 3 for x, s in zip(d_in[:3], op.in_shapes[:3])):
                    return None, f"{op.name}: q, k and v must all be split along their heads dim"
                rest = zip(op.inputs[3:], d_in[3:], op.in_shapes[3:])
            else:
                rest = zip(op.inputs, d_in, op.in_shapes)
            outs = set()
            for v, dv, sh in rest:
                if dv is not None:
                    outs.add(dv + r - len(sh))
            if k == ATTENTION:
                outs = {r - 3}
            if len(outs) != 1:
                return None, f"{op.name}: its operands are split along different dims"
            e = outs.pop()
            ins = zip(op.inputs, d_in, op.in_shapes) if k != ATTENTION else zip(op.inputs[3:], d_in[3:], op.in_shapes[3:])
            for v, dv, sh in ins:
                a = e - (r - len(sh))
                if dv is None and a >= 0 and int(sh[a]) != 1:
                    return None, f"{op.name}: operand {v} is whole along the split dim {e}"
            if k == CAT and op.attrs.get("dim", 0) % r == e:
                return None, f"{op.name}: concatenates along the split dim"
            if k == SOFTMAX and int(op.attrs.get("dim", -1) if op.attrs.get("dim") is not None else -1) % r == e:
                return None, f"{op.name}: softmax over the split dim"
            if k in (LAYER_NORM, RMS_NORM) and e >= r - len(op.attrs.get("normalized_shape") or [1]):
                return None, f"{op.name}: normalizes over the split dim"
            split[op.name] = e
        else:
            return None, f"op {op.name} ({k}) is not supported inside a head-parallel unit"
    lin = [op.module for op in layer.ops if projection(op) is not None]
    if len(set(lin)) != len(lin) or "" in lin:
        return None, "two projections share one module (each needs its own nn.Linear or Conv1D)"
    if not row:
        return None, "no row-parallel output projection (a linear on the split features) ends the unit"
    if layer.output != partial or layer.side_outputs:
        return None, f"the unit's output must be the output projection {row} alone"
    return HeadSplit(split, tuple(columns), row, fused, segments, slices), None


def relative_module(layer: Layer, op_name: str) -> str:
    """The module of op ``op_name`` relative to the unit's (equal units have equal ones, so a
    decomposition priced for one is valid for its copies; ``cost.table.layer_signature``)."""
    mod = next(op.module for op in layer.ops if op.name == op_name)
    pre = (layer.module + ".") if layer.module else ""
    return mod[len(pre):] if pre and mod.startswith(pre) else mod


def _is(op: OpSpec, rel: str) -> bool:
    return bool(rel) and (op.module == rel or op.module.endswith("." + rel))


_CACHE: dict[tuple[int, int], tuple[Layer, HeadSplit | None, str | None]] = {}


def cached_analysis(layer: Layer, p: int) -> tuple[HeadSplit | None, str | None]:
    got = _CACHE.get((id(layer), p))
    if got is None or got[0] is not layer:
        got = _CACHE[(id(layer), p)] = (layer, *analyse(layer, p))
    return got[1], got[2]


@register
@dataclass(frozen=True)
class HeadParallel(Decomposition):
    """Attention heads split over ``parts`` ranks, samples over ``sample`` (module docstring).
    ``row`` and ``fused`` are the modules (relative to the unit's) of the unit's output
    projection and fused projection, ``segments`` the fused output's segments (found by
    ``analyse``; kept in the value so that ``param_shard`` needs no layer)."""

    sample: int = 1
    parts: int = 2
    row: str = ""
    fused: str = ""
    segments: tuple[int, ...] = ()
    kind = "head"
    _what = "head parallelism"
    supported_ops = SUPPORTED
    scaling_series = "tensor-only"

    def in_scaling_series(self) -> bool:
        return self.sample == 1

    def __str__(self) -> str:
        return f"{self.kind}({self.sample},{self.parts})"

    # ---- layouts ----------------------------------------------------------------------------
    def in_placement(self, layer: Layer, value: str) -> Sharding:
        try:
            shape = layer.in_shape(value)
        except KeyError:
            shape = None
        if shape is not None and (not shape or any(int(n) == 0 for n in shape)):
            return Sharding()      # an empty operand (a legacy empty cache): whole, nothing to split
        return Sharding.of((Shard(0), self.sample))

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        return Sharding.of((Shard(0), self.sample), (Partial(), self.parts))

    def param_shard(self, op: OpSpec, role: str) -> ParamShard:
        """Row projection: the weight's input-feature dim split (dim 1 of nn.Linear's w_FC, dim
        0 of Conv1D's w_CF), the bias whole. Column projections: the weight's output-feature
        dim (0 of w_FC, 1 of w_CF) and the bias split, by segment for the fused one."""
        proj = projection(op)
        if proj is None or role not in (proj.weight, proj.bias):
            return ParamShard()
        m = mesh(self.sample, self.parts)
        axis = 0 if self.sample == 1 else 1
        if _is(op, self.row):
            return ParamShard.on(m, ((proj.in_dim, axis),)) if role == proj.weight else ParamShard()
        segs = self.segments if _is(op, self.fused) else ()
        return ParamShard.on(m, ((proj.out_dim if role == proj.weight else 0, axis),), segs)

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        return [[list(g) for g in partition(self.sample, self.parts, "s")]] if self.sample > 1 else []

    # ---- legality ---------------------------------------------------------------------------
    @classmethod
    def _unit_kind_ok(cls, layer: Layer) -> str | None:
        """Why ``layer`` is not the kind of unit this decomposition splits (None: it is)."""
        if not any(op.kind == ATTENTION for op in layer.ops):
            return "no attention op in the unit (head parallelism splits attention heads)"
        return None

    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        if cls._unit_kind_ok(layer) or not any(projection(op) for op in layer.ops):
            return []
        out = []
        for c in two_axis_candidates(cls, ctx):
            an, _ = cached_analysis(layer, c.parts)
            out.append(cls(c.sample, c.parts, relative_module(layer, an.row),
                           relative_module(layer, an.fused) if an.fused else "", an.segments) if an else c)
        return out

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        why = mesh_check(self, layer, ctx)
        if why:
            return why
        name = layer.module or layer.name
        an, why = cached_analysis(layer, self.parts)
        why = self._unit_kind_ok(layer) or why
        if why:
            return f"{name}: {self._what} over {self.parts}: {why}"
        mine = (relative_module(layer, an.row), relative_module(layer, an.fused) if an.fused else "", an.segments)
        if mine != (self.row, self.fused, self.segments):
            return f"{name}: {self} was made for another unit (projection {self.row})"
        if self.sample > 1:
            why = batch_dim_ok(layer, merged_parts=self.sample)    # Conv1D's view(-1, E): N S rows
            if why:
                return f"{name}: {why}"
            if int(layer.ops[0].in_shapes[0][0]) < self.sample:
                return f"{name}: batch < {self.sample} sample parts"
        return None

    # ---- shapes -----------------------------------------------------------------------------
    def local_shape(self, an: HeadSplit, value: str, shape, cs: int = 0) -> tuple[int, ...]:
        out = [int(n) for n in shape]
        if self.sample > 1 and out:
            out[0] = block_extent(out[0], self.sample, cs)
        d = an.split.get(value)
        if d is not None:
            out[d] //= self.parts
        return tuple(out)

    # ---- cost -------------------------------------------------------------------------------
    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """Per rank (block 0 of the samples is the largest: the slowest rank).

        compute  = sum over the unit's ops of op_compute_s(local shapes): every value with its
                   split dim / p and N / s; projections with w_loc (F/p, C) (column) or
                   (F, C/p) (row); SDPA on H/p query and K/p KV heads
        comm     = 0 inside the unit: the input is replicated over the tensor group (its
                   backward partial dx is summed by the incoming edge's adjoint, or stays a
                   partial gradient under the sum convention) and the output is a partial sum
                   resolved on the outgoing edge (all-reduce or reduce-scatter, priced there)
        grad     = T_allreduce(s, sharded projection bytes) among the s replicas of a shard
                   + T_allreduce(P, whole bytes: output bias, norms inside the unit)
        memory   = local params + grads + optimizer_state_per_param * local params
                   + saved activations at local shapes (SDPA: q, k, v, y of the local heads;
                   an unfused softmax(QK^T) saves its N/s x H/p x S x S scores)
        """
        from ...cost import primitives as prim
        an, _ = cached_analysis(layer, self.parts)
        item = layer.itemsize
        shapes: dict[str, tuple[int, ...]] = {}
        for v in layer.inputs:
            shapes[v] = self.local_shape(an, v, layer.in_shape(v))
        fwd = bwd = saved = 0.0
        sources = set()
        sharded = whole = 0.0
        for op in layer.ops:
            ins = [shapes.get(v) or self.local_shape(an, v, s) for v, s in zip(op.inputs, op.in_shapes)]
            out = shapes[op.name] = self.local_shape(an, op.name, op.out_shape)
            w_loc = None
            proj = projection(op)
            for role, shape in op.params.items():
                sh = self.param_shard(op, role)
                local = sh.local_shape(shape, 0, self.sample * self.parts)
                if proj is not None and role == proj.weight:
                    w_loc = local
                if sh.dims:
                    sharded += math.prod(local) * item
                else:
                    whole += math.prod(local) * item
            if op.name == an.row:
                ins = [tuple(ins[0])]
            f, b, src = prim.op_compute_s(op, ins, out, ctx, w_shape=w_loc, itemsize=item)
            fwd, bwd = fwd + f, bwd + b
            sources.add(src)
            saved += prim.saved_bytes(op, ins, out, item)
        gs, synced, latency = grad_sync(ctx, sharded, whole, self.sample, self.parts)
        pbytes = sharded + whole
        return LayerCost(fwd_compute_s=fwd, bwd_compute_s=bwd, grad_sync_s=gs, grad_sync_bytes=synced,
                         grad_sync_latency=latency, param_bytes=pbytes, grad_bytes=pbytes,
                         optim_bytes=prim.optimizer_bytes(ctx, pbytes), activation_bytes=saved,
                         source=sources.pop() if len(sources) == 1 else "mixed")


@register
@dataclass(frozen=True)
class MlpParallel(HeadParallel):
    """The Megatron MLP pair as one unit (a Conv1D MLP, ``detect.mlp_modules``): the first
    projection column-parallel (weight split by output features, its output and the activation
    after it split along the features), the second row-parallel (weight split by input
    features, output a partial sum resolved on the outgoing edge), samples over ``sample``.
    The same split-following analysis, layouts, cost and runtime as ``head(s, p)`` (module
    docstring), on a unit without attention: ``mlp(s, p)``. (An ``nn.Linear`` MLP whose
    activation folds into the first layer is planned layer by layer instead, ``filter`` ->
    ``row_parallel``.)"""

    kind = "mlp"
    _what = "MLP tensor parallelism"

    @classmethod
    def _unit_kind_ok(cls, layer: Layer) -> str | None:
        if any(op.kind == ATTENTION for op in layer.ops):
            return "the unit holds attention (head(s, p) splits it)"
        if sum(1 for op in layer.ops if projection(op)) < 2:
            return "fewer than two projections in the unit (a column- and a row-parallel one)"
        return None

