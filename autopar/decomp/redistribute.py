"""Redistribution of a tensor between two DistSpecs, planned as a list of frozen steps. Pure.

Legend: a *dim* is a tensor dimension; an *axis* is a mesh axis. Ranks inside a step (its
``groups``, a transfer's ``src_rank``/``dst_rank``) are *mesh-local* indices into
``mesh.ranks``, i.e. the ranks a ``Comm`` on that mesh sees; both specs of a plan live on the
same ranks in the same order (their mesh shapes may differ).

Local tensors between steps hold a rank's *valid* data (``DistSpec.bounds_at`` extents); only
``Unpad`` reads, and only ``Pad`` writes, the padded local shape of a ``PaddedShard``. Every
step keeps the specs before and after it (``src``, ``dst``), so it is self-contained: its
extents, bytes and adjoint follow from them.

Steps (forward; their adjoint in the runtime, under autopar's gradient convention)::

    AllReduce(groups)           y_m = sum_{k in g} x_k             adjoint: all-reduce
    ReduceScatter(groups, dim)  y_m = sum_{k in g} x_k[box_m]      adjoint: all-gather
    AllGather(groups, dim)      y_m = concat_{k in g} x_k (on dim) adjoint: reduce-scatter
    AllToAll(transfers)         y_q[box] += x_s[box] per transfer  adjoint: reverse exchange
    Slice(dims)                 y_m = x_m[box_m]  (local copy)      adjoint: zero-fill and place
    ToPartial(groups)           y = x on each group's first rank, 0 elsewhere (self-adjoint)
    Pad(dim, padded) / Unpad(dim, valid): zero-extend / narrow to the valid extent (each the
                                other's adjoint)

``plan_redistribution(src, dst)``:

* identical specs: no step;
* same mesh (DTensor-like, axis by axis): unpad; Partial -> Shard(d) reduce-scatter (when the
  blocks nest, else all-reduce), Partial -> Replicate all-reduce; Shard -> Replicate all-gather
  (innermost axis first), Shard(a) -> Shard(b) all-to-all; Replicate -> Shard local slice
  (outermost first); Replicate -> Partial keeps the value on coordinate 0; pad;
* different mesh shapes (e.g. the CNN layouts N4 and N2xH2): resolve Partial first (a
  reduce-scatter onto a dim the destination splits when that moves fewer bytes in all, else an
  all-reduce), unpad, one general all-to-all by box overlap (a local slice when every rank
  already holds what it needs), then Partial (ToPartial) and pad.
* different meshes (other ranks, or the same ranks in another order: a stage to the next, a
  sub-mesh to the world and back; ``_plan_across_meshes``)::

      1. Unpad, then resolve Partial *on the source mesh*, as above (all-reduce, or a
         reduce-scatter onto a dim the destination splits when that moves fewer bytes in all);
      2. MeshSend: for each destination rank q (in ``dst.mesh`` order) and each distinct source
         piece P (ranks equal off the Replicate axes hold one piece; the holders H(P)) whose
         box meets q's block B_q, one transfer of the box  P ∩ B_q  from a sender s in H(P):
             s = q                                   if q holds P itself (a local copy);
             s = argmin_{h in H(P)} (sent_h, (pos(h) - j) mod |H(P)|)   otherwise,
         sent_h the bytes h was given so far (greedy, spreads the load over the replicas;
         ties rotate with q's position j, as ``box_transfers``). Every rank computes the same
         list. The pieces of a partial-free spec tile the tensor, so the boxes tile each B_q;
      3. on the destination mesh: ToPartial (the value on coordinate 0 of each partial group)
         and Pad.
  Steps 1 run on the source mesh's ranks, 3 on the destination's (their groups are local to
  that step's mesh); MeshSend's transfers name *global* ranks (``Mesh.ranks``). Its price is
  that of the busiest rank: n = max over ranks of max(bytes sent, bytes received) to/from
  other ranks, k = max messages (distinct peers) of one rank, one p2p of n bytes plus k-1
  message latencies (``autopar.cost.redistribute``); its adjoint sends the gradients back.
  A reduce-scatter on the source mesh is planned only when each group's global ranks increase
  in coordinate order (the run-time process groups order members by rank), else an all-reduce.

``simulate`` runs a plan on per-rank numpy or torch tensors (brute force, for tests).
The Sharding-level ``transfer_plan``/``transfer_bytes`` (world ranks) price transitions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from .distspec import SPLITS, DistSpec, Partial, Replicate, _index, _zeros
from .sharding import Sharding, overlap

Groups = tuple[tuple[int, ...], ...]


# ---- Sharding-level transfers (world ranks; pricing of transitions) --------------------------
@dataclass(frozen=True)
class Transfer:
    src_rank: int
    dst_rank: int
    box: tuple[tuple[int, int], ...]   # global (start, extent) per dim


def _sender(src: Sharding, block: int, dst_rank: int, world: int) -> int:
    """The rank that sends source ``block`` to ``dst_rank``: itself if it holds the block, else
    the replica chosen by ``dst_rank % replicas`` (spreads the load over replicas)."""
    r = src.replicas(world)
    if src.block_index(dst_rank, world) == block:
        return dst_rank
    return block * r + dst_rank % r


def transfer_plan(src: Sharding, dst: Sharding, shape: Sequence[int], world: int) -> list[Transfer]:
    """Every (sender, receiver, box) needed to move a tensor of global ``shape`` from ``src`` to
    ``dst`` (partial-free layouts). Pure arithmetic: every rank computes the same list."""
    if src.is_partial or dst.is_partial:
        raise ValueError(f"transfer_plan moves values, not addends: {src} -> {dst} "
                         f"(use plan_redistribution)")
    out: list[Transfer] = []
    for q in range(world):
        qbox = dst.local_bounds(shape, q, world)
        for b in range(src.num_blocks):
            bbox = src.block_bounds(shape, b, world)
            ov = overlap(qbox, bbox)
            if ov is None:
                continue
            out.append(Transfer(_sender(src, b, q, world), q, ov))
    return out


def _traffic(transfers: Sequence[Transfer], n: int, itemsize: int) -> tuple[float, float]:
    sent = [0.0] * n
    recv = [0.0] * n
    for t in transfers:
        if t.src_rank != t.dst_rank:
            b = math.prod(e for _, e in t.box) * itemsize
            sent[t.src_rank] += b
            recv[t.dst_rank] += b
    return max(sent, default=0.0), max(recv, default=0.0)


def transfer_bytes(src: Sharding, dst: Sharding, shape: Sequence[int], world: int,
                   itemsize: int) -> tuple[float, float]:
    """(max bytes any rank sends to others, max bytes any rank receives) for a redistribution."""
    return _traffic(transfer_plan(src, dst, shape, world), world, itemsize)


# ---- steps --------------------------------------------------------------------------------
def _numel(spec: DistSpec, i: int) -> int:
    return math.prod(e for _, e in spec.bounds_at(i))


def valid_shape(spec: DistSpec, i: int) -> tuple[int, ...]:
    """The local shape between steps: valid extents (no padding)."""
    return tuple(e for _, e in spec.bounds_at(i))


@dataclass(frozen=True)
class _Step:
    """Shared by every step: ``src``/``dst`` specs (before/after), ``kind`` for the profile
    (None: local, costs nothing)."""

    kind = None

    @property
    def p(self) -> int:
        groups = getattr(self, "groups", ())
        return max((len(g) for g in groups), default=1)

    def payload_bytes(self, itemsize: int) -> float:
        """The per-rank buffer the profile prices (``Profile.collective_time_s``)."""
        return 0.0

    def traffic_bytes(self, itemsize: int) -> tuple[float, float]:
        """(bytes the busiest rank sends, bytes the busiest rank receives)."""
        return 0.0, 0.0

    def to_json(self) -> dict:
        out = {"step": type(self).__name__}
        for k, v in self.__dict__.items():
            if isinstance(v, DistSpec):
                out[k] = v.to_json()
            elif k == "transfers":
                out[k] = [[t.src_rank, t.dst_rank, [list(b) for b in t.box]] for t in v]
            else:
                out[k] = _listify(v)
        return out


def _listify(v):
    return [_listify(x) for x in v] if isinstance(v, tuple) else v


@dataclass(frozen=True)
class AllReduce(_Step):
    """Partial -> Replicate along one axis: y = sum over the group."""

    groups: Groups
    src: DistSpec = field(repr=False)
    dst: DistSpec = field(repr=False)
    kind = "allreduce"

    def payload_bytes(self, itemsize: int) -> float:
        return float(max(_numel(self.src, i) for g in self.groups for i in g) * itemsize)

    def traffic_bytes(self, itemsize: int) -> tuple[float, float]:
        """Ring: 2 (p-1)/p of the buffer each way."""
        v = 2.0 * (self.p - 1) / self.p * self.payload_bytes(itemsize)
        return v, v


@dataclass(frozen=True)
class ReduceScatter(_Step):
    """Partial -> Shard(dim) along one axis: member i keeps the sum of block i of ``dim``."""

    groups: Groups
    dim: int
    src: DistSpec = field(repr=False)
    dst: DistSpec = field(repr=False)
    kind = "reduce_scatter"

    def payload_bytes(self, itemsize: int) -> float:
        """The whole input, blocks zero-padded to the largest (gloo scatters equal chunks)."""
        return float(max(len(g) * max(_numel(self.dst, i) for i in g) for g in self.groups) * itemsize)

    def traffic_bytes(self, itemsize: int) -> tuple[float, float]:
        v = (self.p - 1) / self.p * self.payload_bytes(itemsize)
        return v, v


@dataclass(frozen=True)
class AllGather(_Step):
    """Shard(dim) -> Replicate along one axis: every member gets the blocks concatenated."""

    groups: Groups
    dim: int
    src: DistSpec = field(repr=False)
    dst: DistSpec = field(repr=False)
    kind = "allgather"

    def payload_bytes(self, itemsize: int) -> float:
        """The whole gathered output, blocks zero-padded to the largest."""
        return float(max(len(g) * max(_numel(self.src, i) for i in g) for g in self.groups) * itemsize)

    def traffic_bytes(self, itemsize: int) -> tuple[float, float]:
        v = (self.p - 1) / self.p * self.payload_bytes(itemsize)
        return v, v


@dataclass(frozen=True)
class AllToAll(_Step):
    """General exchange by box overlap (local pieces copied); ``groups`` bound the ranks that
    exchange (for pricing), the whole mesh when the exchange is not confined to one axis."""

    transfers: tuple[Transfer, ...]
    groups: Groups
    src: DistSpec = field(repr=False)
    dst: DistSpec = field(repr=False)
    kind = "all_to_all"

    def traffic_bytes(self, itemsize: int) -> tuple[float, float]:
        return _traffic(self.transfers, self.src.mesh.size, itemsize)

    def payload_bytes(self, itemsize: int) -> float:
        """The profile's all_to_all takes all a rank sends, its own block included:
        max(sent, recv) * p/(p-1)."""
        p = self.p
        if p <= 1:
            return 0.0
        return max(self.traffic_bytes(itemsize)) * p / (p - 1)


@dataclass(frozen=True)
class Slice(_Step):
    """Local copy: every rank already holds its new block (e.g. Replicate -> Shard); with no
    ``dims`` the blocks are unchanged and only the spec is relabelled (e.g. onto another mesh
    shape)."""

    dims: tuple[int, ...]
    src: DistSpec = field(repr=False)
    dst: DistSpec = field(repr=False)


@dataclass(frozen=True)
class ToPartial(_Step):
    """Replicate -> Partial along one axis: the first rank of each group keeps the value, the
    others hold zeros (local)."""

    groups: Groups
    src: DistSpec = field(repr=False)
    dst: DistSpec = field(repr=False)

    @property
    def p(self) -> int:
        return 1


@dataclass(frozen=True)
class Pad(_Step):
    """Zero-extend dim ``dim`` of the valid block to the padded block length (local)."""

    dim: int
    padded: int
    src: DistSpec = field(repr=False)
    dst: DistSpec = field(repr=False)


@dataclass(frozen=True)
class Unpad(_Step):
    """Narrow dim ``dim`` of a padded block to its valid extent (local)."""

    dim: int
    valid: int
    src: DistSpec = field(repr=False)
    dst: DistSpec = field(repr=False)


@dataclass(frozen=True)
class MeshSend(_Step):
    """Point-to-point sends from ``src``'s mesh to ``dst``'s (another mesh). ``transfers`` name
    *global* ranks (``Mesh.ranks``), unlike every other step; a transfer with ``src_rank ==
    dst_rank`` is a local copy. Both specs are partial-free (module docstring)."""

    transfers: tuple[Transfer, ...]
    src: DistSpec = field(repr=False)
    dst: DistSpec = field(repr=False)
    kind = "p2p"

    @property
    def p(self) -> int:
        return 2

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """The distinct (sender, receiver) global rank pairs that exchange a message."""
        return tuple(sorted({(t.src_rank, t.dst_rank) for t in self.transfers
                             if t.src_rank != t.dst_rank}))

    def bytes_by_rank(self, itemsize: int) -> tuple[dict[int, int], dict[int, int]]:
        """({global rank: bytes it sends to others}, {global rank: bytes it receives})."""
        sent: dict[int, int] = {}
        recv: dict[int, int] = {}
        for t in self.transfers:
            if t.src_rank != t.dst_rank:
                b = math.prod(e for _, e in t.box) * itemsize
                sent[t.src_rank] = sent.get(t.src_rank, 0) + b
                recv[t.dst_rank] = recv.get(t.dst_rank, 0) + b
        return sent, recv

    def traffic_bytes(self, itemsize: int) -> tuple[float, float]:
        sent, recv = self.bytes_by_rank(itemsize)
        return float(max(sent.values(), default=0)), float(max(recv.values(), default=0))

    def payload_bytes(self, itemsize: int) -> float:
        """The busiest rank's bytes, max(sent, received): its messages share its link."""
        return max(self.traffic_bytes(itemsize))

    @property
    def messages(self) -> int:
        """Most messages one rank sends or receives (one per peer: a pair's boxes travel as one)."""
        count: dict[tuple[str, int], int] = {}
        for s, d in self.pairs:
            count[("s", s)] = count.get(("s", s), 0) + 1
            count[("r", d)] = count.get(("r", d), 0) + 1
        return max(count.values(), default=0)


