"""Redistribution between different meshes against brute force (pure, numpy).

Random pairs of meshes drawn from worlds of 4, 6 and 8 ranks (sub-meshes of any size, ranks in
any order, 1 to 3 axes, random axis names) and random placements (Shard, Replicate, Partial,
PaddedShard per axis): scatter a full tensor of integer-valued floats to the source (partial
addends random), run the planned steps with ``simulate``, and require every destination rank
to hold exactly the destination's scatter (padding zeros included). The point-to-point step is
also run here by hand, counting the bytes each rank sends and receives from the arrays it
moves: they equal what its pricing counts, and each receiver gets exactly its block minus what
it held itself. Named cases: a stage to the next (disjoint halves), overlapping meshes, a
sub-mesh to the whole world and back, the same ranks in another order.
"""

import math
import random

import numpy as np
import pytest

from autopar.cost.primitives import blocking_s
from autopar.cost.redistribute import redistribution_s, step_s
from autopar.decomp.base import CostContext
from autopar.decomp.distspec import DistSpec, PaddedShard, Partial, Replicate, Shard, scatter
from autopar.decomp.mesh import Mesh
from autopar.decomp.redistribute import (AllReduce, MeshSend, ReduceScatter, plan_redistribution,
                                         simulate, step_from_json, steps_str, valid_shape)

from fakes import synthetic_profile

SHAPES = [(5, 6), (8, 3), (3, 7, 2)]      # remainders, empty blocks, a third dim


def _factor(n, rng):
    """A random shape of 1 to 3 axes whose product is n."""
    axes = []
    while n > 1 and len(axes) < 2:
        ds = [d for d in range(2, n + 1) if n % d == 0]
        d = rng.choice(ds)
        if d == n and rng.random() < 0.5:
            break
        axes.append(d)
        n //= d
    axes.append(n)
    rng.shuffle(axes)
    return tuple(axes)


def _mesh(world, rng):
    k = rng.choice([s for s in (1, 2, 3, 4, 6, 8) if s <= world])
    ranks = rng.sample(range(world), k)
    if rng.random() < 0.4:
        ranks.sort()
    shape = _factor(k, rng)
    names = rng.sample(["dp", "tp", "pp", "sp"], len(shape))
    return Mesh(tuple(ranks), shape, tuple(names))


