"""SUPER sub-graph (branch) parallelism combined with data parallelism:
``Branch(data, groups, replicas)`` (and ``HeadGroups``, heads in groups: ``branch.heads``).

Jain et al., SUPER (IPDPS 2021): a unit's independent branches (the attention and MLP of a
parallel GPT block, the towers of a multi-tower model; ``branch.graph`` finds them in the
traced unit) run on disjoint groups of processes; every group is replicated ``data`` times over
blocks of samples. With world P = data x groups x R (R >= 1 plain replicas, when the batch
is smaller than P / groups), logical rank ``r = (d * groups + g) * R + x`` (``Sharding(((0,
data),))`` with groups x R replicas; the branch axis inside the sample axis) holds samples
block d and computes the branches of group g (branch c belongs to group ``c * groups // k``).
Under block placement the ``groups`` ranks of one sample block are neighbours, so the
branch-boundary collectives stay inside a node and only the gradient all-reduces cross nodes:
SUPER's interleaved placement (``autopar.decomp.rankmap``).

Grid translation at the unit's boundaries (LBANN's layers; the runtime ops with their exact
adjoints are ``branch.boundary``):

* split (fork): the unit's input enters replicated over the branch axis (``in_placement`` N<data>),
  so every group already holds the parent's value: the broadcast is the transition into the
  unit (an all-gather from a sample-parallel producer), and its adjoint, the all-reduce of the
  branches' input gradients, is the transition's adjoint (autopar's gradient convention sums
  the replicas' shares);
* sum (join): a branch value is held by its group and is zero elsewhere, i.e. a partial sum over
  the branch axis. A unit output that is partial leaves with layout N<data> x P<groups>; the
  transition after the unit all-reduces (or reduce-scatters) it, backward its adjoint. Inside
  the unit an op that is not linear in a partial input first all-reduces it (``branch_sum``);
* slice/concat: a concatenation of every branch's output (and elementwise ops after it) stays
  split along the concatenated dim, each group holding its branches' slices; the transition
  after the unit all-gathers it (LBANN's slice / gather). Other concatenations are partial
  sums (each group its slices, zeros elsewhere), resolved like a sum.

Weights of branch c live only on its group's ranks (``BranchParamShard``: the other ranks hold
an empty tensor) and their gradients are summed over the data x replicas ranks of the group; weights
of shared ops (the layer norm before the fork) are whole everywhere, summed over the world.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..base import CostContext, Decomposition, LayerCost, ParamShard, divisors, register
from ..ir import REGISTERED, Layer, OpSpec
from ..sharding import Sharding, Partial, Shard
from .graph import PARTIAL, SHARED, SPLIT, BranchAnalysis, analysis, refuse_batch_norm
from .heads import HeadGroups, data_degree, groups_check, head_plan  # noqa: F401  (registration)

__all__ = ["Branch", "BranchParamShard", "HeadGroups", "analysis", "head_plan", "SHARED", "PARTIAL",
           "SPLIT"]


@dataclass(frozen=True)
class BranchParamShard(ParamShard):
    """A whole parameter held only by the ranks of branch group ``owner`` (of ``groups``; rank
    r's group is ``(r // replicas) % groups``); the other ranks hold an empty block (extent 0
    on dim 0) and sync nothing. Gradients are summed over the owner group's ranks. ``dims`` is
    ``((0, 0),)`` so that code asking ``shard.dims`` assembles the whole parameter from the
    ranks' blocks (the owners') instead of taking any rank's copy. (Not a placement: no mesh
    axis splits the parameter; the branch groups own whole parameters.)"""

    owner: int = 0
    groups: int = 1
    replicas: int = 1

    @property
    def dims(self) -> tuple[tuple[int, int], ...]:
        return ((0, 0),)

    def _mine(self, rank: int) -> bool:
        return (rank // self.replicas) % self.groups == self.owner

    def shard_coords(self, rank: int, world: int) -> tuple[int, ...]:
        return ((rank // self.replicas) % self.groups,)

    def local_bounds(self, shape, rank: int, world: int) -> tuple[tuple[int, int], ...]:
        bounds = [(0, int(n)) for n in shape]
        if not self._mine(rank) and bounds:
            bounds[0] = (0, 0)
        return tuple(bounds)

    def grad_group(self, rank: int, world: int) -> list[int]:
        if not self._mine(rank):
            return [rank]
        return [q for q in range(world) if self._mine(q)]


@register
@dataclass(frozen=True)
class Branch(Decomposition):
    """``groups`` branch groups x ``data`` sample blocks x ``replicas`` (module docstring)."""

    data: int = 1
    groups: int = 2
    replicas: int = 1
    kind = "branch"
    supported_ops = REGISTERED

    # ---- layouts -------------------------------------------------------------------------
    def _layout(self) -> Sharding:
        return _layout(self.data)

    def in_placement(self, layer: Layer, value: str) -> Sharding:
        return self._layout()

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        v = layer.output if value is None else value
        an = analysis(layer)
        if an.state.get(v) == PARTIAL:     # rank = (d * groups + k) * R + x
            return Sharding.of((Shard(0), self.data), (Partial(), self.groups))
        if an.state.get(v) == SPLIT:
            return self.split_layout(an.split_dim[v])
        return self._layout()

    def split_layout(self, dim: int) -> Sharding:
        """Samples over ``data``, ``dim`` over the branch groups (rank = (d * G + g) * R + x)."""
        return Sharding.of((Shard(0), self.data), (Shard(dim), self.groups))

    def _value_layout(self, an: BranchAnalysis, v: str) -> Sharding:
        return self.split_layout(an.split_dim[v]) if an.state.get(v) == SPLIT else self._layout()

    def group_of_branch(self, layer: Layer, c: int) -> int:
        return c * self.groups // analysis(layer).count

    def layer_param_shard(self, layer: Layer, op: OpSpec, role: str) -> ParamShard:
        """A branch op's weights: ``BranchParamShard`` of its group; shared ops': whole."""
        an = analysis(layer)
        if an.role.get(op.name) != "branch":
            return ParamShard()
        return BranchParamShard(owner=self.group_of_branch(layer, an.branch_of[op.name]),
                                groups=self.groups, replicas=self.replicas)

    def group_of_rank(self, rank: int) -> int:
        return (rank // self.replicas) % self.groups

    def branch_group(self, rank: int) -> list[int]:
        """The ranks holding the same samples (and replica index), one per branch group (the
        sum's all-reduce)."""
        R, G = self.replicas, self.groups
        d, x = rank // (G * R), rank % R
        return [(d * G + g) * R + x for g in range(G)]

    def owner_group(self, g: int, world: int) -> list[int]:
        """The data x replicas ranks of branch group g (its weights' gradient all-reduce)."""
        return [r for r in range(world) if self.group_of_rank(r) == g]

    def partitions(self, layer: Layer, world: int) -> list[list[list[int]]]:
        R, G = self.replicas, self.groups
        return [[self.branch_group(d * G * R + x) for d in range(self.data) for x in range(R)],
                [self.owner_group(g, world) for g in range(G)]]

    # ---- legality ------------------------------------------------------------------------
    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        an = analysis(layer)
        if an.count < 2:
            return []
        n = layer.out_shape[0] if layer.out_shape else 0
        out = []
        for b in divisors(an.count):
            if b < 2 or ctx.world % b:
                continue
            d, r = data_degree(ctx.world, b, n)   # fewer samples than data ranks: replicas
            out.append(cls(d, b, r))
        return out

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        """Legal when the unit has k >= 2 branches, ``groups`` divides k, data x groups is the
        world, every op runs on blocks of samples and every sample block is non-empty."""
        why = super().check(layer, ctx)
        if why:
            return why
        why = refuse_batch_norm(layer)
        if why:
            return why
        an = analysis(layer)
        if an.problem:
            return an.problem
        if an.count % self.groups:
            return f"{self.groups} branch groups do not divide the unit's {an.count} branches"
        return groups_check(self, layer, ctx, "branch groups")

    # ---- cost ----------------------------------------------------------------------------
    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """Per rank (the slowest group), with local shapes of the sample layout N<data>:

        compute  = sum over shared and join ops of op_compute_s
                   + max over groups g of sum over ops of g's branches of op_compute_s
        fwd comm = sum over ``reduce`` joins of allreduce_s(partial input bytes, branch group)
                   (the sum's all-reduce; its adjoint in backward costs the same -> bwd comm);
                   the unit's partial outputs are resolved by the transition after it (priced
                   with the edges)
        grad     = allreduce over the world of the shared ops' weights, plus the largest
                   group's branch weights all-reduced over its ``data`` ranks
        memory   = shared weights + the largest group's weights (+ grads, optimizer state),
                   saved activations of shared/join ops + the largest group's; attention is
                   priced by its family (fused SDPA: q, k, v and output saved, no scores)
        """
        from ...cost import primitives as prim
        an = analysis(layer)
        item = layer.itemsize
        common_f = common_b = common_saved = 0.0
        grp_f = [0.0] * self.groups
        grp_b = [0.0] * self.groups
        grp_saved = [0.0] * self.groups
        grp_pbytes = [0.0] * self.groups
        shared_pbytes = 0.0
        comm_s = 0.0
        sources = set()
        bgroup = self.branch_group(0)
        for op in layer.ops:
            ins = [self._value_layout(an, v).max_local_shape(s) for v, s in zip(op.inputs, op.in_shapes)]
            out = self._value_layout(an, op.name).max_local_shape(op.out_shape)
            f, b, src = prim.op_compute_s(op, ins, out, ctx, itemsize=item)
            sources.add(src)
            saved = prim.saved_bytes(op, ins, out, item)
            pbytes = float(op.param_numel * item)
            if an.role[op.name] == "branch":
                g = self.group_of_branch(layer, an.branch_of[op.name])
                grp_f[g] += f
                grp_b[g] += b
                grp_saved[g] += saved
                grp_pbytes[g] += pbytes
                continue
            common_f += f
            common_b += b
            common_saved += saved
            shared_pbytes += pbytes
            if an.join_mode.get(op.name) == "reduce":
                for v, s in zip(op.inputs, ins):
                    if an.state.get(v) == PARTIAL:
                        comm_s += prim.allreduce_s(ctx, _numel(s) * item, bgroup)
        gmax = max(range(self.groups), key=lambda g: grp_pbytes[g])
        owners = self.owner_group(gmax, ctx.world)
        gsync = (prim.grad_sync_time_s(ctx, shared_pbytes, range(ctx.world))
                 + prim.grad_sync_time_s(ctx, grp_pbytes[gmax], owners))
        lat = ((prim.grad_sync_latency(ctx, range(ctx.world), "world") if shared_pbytes else ())
               + (prim.grad_sync_latency(ctx, owners) if grp_pbytes[gmax] else ()))
        pbytes = shared_pbytes + grp_pbytes[gmax]
        src = sources.pop() if len(sources) == 1 else "mixed"
        return LayerCost(fwd_compute_s=common_f + max(grp_f), bwd_compute_s=common_b + max(grp_b),
                         fwd_comm_s=comm_s, bwd_comm_s=comm_s,
                         grad_sync_s=gsync, grad_sync_bytes=pbytes if ctx.world > 1 else 0.0,
                         grad_sync_latency=lat if gsync else (),
                         param_bytes=pbytes, grad_bytes=pbytes,
                         optim_bytes=prim.optimizer_bytes(ctx, pbytes),
                         activation_bytes=common_saved + max(grp_saved), source=src)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@functools.lru_cache(maxsize=None)
def _layout(data: int) -> Sharding:
    return Sharding.of((Shard(0), data))


@functools.lru_cache(maxsize=8192)
def _local_shape(layout: Sharding, shape: tuple, rank: int, world: int) -> tuple:
    return layout.local_shape(shape, rank, world)