Step = AllReduce | ReduceScatter | AllGather | AllToAll | Slice | ToPartial | Pad | Unpad | MeshSend
COLLECTIVES = (AllReduce, ReduceScatter, AllGather, AllToAll, MeshSend)


def step_from_json(obj: dict) -> Step:
    """Inverse of ``Step.to_json`` (plans load without a process group)."""
    cls = {c.__name__: c for c in (AllReduce, ReduceScatter, AllGather, AllToAll, Slice,
                                   ToPartial, Pad, Unpad, MeshSend)}[obj["step"]]
    kw = {}
    for k, v in obj.items():
        if k == "step":
            continue
        if k in ("src", "dst"):
            kw[k] = DistSpec.from_json(v)
        elif k == "transfers":
            kw[k] = tuple(Transfer(int(s), int(d), tuple(tuple(b) for b in box)) for s, d, box in v)
        elif k == "groups":
            kw[k] = tuple(tuple(g) for g in v)
        elif k == "dims":
            kw[k] = tuple(v)
        else:
            kw[k] = v
    return cls(**kw)


def steps_str(steps: Sequence[Step]) -> str:
    """One line per plan, e.g. ``ReduceScatter(dim 0, 2x2) ; AllToAll(4)``."""
    def one(s):
        if isinstance(s, (ReduceScatter, AllGather)):
            return f"{type(s).__name__}(dim {s.dim}, {len(s.groups)}x{s.p})"
        if isinstance(s, (AllReduce, ToPartial)):
            return f"{type(s).__name__}({len(s.groups)}x{len(s.groups[0])})"
        if isinstance(s, AllToAll):
            return f"AllToAll({len(s.groups)}x{s.p})"
        if isinstance(s, MeshSend):
            return f"MeshSend({len(s.pairs)} messages)"
        if isinstance(s, Pad):
            return f"Pad(dim {s.dim} to {s.padded})"
        if isinstance(s, Unpad):
            return f"Unpad(dim {s.dim} to {s.valid})"
        return f"Slice(dims {list(s.dims)})"
    return " ; ".join(one(s) for s in steps) or "(nothing)"


