"""Mesh, placements and redistribution plans against brute-force tensor arithmetic (pure).

For meshes of 2, 4 and 8 ranks and every ordered pair of placements drawn from Shard(0),
Shard(1), Replicate(), Partial(), PaddedShard(0, .) per axis: scatter a full tensor to the
source (partial addends random), run the planned steps, compare with the destination's scatter
exactly (integer-valued floats, so sums are exact). Then layouts: CNN layout pairs plan and run
correctly, and ``transition_s`` keeps the price of the one-all-to-all formula it had before.
"""

import itertools
import json
import math

import numpy as np
import pytest

from autopar.decomp.base import CostContext
from autopar.decomp.distspec import (DistSpec, PaddedShard, Partial, Replicate, Shard, gather,
                                     parse_placement, scatter)
from autopar.decomp.sharding import Sharding
from autopar.decomp.mesh import Mesh
from autopar.decomp.redistribute import (AllGather, AllReduce, AllToAll, ReduceScatter, Slice,
                                         plan_redistribution, simulate, step_from_json, steps_str,
                                         transfer_bytes)
from autopar.decomp.transition import EXACT_WORLD, recv_bytes, transition_s

from fakes import synthetic_profile

SHAPE = (5, 6)          # 5 rows over 2, 4, 8 ranks: remainders and empty blocks occur


def _choices(size):
    return [Shard(0), Shard(1), Replicate(), Partial(), PaddedShard(0, size * -(-SHAPE[0] // size))]


def _specs(mesh):
    out = []
    for pl in itertools.product(*[_choices(s) for s in mesh.shape]):
        try:
            out.append(DistSpec(mesh, pl, SHAPE))
        except ValueError:      # a padded dim split by a second axis
            pass
    return out


def _check(src, dst, full, rng):
    pieces = lambda sh: rng.integers(-9, 9, sh).astype(float)   # noqa: E731
    xs = scatter(full, src, pieces)
    assert (gather(xs, src) == full).all()
    steps = plan_redistribution(src, dst)
    ys = simulate(steps, src, dst, xs)
    where = f"{src} -> {dst} on {src.mesh}: {steps_str(steps)}"
    for r, y in ys.items():
        assert y.shape == dst.local_shape(r), where
    assert (gather(ys, dst) == full).all(), where
    if not dst.is_partial:
        ref = scatter(full, dst)
        for r, y in ys.items():
            assert (y == ref[r]).all(), where
    return steps


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2), (8,), (2, 4), (2, 2, 2)], ids=str)
def test_every_pair_of_placements_against_brute_force(mesh_shape):
    mesh = Mesh(tuple(range(math.prod(mesh_shape))), mesh_shape, tuple("abc"[:len(mesh_shape)]))
    rng = np.random.default_rng(len(mesh_shape) * 10 + mesh.size)
    full = rng.integers(-9, 9, SHAPE).astype(float)
    specs = _specs(mesh)
    for src in specs:
        for dst in specs:
            steps = _check(src, dst, full, rng)
            if src == dst:
                assert steps == ()


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 4)], ids=str)
def test_dtensor_rules_on_one_mesh(mesh_shape):
    mesh = Mesh(tuple(range(math.prod(mesh_shape))), mesh_shape, tuple("ab"[:len(mesh_shape)]))
    rest = (Replicate(),) * (len(mesh_shape) - 1)
    spec = lambda p: DistSpec(mesh, (p,) + rest, (8, 6))   # noqa: E731
    kinds = lambda a, b: [type(s) for s in plan_redistribution(spec(a), spec(b))]   # noqa: E731
    assert kinds(Partial(), Shard(0)) == [ReduceScatter]
    assert kinds(Partial(), Shard(1)) == [ReduceScatter]
    assert kinds(Partial(), Replicate()) == [AllReduce]
    assert kinds(Shard(0), Replicate()) == [AllGather]
    assert kinds(Shard(0), Shard(1)) == [AllToAll]
    assert kinds(Replicate(), Shard(1)) == [Slice]
    assert kinds(Shard(1), Shard(1)) == []


def test_partial_resolved_where_the_consumer_needs_it():
    # a partial sum on a 2x2 mesh kept across an edge: only the consumer's shard is reduced
    mesh = Mesh((0, 1, 2, 3), (2, 2), ("N", "P"))
    src = DistSpec(mesh, (Shard(0), Partial()), (8, 4))
    dst = DistSpec(mesh, (Shard(0), Shard(0)), (8, 4))
    steps = plan_redistribution(src, dst)
    assert [type(s) for s in steps] == [ReduceScatter]
    assert steps[0].groups == ((0, 1), (2, 3)) and steps[0].dim == 0
    # busiest rank: its (4, 4) block of 8-byte items, ring (p-1)/p of the padded input
    assert steps[0].traffic_bytes(8) == (0.5 * 4 * 4 * 8,) * 2