def _placement(shape, n_axis, rng):
    kind = rng.choice(["shard", "shard", "replicate", "partial", "padded"])
    d = rng.randrange(len(shape))
    if kind == "shard":
        return Shard(d)
    if kind == "replicate":
        return Replicate()
    if kind == "partial":
        return Partial()
    return PaddedShard(d, n_axis * (-(-shape[d] // n_axis) + rng.randrange(2)))


def _spec(mesh, shape, rng):
    for _ in range(20):
        try:
            return DistSpec(mesh, tuple(_placement(shape, s, rng) for s in mesh.shape), shape)
        except ValueError:      # a padded dim split twice
            continue
    return DistSpec(mesh, (Replicate(),) * mesh.ndim, shape)


def _pieces(rng):
    return lambda sh: rng.integers(-9, 9, sh).astype(float)


def _run_send_by_hand(st, xs, itemsize):
    """Run a MeshSend's transfers on numpy blocks; the bytes each rank sends/receives."""
    s, d = st.src, st.dst
    ys = {q: np.zeros(valid_shape(d, j)) for j, q in enumerate(d.mesh.ranks)}
    hits = {q: np.zeros(valid_shape(d, j), dtype=int) for j, q in enumerate(d.mesh.ranks)}
    sent, recv = {}, {}
    for t in st.transfers:
        sb, db = s.local_bounds(t.src_rank), d.local_bounds(t.dst_rank)
        piece = xs[t.src_rank][tuple(slice(a - o, a - o + e) for (a, e), (o, _) in zip(t.box, sb))]
        into = tuple(slice(a - o, a - o + e) for (a, e), (o, _) in zip(t.box, db))
        ys[t.dst_rank][into] += piece
        hits[t.dst_rank][into] += 1
        if t.src_rank != t.dst_rank:
            sent[t.src_rank] = sent.get(t.src_rank, 0) + piece.size * itemsize
            recv[t.dst_rank] = recv.get(t.dst_rank, 0) + piece.size * itemsize
    return ys, hits, sent, recv


def _check(src, dst, rng, ctx=None):
    full = rng.integers(-9, 9, src.shape).astype(float)
    xs = scatter(full, src, _pieces(rng))
    steps = plan_redistribution(src, dst)
    where = f"{src} on {src.mesh} -> {dst} on {dst.mesh} [{src.shape}]: {steps_str(steps)}"
    ys = simulate(steps, src, dst, xs)
    ref = scatter(full, dst)
    assert set(ys) == set(dst.mesh.ranks), where
    for r in dst.mesh.ranks:
        assert ys[r].shape == dst.local_shape(r), f"{where}: rank {r} shape"
        assert (ys[r] == ref[r]).all(), f"{where}: rank {r} holds another block"
    # step by step: the bytes each priced step counts are the bytes its simulation moves
    cur = xs
    for st in steps:
        if isinstance(st, MeshSend):
            assert src.mesh.ranks != dst.mesh.ranks, where
            assert not st.src.is_partial and not st.dst.is_partial, where
            hand, hits, sent, recv = _run_send_by_hand(st, cur, 8)
            assert st.bytes_by_rank(8) == (sent, recv), where
            assert st.traffic_bytes(8) == (max(sent.values(), default=0), max(recv.values(), default=0))
            assert st.payload_bytes(8) == max(st.traffic_bytes(8))
            for j, q in enumerate(st.dst.mesh.ranks):
                assert (hits[q] == 1).all(), f"{where}: rank {q} receives an element twice or never"
                own = 0           # what q already held of its new block
                if q in st.src.mesh.ranks:
                    a, b = st.src.local_bounds(q), st.dst.local_bounds(q)
                    own = math.prod(max(0, min(x0 + x1, y0 + y1) - max(x0, y0)) for (x0, x1), (y0, y1) in zip(a, b))
                need = math.prod(e for _, e in st.dst.local_bounds(q))
                assert recv.get(q, 0) == (need - own) * 8, f"{where}: rank {q} receives what it held"
            nxt = simulate((st,), st.src, st.dst, cur)
            for q in nxt:
                assert (nxt[q] == hand[q]).all(), where
            assert step_from_json(st.to_json()) == st
        else:
            nxt = simulate((st,), st.src, st.dst, cur)
            if isinstance(st, AllReduce):
                assert st.payload_bytes(8) == max(cur[r].nbytes for r in st.src.mesh.ranks), where
            if isinstance(st, ReduceScatter):
                assert st.payload_bytes(8) == max(len(g) * max(nxt[st.src.mesh.ranks[i]].nbytes for i in g)
                                                  for g in st.groups), where
        cur = nxt
    if ctx is not None:
        fwd, bwd = redistribution_s(steps, ctx, 8)
        assert fwd == bwd and fwd >= 0
        moved = sum(max(st.traffic_bytes(8)) for st in steps)
        assert (fwd > 0) == (moved > 0), where
    return steps


@pytest.mark.parametrize("world", [4, 6, 8])
def test_random_mesh_pairs_against_brute_force(world):
    rng = random.Random(world)
    nrng = np.random.default_rng(world)
    ctx = CostContext(profile=synthetic_profile(ranks_per_node=4), world=world, ranks_per_node=4)
    kinds = set()
    for _ in range(300):
        shape = rng.choice(SHAPES)
        a, b = _mesh(world, rng), _mesh(world, rng)
        src, dst = _spec(a, shape, rng), _spec(b, shape, rng)
        steps = _check(src, dst, nrng, ctx)
        kinds |= {type(s).__name__ for s in steps}
    # the draw reaches every step kind of a cross-mesh plan
    assert {"MeshSend", "AllReduce", "ReduceScatter", "ToPartial", "Pad", "Unpad"} <= kinds, kinds


def _named_pairs():
    world8 = Mesh.world(8)
    pp = world8.reshape((2, 2, 2), ("pp", "dp", "tp"))
    s0, s1 = pp.split("pp")                 # two stages of a 2x2 mesh each, global ranks kept
    w4 = Mesh.world(4)
    half0, half1 = Mesh((0, 1), (2,), ("x",)), Mesh((2, 3), (2,), ("x",))
    shape = (6, 5)
    sp = lambda m, *p: DistSpec(m, p, shape)   # noqa: E731
    return [
        (sp(s0, Shard(0), Shard(1)), sp(s1, Shard(0), Shard(1))),        # a stage to the next
        (sp(s0, Partial(), Shard(1)), sp(s1, Replicate(), Shard(0))),
        (sp(half0, Shard(0)), sp(half1, Shard(1))),
        (sp(half0, Replicate()), sp(half1, Partial())),
        (sp(Mesh((1, 2, 3), (3,), ("x",)), Shard(1)), sp(half0, Shard(0))),  # overlapping
        (sp(half1, Shard(0)), sp(w4, Shard(1))),                         # sub-mesh -> world
        (sp(w4.reshape((2, 2), ("a", "b")), Partial(), Shard(0)), sp(half1, Replicate())),  # and back
        (sp(Mesh((0, 2, 1, 3), (2, 2), ("a", "b")), Shard(0), Shard(1)),   # same ranks, another order
         sp(w4.reshape((2, 2), ("a", "b")), Shard(0), Shard(1))),
        (sp(half0, PaddedShard(0, 8)), sp(Mesh((3, 2), (2,), ("y",)), PaddedShard(1, 6))),
    ]


@pytest.mark.parametrize("k", range(9))
def test_named_mesh_pairs(k):
    src, dst = _named_pairs()[k]
    steps = _check(src, dst, np.random.default_rng(k),
                   CostContext(profile=synthetic_profile(ranks_per_node=4), world=8, ranks_per_node=4))
    assert sum(isinstance(s, MeshSend) for s in steps) == 1


def test_stage_to_stage_plan_is_one_send_per_peer():
    w4 = Mesh.world(4)
    a, b = DistSpec(Mesh((0, 1), (2,), ("x",)), (Shard(0),), (8, 4)), DistSpec(Mesh((2, 3), (2,), ("x",)), (Shard(0),), (8, 4))
    (st,) = plan_redistribution(a, b)
    assert isinstance(st, MeshSend) and st.pairs == ((0, 2), (1, 3))
    assert st.traffic_bytes(8) == (4 * 4 * 8, 4 * 4 * 8) and st.messages == 1
    # a replicated source spreads the load: each of 2 holders sends half of what 4 ranks need
    rep = DistSpec(Mesh((0, 1), (2,), ("x",)), (Replicate(),), (8, 4))
    (st,) = plan_redistribution(rep, DistSpec(Mesh((1, 2, 3, 4), (4,), ("y",)), (Shard(0),), (8, 4)))
    sent, _ = st.bytes_by_rank(8)
    assert sent == {0: 2 * 4 * 8 * 2, 1: 2 * 4 * 8} or sent == {0: 2 * 4 * 8, 1: 2 * 4 * 8 * 2}
    assert (1, 1) not in st.pairs and any(t.src_rank == t.dst_rank == 1 for t in st.transfers)


def test_partial_source_reduces_on_its_mesh_before_sending():
    src = DistSpec(Mesh((0, 1), (2,), ("x",)), (Partial(),), (8, 4))
    dst = DistSpec(Mesh((2, 3), (2,), ("x",)), (Shard(0),), (8, 4))
    steps = plan_redistribution(src, dst)
    # a reduce-scatter onto rows (each source rank then sends its half) beats an all-reduce
    assert [type(s) for s in steps] == [ReduceScatter, MeshSend], steps_str(steps)
    # ranks that decrease along the axis: the run-time group order differs, so an all-reduce
    src2 = DistSpec(Mesh((1, 0), (2,), ("x",)), (Partial(),), (8, 4))
    assert [type(s) for s in plan_redistribution(src2, dst)] == [AllReduce, MeshSend]


def test_mesh_send_price():
    ctx = CostContext(profile=synthetic_profile(ranks_per_node=4), world=8, ranks_per_node=4)
    src = DistSpec(Mesh((0,), (1,), ("x",)), (Replicate(),), (8, 4))
    dst = DistSpec(Mesh((4, 5, 6, 7), (4,), ("x",)), (Shard(0),), (8, 4))   # another node
    (st,) = plan_redistribution(src, dst)
    assert st.messages == 4 and st.payload_bytes(8) == 8 * 4 * 8
    t = blocking_s(ctx, "p2p", 2, 8 * 4 * 8, "inter") + 3 * blocking_s(ctx, "p2p", 2, 0.0, "inter")
    assert step_s(st, ctx, 8) == (t, t)
    assert step_s(st, ctx, 8)[0] > step_s(st, CostContext(profile=synthetic_profile(ranks_per_node=8),
                                                           world=8, ranks_per_node=8), 8)[0]