# ---- planning -----------------------------------------------------------------------------
def axis_groups(spec: DistSpec, axis: int) -> Groups:
    """Mesh-local groups varying along ``axis`` only, each in coordinate order."""
    m = spec.mesh
    out = []
    for i in range(m.size):
        cs = m.coords_of_index(i)
        if cs[axis] == 0:
            g = []
            for c in range(m.shape[axis]):
                cc = list(cs)
                cc[axis] = c
                g.append(m.index_at(cc))
            out.append(tuple(g))
    return tuple(out)


def box_transfers(src: DistSpec, dst: DistSpec) -> tuple[Transfer, ...]:
    """Every (sender, receiver, box) moving ``src``'s valid data to ``dst``'s (mesh-local).

    For each receiver q and each distinct source piece (ranks equal off the Replicate axes hold
    one piece) overlapping q's block: q itself sends when it holds the piece, else holder
    ``q % holders`` (spreads the load over replicas). Partial axes must be the same in both
    specs (same mesh): pieces only move between ranks with equal partial coordinates."""
    if src.mesh.ranks != dst.mesh.ranks:
        raise ValueError(f"redistribution between different rank lists: {src.mesh} -> {dst.mesh}")
    partial = src.is_partial or dst.is_partial
    if partial and (src.mesh != dst.mesh or src.partial_axes != dst.partial_axes):
        raise ValueError(f"an all-to-all cannot move partial sums between {src} and {dst}")
    holders: dict[tuple, list[int]] = {}
    for i in range(src.mesh.size):
        holders.setdefault(src.piece_key(i), []).append(i)
    pieces = [(hs, src.bounds_at(hs[0]), src.partial_key(hs[0])) for hs in holders.values()]
    out = []
    # the pieces each receiver's box meets, found with arrays (one test per piece and receiver
    # in Python was 1 M calls of ``overlap`` per transition at 1024 ranks); same boxes, same order
    import numpy as np
    nd = len(src.shape)
    p_lo = np.array([[b[d][0] for d in range(nd)] for _, b, _ in pieces], dtype=np.int64).reshape(len(pieces), nd)
    p_hi = p_lo + np.array([[b[d][1] for d in range(nd)] for _, b, _ in pieces], dtype=np.int64).reshape(len(pieces), nd)
    for q in range(dst.mesh.size):
        qbox = dst.bounds_at(q)
        qk = dst.partial_key(q)
        q_lo = np.array([s_ for s_, _ in qbox], dtype=np.int64)
        q_hi = q_lo + np.array([e_ for _, e_ in qbox], dtype=np.int64)
        lo, hi = np.maximum(p_lo, q_lo), np.minimum(p_hi, q_hi)
        for k in np.flatnonzero(np.all(hi > lo, axis=1)):
            hs, box, pk = pieces[k]
            if partial and pk != qk:
                continue
            ov = tuple((int(a), int(b - a)) for a, b in zip(lo[k], hi[k]))
            out.append(Transfer(q if q in hs else hs[q % len(hs)], q, ov))
    return tuple(out)