# ---- layouts ----------------------------------------------------------------------------------
CNN = [Sharding(), Sharding.of((Shard(0), 2)), Sharding.of((Shard(0), 4)), Sharding.of((Shard(0), 8)), Sharding.of((Shard(0), 2), (Shard(2), 2)),
       Sharding.of((Shard(2), 2), (Shard(3), 2)), Sharding.of((Shard(2), 4)), Sharding.of((Shard(1), 2)), Sharding.of((Shard(0), 2), (Shard(1), 2)),
       Sharding.of((Shard(0), 2), (Shard(2), 2), (Shard(3), 2)), Sharding.of((Shard(1), 4)), Sharding.of((Shard(3), 2))]
PARTIAL = [Sharding.of((Partial(), 2)), Sharding.of((Shard(0), 2), (Partial(), 2)), Sharding.of((Shard(1), 2), (Partial(), 2)),
           Sharding.of((Partial(), 4))]
CNN_SHAPE = (8, 6, 7, 5)


def _fits(lay, world):
    return lay.fits(CNN_SHAPE, world) is None


@pytest.mark.parametrize("world", [2, 4, 8])
def test_layout_pairs_plan_and_run(world):
    rng = np.random.default_rng(world)
    full = rng.integers(-9, 9, CNN_SHAPE).astype(float)
    lays = [lay for lay in CNN + PARTIAL if _fits(lay, world)]
    for a, b in itertools.product(lays, lays):
        src, dst = a.to_spec(CNN_SHAPE, world), b.to_spec(CNN_SHAPE, world)
        pieces = lambda sh: rng.integers(-9, 9, sh).astype(float)   # noqa: E731
        ys = simulate(plan_redistribution(src, dst), src, dst, scatter(full, src, pieces))
        assert (gather(ys, dst) == full).all(), f"{a} -> {b}"
        for r in range(world):
            assert ys[r].shape == b.local_shape(CNN_SHAPE, r, world)


def _old_transition_s(src, dst, shape, itemsize, ctx):
    """The formula ``transition_s`` had before plans: one all-to-all of n_recv * P/(P-1)."""
    from autopar.cost.primitives import blocking_s
    if src == dst:
        return 0.0, 0.0
    if ctx.world <= EXACT_WORLD:
        n = float(max(transfer_bytes(src, dst, shape, ctx.world, itemsize)))
    else:
        from autopar.decomp.sharding import overlap
        d0, s0 = dst.block_bounds(shape, 0, ctx.world), src.block_bounds(shape, 0, ctx.world)
        ov = overlap(d0, s0)
        n = float((math.prod(e for _, e in d0) - (math.prod(e for _, e in ov) if ov else 0)) * itemsize)
    if n <= 0:
        return 0.0, 0.0
    p = ctx.world
    t = blocking_s(ctx, "all_to_all", p, n * p / (p - 1), ctx.level(range(p)))
    return t, t


@pytest.mark.parametrize("world,rpn", [(2, 4), (4, 4), (8, 4), (8, 8), (32, 8)])
def test_transition_price_unchanged_for_partial_free_layouts(world, rpn):
    ctx = CostContext(profile=synthetic_profile(ranks_per_node=rpn), world=world, ranks_per_node=rpn)
    lays = [lay for lay in CNN if _fits(lay, world)] + [Sharding.of((Shard(0), 32))] * (world == 32)
    for a, b in itertools.product(lays, lays):
        for shape in (CNN_SHAPE, (16, 32, 28, 28)):
            new = transition_s(a, b, shape, 4, ctx)
            assert new == _old_transition_s(a, b, shape, 4, ctx), f"{a} -> {b} {shape}"
            if world <= EXACT_WORLD:
                assert recv_bytes(a, b, shape, world, 4) == float(max(transfer_bytes(a, b, shape, world, 4)))


def test_transition_with_partial_prices_its_steps_and_memoises():
    ctx = CostContext(profile=synthetic_profile(), world=4, ranks_per_node=4, cost_memo={})
    a, b = Sharding.of((Shard(0), 2), (Partial(), 2)), Sharding.of((Shard(0), 4))
    f, bw = transition_s(a, b, (8, 16, 8, 8), 4, ctx)
    assert f > 0 and bw > 0
    assert len(ctx.cost_memo) == 1
    assert transition_s(a, b, (8, 16, 8, 8), 4, ctx) == (f, bw)
    assert recv_bytes(a, b, (8, 16, 8, 8), 4, 4) > 0


