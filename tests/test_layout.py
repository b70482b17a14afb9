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