def _exchange_step(cur: DistSpec, nxt: DistSpec) -> Step:
    """An all-to-all from ``cur`` to ``nxt``, or a Slice when no piece leaves its rank."""
    ts = box_transfers(cur, nxt)
    if all(t.src_rank == t.dst_rank for t in ts):
        dims = tuple(d for d in range(len(cur.shape))
                     if any(cur.bounds_at(i)[d] != nxt.bounds_at(i)[d] for i in range(cur.mesh.size)))
        return Slice(dims, cur, nxt)
    groups: Groups = (tuple(range(cur.mesh.size)),)
    if cur.mesh == nxt.mesh:        # confined to one axis's groups?
        for a in range(cur.mesh.ndim):
            ag = axis_groups(cur, a)
            where = {i: gi for gi, g in enumerate(ag) for i in g}
            if all(where[t.src_rank] == where[t.dst_rank] for t in ts):
                groups = ag
                break
    return AllToAll(ts, groups, cur, nxt)


def _contiguous(boxes: Sequence[tuple], whole: tuple, dim: int) -> bool:
    """``boxes`` (in group order) tile ``whole`` along ``dim`` and equal it on other dims."""
    pos = whole[dim][0]
    for b in boxes:
        if any(b[d] != whole[d] for d in range(len(whole)) if d != dim) or b[dim][0] != pos:
            return False
        pos += b[dim][1]
    return pos == whole[dim][0] + whole[dim][1]


