"""Layout arithmetic: blocks cover the tensor exactly once, ranks map to coordinates and back."""

import itertools
import math

import pytest

from autopar.decomp.layout import Layout, block_extent, block_start, overlap


@pytest.mark.parametrize("n,p", [(10, 3), (8, 4), (7, 7), (5, 2), (1, 1)])
def test_blocks_partition_a_dim(n, p):
    covered = []
    for i in range(p):
        covered.extend(range(block_start(n, p, i), block_start(n, p, i) + block_extent(n, p, i)))
    assert covered == list(range(n))
    assert block_extent(n, p, 0) == max(block_extent(n, p, i) for i in range(p))


LAYOUTS = [Layout(), Layout(((0, 2),)), Layout(((0, 4),)), Layout(((0, 2), (2, 2))),
           Layout(((2, 2), (3, 2))), Layout(((1, 2),)), Layout(((0, 2), (1, 2)))]


@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_every_element_held_by_replicas_only(lay):
    world, shape = 4, (6, 4, 5, 7)
    count = {}
    for r in range(world):
        b = lay.local_bounds(shape, r, world)
        for idx in itertools.product(*[range(s, s + e) for s, e in b]):
            count[idx] = count.get(idx, 0) + 1
    assert len(count) == math.prod(shape)
    assert set(count.values()) == {lay.replicas(world)}


def test_coords_round_trip_and_groups():
    lay = Layout(((0, 2), (2, 2)))
    world = 8  # 2 replicas
    for r in range(world):
        cs, rep = lay.coords(r, world)
        assert lay.rank_of(cs, rep, world) == r
    assert lay.replicas(world) == 2
    assert lay.axis_group(1, 0, world) == [0, 2]       # neighbours along H are nearby ranks
    assert lay.data_group(0, world) == [0, 2, 4, 6]
    assert lay.replica_group(5, world) == [4, 5]


def test_trivial_splits_normalise_and_str():
    assert Layout(((0, 1), (2, 2))) == Layout(((2, 2),))
    assert str(Layout()) == "R" and str(Layout(((0, 4),))) == "N4"
    assert Layout.from_json(Layout(((0, 2), (3, 2))).to_json()) == Layout(((0, 2), (3, 2)))


def test_fits_names_the_problem():
    assert "do not divide" in Layout(((0, 3),)).fits((6, 2), 4)
    assert "extent 2 < 4 parts" in Layout(((0, 4),)).fits((2, 2), 4)
    assert Layout(((0, 2),)).fits((2, 3), 4) is None


def test_overlap():
    assert overlap(((0, 4), (0, 2)), ((2, 4), (1, 5))) == ((2, 2), (1, 1))
    assert overlap(((0, 2),), ((2, 2),)) is None


# ---- partial-sum axis and the DTensor view ----------------------------------------------------
def test_partial_axis_rank_order_groups_and_json():
    lay = Layout(((0, 2),), partial=2)             # world 8: N2 x P2 x rep2
    world = 8
    assert lay.replicas(world) == 2 and str(lay) == "N2xP2"
    for r in range(world):                         # rank = (block * partial + k) * R + replica
        cs, rep = lay.coords(r, world)
        k = lay.partial_index(r, world)
        assert r == (cs[0] * 2 + k) * 2 + rep == lay.rank_of(cs, rep, world, k)
    assert lay.partial_group(5, world) == [5, 7]
    assert lay.replica_group(5, world) == [4, 5]
    assert lay.axis_group(0, 3, world) == [3, 7]
    assert lay.local_bounds((4, 3), 3, world) == ((0, 2), (0, 3))
    assert lay.to_json() == {"splits": [[0, 2]], "partial": 2}
    assert Layout.from_json(lay.to_json()) == lay
    assert Layout(((0, 2),)).to_json() == [[0, 2]]             # the old form when partial == 1
    assert Layout(((0, 2),), partial=2) != Layout(((0, 2),))
    assert "partial do not divide" in Layout(((0, 2),), partial=3).fits((4, 4), 8)
    assert not Layout((), partial=2).is_replicated()


@pytest.mark.parametrize("lay,world,mesh_shape,names,placements", [
    (Layout(), 4, (4,), ("rep",), "[Replicate()]"),
    (Layout(((0, 4),)), 4, (4,), ("N",), "[Shard(0)]"),
    (Layout(((0, 2), (2, 2))), 8, (2, 2, 2), ("N", "H", "rep"), "[Shard(0), Shard(2), Replicate()]"),
    (Layout(((0, 2),), partial=2), 8, (2, 2, 2), ("N", "P", "rep"), "[Shard(0), Partial(sum), Replicate()]"),
    (Layout(((1, 2), (3, 2))), 4, (2, 2), ("C", "W"), "[Shard(1), Shard(3)]"),
], ids=lambda v: str(v))
def test_to_spec_matches_layout_arithmetic(lay, world, mesh_shape, names, placements):
    shape = (6, 5, 7, 3)
    spec = lay.to_spec(shape, world)
    assert spec.mesh.shape == mesh_shape and spec.mesh.names == names
    assert str(spec) == placements == lay.placements_str(world)
    for r in range(world):
        assert spec.local_bounds(r) == lay.local_bounds(shape, r, world)
        if lay.partial > 1:
            assert spec.partial_key(r) == (lay.partial_index(r, world),)
