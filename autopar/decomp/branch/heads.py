"""SUPER's head-group branches: ``HeadGroups(data, groups, replicas, ffn)``.

SUPER (Jain et al., IPDPS 2021) groups a block's attention heads into B branches (B divides
the head count), each computed by its own group of processes, the groups replicated over
blocks of samples (data parallelism). In the *all sub-graph* variant (``ffn=1``) the
feed-forward block is split per branch too (each group its ``1/B`` of the hidden features),
otherwise (``ffn=0``) the feed-forward block runs whole on every rank of the branch axis.

Legend: ``G`` = groups (branches), ``D`` = data, ``R`` = replicas; logical rank
``r = (d * G + g) * R + x`` (as ``Branch``: the branch axis inside the sample axis, so under
block placement a sample block's G ranks are neighbours: SUPER's interleaved placement).

The unit's values get a state by propagation through its ops (``head_plan``, pure):

* ``None``   whole on every rank of the branch axis (the unit's input, the layer norm);
* dim ``j``  split along tensor dim j into G blocks (q/k/v projections' outputs: features,
             then heads after the view, heads dim 1 inside SDPA);
* ``"P"``    a partial sum over the branch axis (the output projection, and the residual
             add, whose whole operand counts on group 0 only).

Ops: ``col`` a linear with whole input whose output features are split (weight rows, bias);
``row`` a linear whose input features are split (weight columns; the bias added on group 0
only): its output is partial; ``split`` shape ops, elementwise ops and SDPA on split values
(views map the split dim when the blocks stay contiguous, which needs heads % G == 0);
``sum`` add/sub of partial and whole values; ``reduce`` any other op with a partial input,
after summing it over the branch axis (``branch_sum``: grid translation's sum). A partial
unit output leaves as ``N<D> x P<G>``; the transition after the unit sums it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from ..base import CostContext, Decomposition, LayerCost, ParamShard, divisors, register
from ..common import batch_dim_ok
from ..ir import REGISTERED, Layer, OpSpec
from ..sharding import Sharding, Partial, Shard
from .graph import _number_operand, ancestors, refuse_batch_norm

P = "P"
_SUMS = ("aten.add.Tensor", "aten.sub.Tensor")


@dataclass
class HeadPlan:
    state: dict[str, object] = field(default_factory=dict)     # value -> None | dim | "P"
    mode: dict[str, str] = field(default_factory=dict)         # op -> whole|col|row|split|sum|reduce
    split_params: dict[str, dict[str, int]] = field(default_factory=dict)  # op -> role -> dim
    problem: str | None = None


def _view_dim(op: OpSpec, i: int, groups: int) -> int | None:
    """The output dim carrying the input's split dim ``i`` through a view/reshape, when each
    of the G blocks stays one contiguous block."""
    src, dst = op.in_shapes[0], op.out_shape
    pre = math.prod(src[:i])
    chunk = src[i] // groups * math.prod(src[i + 1:])
    for j in range(len(dst)):
        if math.prod(dst[:j]) == pre and dst[j] % groups == 0 and \
                dst[j] // groups * math.prod(dst[j + 1:]) == chunk:
            return j
    return None


def _permute_dim(op: OpSpec, i: int) -> int | None:
    args = op.args
    n = len(op.out_shape)
    if op.target == "aten.transpose.int":
        a, b = (int(x) % n for x in args[1:3])
        return b if i == a else a if i == b else i
    if op.target == "aten.permute.default":
        perm = [int(x) % n for x in args[1]]
        return perm.index(i)
    if op.target in ("aten.t.default",):
        return 1 - i
    return None


def head_plan(layer: Layer, groups: int, ffn: bool) -> HeadPlan:
    """States and op modes of ``layer`` under G = ``groups`` (module docstring); ``problem``
    says why the unit cannot take the split."""
    hp = HeadPlan()
    anc = ancestors(layer.ops)
    attn = [op.name for op in layer.ops if op.kind == "attention"]
    if not attn:
        hp.problem = f"unit {layer.module or layer.name} has no attention op (no heads to group)"
        return hp
    feeds_attn = set().union(*(anc[a] for a in attn))
    for v in layer.inputs:
        hp.state[v] = None
    for op in layer.ops:
        ins = [hp.state.get(v) for v in op.inputs]
        split = [s for s in ins if isinstance(s, int)]
        partial = [s for s in ins if s == P]
        last_in = len(op.in_shapes[0]) - 1 if op.in_shapes else -1
        if not split and not partial:
            if op.kind == "linear" and "weight" in op.params and (ffn or op.name in feeds_attn):
                if op.out_shape[-1] % groups:
                    hp.problem = (f"{op.name}: {op.out_shape[-1]} output features do not divide into "
                                  f"{groups} branch groups")
                    return hp
                hp.mode[op.name], hp.state[op.name] = "col", len(op.out_shape) - 1
                hp.split_params[op.name] = {r: 0 for r in op.params}
            else:
                hp.mode[op.name], hp.state[op.name] = "whole", None
            continue
        if split and partial:
            hp.problem = f"{op.name} mixes split and partial inputs"
            return hp
        if partial:
            if op.target in _SUMS and not _number_operand(op):
                hp.mode[op.name], hp.state[op.name] = "sum", P
            else:
                hp.mode[op.name], hp.state[op.name] = "reduce", None
            continue
        i = split[0]
        if op.kind == "linear" and ins[0] == last_in and len(split) == 1:
            hp.mode[op.name], hp.state[op.name] = "row", P
            hp.split_params[op.name] = {"weight": 1}
            continue
        if op.kind == "view" and len(split) == 1:
            j = _view_dim(op, i, groups)
            if j is None:
                hp.problem = (f"{op.name}: the view {op.in_shapes[0]} -> {op.out_shape} breaks the "
                              f"{groups} head groups (the head count must divide by the groups)")
                return hp
            hp.mode[op.name], hp.state[op.name] = "split", j
            continue
        if op.kind == "permute" and len(split) == 1:
            j = _permute_dim(op, i)
            if j is None:
                hp.problem = f"{op.name}: {op.target} on a head-group split is not supported"
                return hp
            hp.mode[op.name], hp.state[op.name] = "split", j
            continue
        if op.kind == "attention":
            if ins[:3] != [1, 1, 1] or len(op.out_shape) != 4:
                hp.problem = f"{op.name}: q, k and v must be split on the heads dim (1)"
                return hp
            if op.in_shapes[0][1] % groups or op.in_shapes[1][1] % groups:
                hp.problem = f"{op.name}: {op.in_shapes[0][1]} heads do not divide into {groups} groups"
                return hp
            hp.mode[op.name], hp.state[op.name] = "split", 1
            continue
        if op.kind == "unary" and len(ins) == 1:
            hp.mode[op.name], hp.state[op.name] = "split", i
            continue
        hp.problem = f"{op.name} ({op.kind}) cannot run on a head-group split input"
        return hp
    for v in layer.outputs:
        if isinstance(hp.state.get(v), int):
            hp.problem = f"{v} leaves the unit split along dim {hp.state[v]} (only whole or partial)"
            return hp
    if not any(m == "col" for m in hp.mode.values()):
        hp.problem = f"unit {layer.module or layer.name}: no projection to split into head groups"
    return hp


_CACHE: dict[tuple, tuple[Layer, HeadPlan]] = {}


def plan_of(layer: Layer, groups: int, ffn: bool) -> HeadPlan:
    key = (id(layer), groups, bool(ffn))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is layer:
        return hit[1]
    hp = head_plan(layer, groups, ffn)
    _CACHE[key] = (layer, hp)
    return hp


def groups_check(dec, layer: Layer, ctx: CostContext, what: str) -> str | None:
    """The checks a (data, groups, replicas) kind ends with: the three cover the world, every
    op runs on blocks of samples, and every sample block holds a sample."""
    if dec.data * dec.groups * dec.replicas != ctx.world:
        return (f"{dec.data} data x {dec.groups} {what} x {dec.replicas} replicas is not "
                f"world size {ctx.world}")
    why = batch_dim_ok(layer)
    if why:
        return why
    if layer.out_shape[0] < dec.data:
        return f"batch {layer.out_shape[0]} < {dec.data} sample blocks"
    return None


def data_degree(world: int, groups: int, batch: int) -> tuple[int, int]:
    """(data, replicas) for ``groups`` branch groups: data = world / groups unless the batch is
    smaller, then the largest divisor the batch allows and the rest replicas."""
    d = world // groups
    if d > batch:
        d = max((q for q in divisors(world // groups) if q <= batch), default=1)
    return d, world // groups // d


@register
@dataclass(frozen=True)
class HeadGroups(Decomposition):
    """Attention heads (and with ``ffn=1`` the feed-forward hidden features) in ``groups``
    branch groups x ``data`` sample blocks x ``replicas`` (module docstring)."""

    data: int = 1
    groups: int = 2
    replicas: int = 1
    ffn: int = 1
    kind = "head_groups"
    supported_ops = REGISTERED

    def _plan(self, layer: Layer) -> HeadPlan:
        return plan_of(layer, self.groups, bool(self.ffn))

    def group_of_rank(self, rank: int) -> int:
        return (rank // self.replicas) % self.groups

    def branch_group(self, rank: int) -> list[int]:
        R, G = self.replicas, self.groups
        d, x = rank // (G * R), rank % R
        return [(d * G + g) * R + x for g in range(G)]

    def owner_group(self, g: int, world: int) -> list[int]:
        return [r for r in range(world) if self.group_of_rank(r) == g]

    # ---- layouts -------------------------------------------------------------------------
    def in_placement(self, layer: Layer, value: str) -> Sharding:
        return _layout(self.data)

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        v = layer.output if value is None else value
        if self._plan(layer).state.get(v) == P:
            return Sharding.of((Shard(0), self.data), (Partial(), self.groups))
        return _layout(self.data)

    def value_layout(self, state) -> Sharding:
        """The layout of a value of ``state`` (the sample split, and the head-group split)."""
        if isinstance(state, int) and state != 0:
            return Sharding.of((Shard(0), self.data), (Shard(state), self.groups))
        return _layout(self.data)

    def layer_param_shard(self, layer: Layer, op: OpSpec, role: str) -> ParamShard:
        dim = self._plan(layer).split_params.get(op.name, {}).get(role)
        if dim is None:
            return ParamShard()
        mesh = Sharding.of((Shard(0), self.data), (Shard(1), self.groups))
        return ParamShard.on(mesh, ((dim, len(mesh.shard_axes) - 1),))

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        R, G = self.replicas, self.groups
        return [[self.branch_group(d * G * R + x) for d in range(self.data) for x in range(R)],
                [self.owner_group(g, world) for g in range(G)]]

    # ---- legality ------------------------------------------------------------------------
    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        if not any(op.kind == "attention" for op in layer.ops) or not layer.out_shape:
            return []
        out = []
        for g in divisors(ctx.world):
            if g < 2:
                continue
            d, r = data_degree(ctx.world, g, layer.out_shape[0])
            for ffn in (1, 0):
                hp = plan_of(layer, g, bool(ffn))
                if hp.problem is None:
                    if ffn == 0 and hp.mode == plan_of(layer, g, True).mode:
                        continue           # nothing outside attention to split: same choice
                    out.append(cls(d, g, r, ffn))
        return out

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        """Legal when the head plan propagates (heads and split features divide by G, every op
        on a split value is one the plan knows), data x groups x replicas is the world and
        every op runs on blocks of samples."""
        why = super().check(layer, ctx)
        if why:
            return why
        why = refuse_batch_norm(layer)
        if why:
            return why
        hp = self._plan(layer)
        if hp.problem:
            return hp.problem
        return groups_check(self, layer, ctx, "head groups")

    # ---- cost ----------------------------------------------------------------------------
    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """Per rank, local shapes of each value's layout (samples / data, split dim / G):

        compute  = sum over ops of op_compute_s(local shapes)            (every group alike)
        fwd comm = sum over ``reduce`` ops of allreduce_s(partial input bytes, branch group);
                   backward the same (its adjoint); the unit's partial output is summed by the
                   transition after it (priced with the edges)
        grad     = whole weights all-reduced over the world + split weights (1/G each) over
                   the data x replicas ranks of the group
        memory   = whole weights + 1/G of the split ones (+ grads, optimizer state), saved
                   activations of the local shapes (SDPA: its family's count)
        """
        from ...cost import primitives as prim
        hp = self._plan(layer)
        item = layer.itemsize
        fwd = bwd = saved = comm = 0.0
        whole_b = split_b = 0.0
        sources = set()
        bgroup = self.branch_group(0)
        for op in layer.ops:
            ins = [self.value_layout(hp.state.get(v)).max_local_shape(s)
                   for v, s in zip(op.inputs, op.in_shapes)]
            out = self.value_layout(hp.state.get(op.name)).max_local_shape(op.out_shape)
            sp = hp.split_params.get(op.name, {})
            w_shape = None
            if "weight" in sp:                      # the local block of a split weight
                w_shape = list(op.params["weight"])
                w_shape[sp["weight"]] //= self.groups
            f, b, src = prim.op_compute_s(op, ins, out, ctx, w_shape=w_shape, itemsize=item)
            sources.add(src)
            fwd += f
            bwd += b
            saved += prim.saved_bytes(op, ins, out, item)
            for role, shape in op.params.items():
                nb = math.prod(shape) * item
                if role in sp:
                    split_b += nb / self.groups
                else:
                    whole_b += nb
            if hp.mode[op.name] == "reduce":
                for v, s in zip(op.inputs, ins):
                    if hp.state.get(v) == P:
                        comm += prim.allreduce_s(ctx, math.prod(s) * item, bgroup)
        owners = self.owner_group(0, ctx.world)
        gsync = (prim.grad_sync_time_s(ctx, whole_b, range(ctx.world))
                 + prim.grad_sync_time_s(ctx, split_b, owners))
        lat = ((prim.grad_sync_latency(ctx, range(ctx.world), "world") if whole_b else ())
               + (prim.grad_sync_latency(ctx, owners) if split_b else ()))
        pbytes = whole_b + split_b
        return LayerCost(fwd_compute_s=fwd, bwd_compute_s=bwd, fwd_comm_s=comm, bwd_comm_s=comm,
                         grad_sync_s=gsync, grad_sync_bytes=pbytes if ctx.world > 1 else 0.0,
                         grad_sync_latency=lat if gsync else (),
                         param_bytes=pbytes, grad_bytes=pbytes,
                         optim_bytes=prim.optimizer_bytes(ctx, pbytes),
                         activation_bytes=saved,
                         source=sources.pop() if len(sources) == 1 else "mixed")


@functools.lru_cache(maxsize=None)
def _layout(data: int) -> Sharding:
    return Sharding.of((Shard(0), data))


@functools.lru_cache(maxsize=8192)
def _local_shape(layout: Sharding, shape: tuple, rank: int, world: int) -> tuple:
    return layout.local_shape(shape, rank, world)