def _scatter_ok(whole: DistSpec, parts: DistSpec, groups: Groups, dim: int) -> bool:
    """Each group's ``parts`` blocks tile its common ``whole`` block along ``dim``."""
    for g in groups:
        w = whole.bounds_at(g[0])
        if any(whole.bounds_at(i) != w for i in g):
            return False
        if not _contiguous([parts.bounds_at(i) for i in g], w, dim):
            return False
    return True


def _slice_ok(cur: DistSpec, nxt: DistSpec) -> bool:
    for i in range(cur.mesh.size):
        if overlap(cur.bounds_at(i), nxt.bounds_at(i)) != nxt.bounds_at(i) and _numel(nxt, i):
            return False
    return True


def _unpad_steps(spec: DistSpec) -> list[Step]:
    return [Unpad(spec.placements[a].dim, spec.shape[spec.placements[a].dim], spec, spec)
            for a in spec.padded_axes]


def _pad_steps(spec: DistSpec) -> list[Step]:
    return [Pad(spec.placements[a].dim, spec.placements[a].padded, spec, spec)
            for a in spec.padded_axes]


def plan_redistribution(src: DistSpec, dst: DistSpec) -> tuple[Step, ...]:
    """The steps that move a tensor from ``src`` to ``dst`` (module docstring): their owned
    blocks (``DistSpec.owned``; the halo of a ``HaloShard`` is its consumer's own exchange)."""
    src, dst = src.owned(), dst.owned()
    if src.shape != dst.shape:
        raise ValueError(f"redistribution changes the shape: {src.shape} -> {dst.shape}")
    if src == dst:
        return ()
    if src.mesh.ranks != dst.mesh.ranks:
        return tuple(_plan_across_meshes(src, dst))
    if src.mesh == dst.mesh:
        try:
            return tuple(_plan_same_mesh(src, dst))
        except ValueError:   # an axis-by-axis intermediate is no DistSpec (a padded dim split twice)
            pass
    return tuple(_plan_general(src, dst))