def test_redistribution_s_prices_the_adjoint_backward():
    from autopar.cost.redistribute import redistribution_s

    class Rec:
        """Profile stub: T = p * n, remembering the kinds asked."""
        def __init__(self):
            self.kinds = []
            self.samples = {}

        def collective_time_s(self, kind, p, nbytes, level):
            self.kinds.append(kind)
            return 1e-9 * nbytes

    prof = Rec()
    ctx = CostContext(profile=prof, world=4, ranks_per_node=4)
    mesh = Mesh.world(4)
    src, dst = DistSpec(mesh, (Partial(),), (8, 6)), DistSpec(mesh, (Shard(0),), (8, 6))
    f, b = redistribution_s(plan_redistribution(src, dst), ctx, 4)
    assert [k for k in prof.kinds if k] == ["reduce_scatter", "allgather"]
    assert f == pytest.approx(8 * 6 * 4 * 1e-9) == b
    assert redistribution_s(plan_redistribution(src, src), ctx, 4) == (0.0, 0.0)


# ---- the small value types --------------------------------------------------------------------
def test_mesh_arithmetic_sub_meshes_and_json():
    m = Mesh(tuple(range(10, 18)), (2, 4), ("dp", "sp"))
    assert m.size == 8 and m.ndim == 2
    assert m.coords(15) == (1, 1) and m.rank_at((1, 1)) == 15 and m.index_of(15) == 5
    assert m.axis_group(15, "sp") == (14, 15, 16, 17) and m.axis_group(15, 0) == (11, 15)
    assert m.partition(["dp"]) == ((10, 14), (11, 15), (12, 16), (13, 17))
    assert m.partition([0, 1]) == (tuple(range(10, 18)),)
    assert m.slice("dp", 1) == Mesh((14, 15, 16, 17), (4,), ("sp",))
    assert [s.ranks for s in m.split("sp")] == [(10, 14), (11, 15), (12, 16), (13, 17)]
    assert m.reshape((2, 2, 2), ("a", "b", "c")).rank_at((1, 0, 1)) == 15
    assert m.overlaps(Mesh.world(11)) and not m.overlaps(Mesh.world(10))
    assert Mesh.from_json(json.loads(json.dumps(m.to_json()))) == m
    assert Mesh.world(4) == Mesh((0, 1, 2, 3), (4,), ("world",))


@pytest.mark.parametrize("args,msg", [(((0, 1, 1), (3,), ("a",)), "repeat"),
                                      (((0, 1, 2), (2,), ("a",)), "holds 2 ranks"),
                                      (((-1, 0), (2,), ("a",)), ">= 0"),
                                      (((0, 1), (2,), ("a", "b")), "2 names")])
def test_mesh_validation_names_the_problem(args, msg):
    with pytest.raises(ValueError, match=msg):
        Mesh(*args)


def test_placements_print_like_dtensor_and_round_trip():
    ps = [Shard(2), Replicate(), Partial(), PaddedShard(0, 8)]
    assert [str(p) for p in ps] == ["Shard(2)", "Replicate()", "Partial(sum)", "PaddedShard(0, 8)"]
    assert [parse_placement(str(p)) for p in ps] == ps
    mesh = Mesh((0, 1, 2, 3), (2, 2), ("N", "P"))
    spec = DistSpec(mesh, (PaddedShard(0, 6), Partial()), (5, 3))
    assert DistSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.is_partial and spec.partial_axes == (1,)
    assert spec.local_bounds(2) == ((3, 2), (0, 3)) and spec.local_shape(2) == (3, 3)
    with pytest.raises(ValueError, match="not a multiple"):
        DistSpec(mesh, (PaddedShard(0, 5), Replicate()), (5, 3))
    with pytest.raises(ValueError, match="2 placements for 1"):
        DistSpec(Mesh.world(2), (Shard(0), Shard(1)), (4, 4))


def test_to_torch_converts_to_dtensor_placements():
    pytest.importorskip("torch")
    from torch.distributed.tensor.placement_types import Partial as TP, Replicate as TR, Shard as TS
    assert Shard(1).to_torch() == TS(1)
    assert Replicate().to_torch() == TR()
    assert Partial().to_torch() == TP("sum")
    with pytest.raises(ValueError, match="no padded shard"):
        PaddedShard(0, 8).to_torch()


def test_steps_serialise():
    mesh = Mesh.world(4)
    steps = plan_redistribution(DistSpec(mesh, (Partial(),), (8, 6)), DistSpec(mesh, (Shard(1),), (8, 6)))
    js = json.loads(json.dumps([s.to_json() for s in steps]))
    assert js[0]["step"] == "ReduceScatter" and js[0]["dim"] == 1 and js[0]["groups"] == [[0, 1, 2, 3]]
    assert tuple(step_from_json(j) for j in js) == steps
    lay = plan_redistribution(Sharding.of((Shard(0), 4)).to_spec((8, 4, 6, 6), 4),
                              Sharding.of((Shard(0), 2), (Shard(2), 2)).to_spec((8, 4, 6, 6), 4))
    assert tuple(step_from_json(json.loads(json.dumps(s.to_json()))) for s in lay) == lay