def _plan_same_mesh(src: DistSpec, dst: DistSpec) -> list[Step]:
    steps: list[Step] = _unpad_steps(src)
    cur = src
    nd = src.mesh.ndim
    # 1. Partial -> Shard(d): reduce-scatter if the blocks nest, else all-reduce
    for a in cur.partial_axes:
        t = dst.placements[a]
        if isinstance(t, Partial):
            continue
        groups = axis_groups(cur, a)
        if isinstance(t, SPLITS):
            nxt = cur.with_placement(a, t)
            if _scatter_ok(cur, nxt, groups, t.dim):
                steps.append(ReduceScatter(groups, t.dim, cur, nxt))
                cur = nxt
                continue
        nxt = cur.with_placement(a, Replicate())
        steps.append(AllReduce(groups, cur, nxt))
        cur = nxt
    # 2. Shard -> other: all-gather (innermost first), or all-to-all between splits
    for a in reversed(range(nd)):
        p, t = cur.placements[a], dst.placements[a]
        if not isinstance(p, SPLITS) or p == t:
            continue
        if isinstance(t, SPLITS):
            nxt = cur.with_placement(a, t)
            steps.append(_exchange_step(cur, nxt))
        else:
            nxt = cur.with_placement(a, Replicate())
            groups = axis_groups(cur, a)
            if _scatter_ok(nxt, cur, groups, p.dim):
                steps.append(AllGather(groups, p.dim, cur, nxt))
            else:
                steps.append(_exchange_step(cur, nxt))
        cur = nxt
    # 3. Replicate -> Shard: local slice (outermost first)
    for a in range(nd):
        if isinstance(cur.placements[a], Replicate) and isinstance(dst.placements[a], SPLITS):
            nxt = cur.with_placement(a, dst.placements[a])
            steps.append(Slice((dst.placements[a].dim,), cur, nxt) if _slice_ok(cur, nxt)
                         else _exchange_step(cur, nxt))
            cur = nxt
    # 4. Replicate -> Partial
    for a in range(nd):
        if isinstance(cur.placements[a], Replicate) and isinstance(dst.placements[a], Partial):
            nxt = cur.with_placement(a, dst.placements[a])
            steps.append(ToPartial(axis_groups(cur, a), cur, nxt))
            cur = nxt
    assert cur == dst, (cur, dst)
    return steps + _pad_steps(dst)


def _traffic_of(steps: Sequence[Step]) -> float:
    return sum(max(s.traffic_bytes(1)) for s in steps)


def _valued(spec: DistSpec) -> DistSpec:
    """``spec`` with values, not addends: every Partial axis Replicate."""
    for a in spec.partial_axes:
        spec = spec.with_placement(a, Replicate())
    return spec


def _resolve_partial(src: DistSpec, dst: DistSpec, target: DistSpec, exchange,
                     ordered: bool = False) -> list[Step]:
    """Resolve ``src``'s Partial axes one by one on its mesh: an all-reduce, or a reduce-scatter
    onto a dim ``dst`` splits when that moves fewer bytes in all, counting the ``exchange(spec,
    target)`` step that follows once no axis is partial. ``ordered``: a reduce-scatter only where
    each group's global ranks increase in coordinate order (module docstring)."""
    steps: list[Step] = []
    cur = src
    for a in src.partial_axes:
        groups = axis_groups(cur, a)
        rep = cur.with_placement(a, Replicate())
        best = [AllReduce(groups, cur, rep)]
        best_cost = _traffic_of(best) + (_traffic_of([exchange(rep, target)])
                                         if not rep.is_partial else 0.0)
        if ordered and not all(_increasing(cur.mesh, g) for g in groups):
            candidates = []
        else:
            candidates = dict.fromkeys(p for p in dst.placements if isinstance(p, SPLITS))
        for t in candidates:
            try:
                sh = cur.with_placement(a, t)
            except ValueError:      # e.g. a padded extent this axis does not divide
                continue
            if not _scatter_ok(cur, sh, groups, t.dim):
                continue
            cand = [ReduceScatter(groups, t.dim, cur, sh)]
            cost = _traffic_of(cand) + (_traffic_of([exchange(sh, target)])
                                        if not sh.is_partial else 0.0)
            if cost < best_cost:
                best, best_cost = cand, cost
        steps += best
        cur = best[-1].dst
    return steps


def _increasing(mesh, group: Sequence[int]) -> bool:
    ranks = [mesh.ranks[i] for i in group]
    return ranks == sorted(ranks)


def _to_partial_steps(cur: DistSpec, dst: DistSpec) -> list[Step]:
    """Addends where ``dst`` wants them (``cur`` is ``_valued(dst)``)."""
    steps: list[Step] = []
    for a in dst.partial_axes:
        nxt = cur.with_placement(a, Partial())
        steps.append(ToPartial(axis_groups(cur, a), cur, nxt))
        cur = nxt
    return steps


def _plan_general(src: DistSpec, dst: DistSpec) -> list[Step]:
    steps: list[Step] = _unpad_steps(src)
    # the destination with values, not addends: Partial -> Replicate (added back at the end)
    target = _valued(dst)
    # 1. resolve Partial: reduce-scatter onto a dim dst splits when that moves fewer bytes
    resolve = _resolve_partial(src, dst, target, _exchange_step)
    steps += resolve
    cur = resolve[-1].dst if resolve else src
    # 2. one exchange by box overlap
    if cur != target:
        steps.append(_exchange_step(cur, target))
    # 3. addends where dst wants them, then padding
    return steps + _to_partial_steps(target, dst) + _pad_steps(dst)


# ---- between different meshes --------------------------------------------------------------
def mesh_transfers(src: DistSpec, dst: DistSpec) -> tuple[Transfer, ...]:
    """The transfers of a ``MeshSend`` from partial-free ``src`` to partial-free ``dst`` on
    another mesh, in *global* ranks (module docstring, step 2: local copy when the receiver
    holds the piece, else the least-loaded holder)."""
    if src.is_partial or dst.is_partial:
        raise ValueError(f"a MeshSend moves values, not addends: {src} -> {dst}")
    holders: dict[tuple, list[int]] = {}
    for i in range(src.mesh.size):
        holders.setdefault(src.piece_key(i), []).append(i)
    pieces = [(tuple(src.mesh.ranks[i] for i in hs), src.bounds_at(hs[0])) for hs in holders.values()]
    import numpy as np          # as box_transfers: one array test per receiver, not per piece
    nd = len(src.shape)
    p_lo = np.array([[b[d][0] for d in range(nd)] for _, b in pieces], dtype=np.int64).reshape(len(pieces), nd)
    p_hi = p_lo + np.array([[b[d][1] for d in range(nd)] for _, b in pieces], dtype=np.int64).reshape(len(pieces), nd)
    sent: dict[int, int] = {}
    out = []
    for j, q in enumerate(dst.mesh.ranks):
        qbox = dst.bounds_at(j)
        q_lo = np.array([s_ for s_, _ in qbox], dtype=np.int64)
        q_hi = q_lo + np.array([e_ for _, e_ in qbox], dtype=np.int64)
        lo, hi = np.maximum(p_lo, q_lo), np.minimum(p_hi, q_hi)
        for k in np.flatnonzero(np.all(hi > lo, axis=1)):
            hs = pieces[k][0]
            box = tuple((int(a), int(b - a)) for a, b in zip(lo[k], hi[k]))
            if q in hs:
                s = q
            else:
                s = min(hs, key=lambda h: (sent.get(h, 0), (hs.index(h) - j) % len(hs)))
                sent[s] = sent.get(s, 0) + math.prod(e for _, e in box)
            out.append(Transfer(s, q, box))
    return tuple(out)


def _send_step(cur: DistSpec, nxt: DistSpec) -> MeshSend:
    return MeshSend(mesh_transfers(cur, nxt), cur, nxt)


def _plan_across_meshes(src: DistSpec, dst: DistSpec) -> list[Step]:
    """Module docstring: resolve Partial on the source mesh, MeshSend, Partial and padding on
    the destination mesh."""
    steps: list[Step] = _unpad_steps(src)
    target = _valued(dst)
    resolve = _resolve_partial(src, dst, target, _send_step, ordered=True)
    steps += resolve
    cur = resolve[-1].dst if resolve else src
    steps.append(_send_step(cur, target))
    return steps + _to_partial_steps(target, dst) + _pad_steps(dst)


# ---- brute-force execution ----------------------------------------------------------------
def simulate(steps: Sequence[Step], src: DistSpec, dst: DistSpec,
             locals_: dict[int, Any]) -> dict[int, Any]:
    """Run ``steps`` on ``{global rank: local}`` (numpy or torch); returns ``dst``'s locals.
    A step other than ``MeshSend`` runs on the ranks of its own mesh (``step.src.mesh``)."""
    cur = {r: locals_[r] for r in src.mesh.ranks}
    for st in steps:
        if isinstance(st, MeshSend):
            cur = _simulate_send(st, cur)
            continue
        ranks = st.src.mesh.ranks
        y = _simulate_step(st, {i: cur[r] for i, r in enumerate(ranks)})
        cur = {ranks[i]: v for i, v in y.items()}
    return {r: cur[r] for r in dst.mesh.ranks}


def _simulate_send(st: MeshSend, x: dict[int, Any]) -> dict[int, Any]:
    """``{global rank: local}`` on the source mesh -> the destination mesh's."""
    s, d = st.src, st.dst
    like = next(iter(x.values()))
    y = {q: _zeros(like, valid_shape(d, j)) for j, q in enumerate(d.mesh.ranks)}
    for t in st.transfers:
        y[t.dst_rank][_index(t.box, d.local_bounds(t.dst_rank))] += \
            x[t.src_rank][_index(t.box, s.local_bounds(t.src_rank))]
    return y


def _simulate_step(st: Step, x: dict[int, Any]) -> dict[int, Any]:
    s, d = st.src, st.dst
    y: dict[int, Any] = {}
    if isinstance(st, Unpad):
        for i, v in x.items():
            y[i] = v[tuple(slice(0, e) for e in valid_shape(s, i))]
    elif isinstance(st, Pad):
        for i, v in x.items():
            y[i] = _zeros(v, d.shape_at(i))
            y[i][tuple(slice(0, e) for e in v.shape)] = v
    elif isinstance(st, AllReduce):
        for g in st.groups:
            tot = x[g[0]]
            for k in g[1:]:
                tot = tot + x[k]
            for m in g:
                y[m] = tot + 0
    elif isinstance(st, ReduceScatter):
        for g in st.groups:
            for m in g:
                idx = _index(d.bounds_at(m), s.bounds_at(m))
                acc = x[g[0]][idx]
                for k in g[1:]:
                    acc = acc + x[k][idx]
                y[m] = acc + 0
    elif isinstance(st, AllGather):
        for g in st.groups:
            for m in g:
                y[m] = _zeros(x[m], valid_shape(d, m))
                for k in g:
                    y[m][_index(s.bounds_at(k), d.bounds_at(m))] = x[k]
    elif isinstance(st, AllToAll):
        for i in x:
            y[i] = _zeros(x[i], valid_shape(d, i))
        for t in st.transfers:
            y[t.dst_rank][_index(t.box, d.bounds_at(t.dst_rank))] += \
                x[t.src_rank][_index(t.box, s.bounds_at(t.src_rank))]
    elif isinstance(st, Slice):
        for i, v in x.items():
            y[i] = v[_index(d.bounds_at(i), s.bounds_at(i))] + 0
    elif isinstance(st, ToPartial):
        for g in st.groups:
            y[g[0]] = x[g[0]] + 0
            for m in g[1:]:
                y[m] = x[m] * 0
    else:
        raise TypeError(f"unknown step {st!r}")
    return y
