"""Sharding (placements on named mesh axes) arithmetic: blocks cover the tensor exactly once, ranks map to
coordinates and back, the normal form, the JSON, parameters' placements (ParamShard)."""

import itertools
import math

import pytest

from autopar.decomp.base import ParamShard
from autopar.decomp.distspec import HaloShard, PaddedShard, Replicate, SegmentShard, parse_placement
from autopar.decomp.sharding import (Sharding, Partial, Shard, block_extent, block_start, dim_name, from_splits,
                                     overlap)


@pytest.mark.parametrize("n,p", [(10, 3), (8, 4), (7, 7), (5, 2), (1, 1)])
def test_blocks_partition_a_dim(n, p):
    covered = []
    for i in range(p):
        covered.extend(range(block_start(n, p, i), block_start(n, p, i) + block_extent(n, p, i)))
    assert covered == list(range(n))
    assert block_extent(n, p, 0) == max(block_extent(n, p, i) for i in range(p))


LAYOUTS = [Sharding(), Sharding.of((Shard(0), 2)), Sharding.of((Shard(0), 4)), Sharding.of((Shard(0), 2), (Shard(2), 2)),
           Sharding.of((Shard(2), 2), (Shard(3), 2)), Sharding.of((Shard(1), 2)), Sharding.of((Shard(0), 2), (Shard(1), 2))]


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
    lay = Sharding.of((Shard(0), 2), (Shard(2), 2))
    world = 8  # 2 replicas
    for r in range(world):
        cs, rep = lay.coords(r, world)
        assert lay.rank_of(cs, rep, world) == r
    assert lay.replicas(world) == 2
    assert lay.axis_group(1, 0, world) == [0, 2]       # neighbours along H are nearby ranks
    assert lay.data_group(0, world) == [0, 2, 4, 6]
    assert lay.replica_group(5, world) == [4, 5]


def test_trivial_splits_normalise_and_str():
    assert Sharding.of((Shard(0), 1), (Shard(2), 2)) == Sharding.of((Shard(2), 2))
    assert str(Sharding()) == "[Replicate()]" and str(Sharding.of((Shard(0), 4))) == "(N:4)[Shard(0)]"
    two = Sharding.of((Shard(0), 2), (Shard(3), 2))
    assert two.to_json(8) == {"mesh": {"shape": [2, 2, 2], "names": ["N", "d3", "replica"]},
                              "placements": ["Shard(0)", "Shard(3)", "Replicate()"]}
    assert two.named_for(4).to_json(8)["mesh"]["names"] == ["N", "W", "replica"]
    assert two.named_for(5).to_json(8)["mesh"]["names"] == ["N", "H", "replica"] and two.named_for(5) == two
    assert Sharding.from_json(two.to_json(8)) == two and Sharding.from_json(two.to_json(4)) == two
    # trailing Replicate axes merge into the replica axis; names are labels, not part of equality
    assert Sharding.of((Shard(0), 2), (Replicate(), 2)) == Sharding.of((Shard(0), 2))
    assert Sharding.of((Shard(0), 2, "data")) == Sharding.of((Shard(0), 2))
    with pytest.raises(ValueError, match="one dim on two axes"):
        Sharding.of((Shard(0), 2), (Shard(0), 2))


def test_sample_at_world_8_is_n4_by_an_explicit_replica_axis():
    m = Sharding.of((Shard(0), 4)).mesh(8)
    assert (m.shape, m.names) == ((4, 2), ("N", "replica"))
    assert Sharding.of((Shard(0), 4)).placements_on(8) == (Shard(0), Replicate())


def test_old_splits_form_reads_as_placements():
    assert from_splits([[0, 2], [2, 2]]) == Sharding.of((Shard(0), 2), (Shard(2), 2))
    assert from_splits([[0, 2]], partial=2) == Sharding.of((Shard(0), 2), (Partial(), 2))


@pytest.mark.parametrize("p", [Shard(1), Replicate(), Partial(), PaddedShard(2, 8), HaloShard(2, 1, 2),
                               SegmentShard(0, (4, 4, 4))], ids=str)
def test_every_placement_prints_and_parses(p):
    assert parse_placement(str(p)) == p


def test_halo_shard_reads_its_neighbours_cut_at_the_ends():
    h = HaloShard(2, 1, 2)
    assert [h.block(10, 3, i) for i in range(3)] == [(0, 4), (4, 3), (7, 3)]     # owned: tensor_split rule
    assert [h.read_block(10, 3, i) for i in range(3)] == [(0, 6), (3, 6), (6, 4)]


def test_param_shard_is_placements_on_the_layer_mesh():
    mesh = Sharding.of((Shard(0), 2), (Shard(1), 2))                 # a layer's N2 x C2 mesh
    sh = ParamShard.on(mesh, ((0, 1),))                              # weight rows split along C
    assert sh.sharding.placements == (Replicate(), Shard(0)) and sh.dims == ((0, 1),)
    world = 8                                                        # 2 replicas
    assert sh.grad_group(0, world) == [0, 1, 4, 5]                   # same C coordinate: sum gradients
    assert sh.local_bounds((6, 3), 2, world) == ((3, 3), (0, 3))
    seg = ParamShard.on(mesh, ((0, 1),), (4, 4, 4))                  # fused q|k|v
    assert seg.sharding.placements == (Replicate(), SegmentShard(0, (4, 4, 4))) and seg.segments == (4, 4, 4)
    assert seg.index((12, 3), 2, world)[0] == [2, 3, 6, 7, 10, 11]
    assert ParamShard().grad_group(3, 4) == [0, 1, 2, 3] and not ParamShard().dims


def test_fits_names_the_problem():
    assert "do not divide" in Sharding.of((Shard(0), 3)).fits((6, 2), 4)
    assert "extent 2 < 4 parts" in Sharding.of((Shard(0), 4)).fits((2, 2), 4)
    assert Sharding.of((Shard(0), 2)).fits((2, 3), 4) is None


def test_overlap():
    assert overlap(((0, 4), (0, 2)), ((2, 4), (1, 5))) == ((2, 2), (1, 1))
    assert overlap(((0, 2),), ((2, 2),)) is None


# ---- partial-sum axis and the DTensor view ----------------------------------------------------
def test_partial_axis_rank_order_groups_and_json():
    lay = Sharding.of((Shard(0), 2), (Partial(), 2))             # world 8: N2 x P2 x rep2
    world = 8
    assert lay.replicas(world) == 2 and str(lay) == "(N:2, partial:2)[Shard(0), Partial(sum)]"
    for r in range(world):                         # rank = (block * partial + k) * R + replica
        cs, rep = lay.coords(r, world)
        k = lay.partial_index(r, world)
        assert r == (cs[0] * 2 + k) * 2 + rep == lay.rank_of(cs, rep, world, k)
    assert lay.partial_group(5, world) == [5, 7]
    assert lay.replica_group(5, world) == [4, 5]
    assert lay.axis_group(0, 3, world) == [3, 7]
    assert lay.local_bounds((4, 3), 3, world) == ((0, 2), (0, 3))
    assert lay.to_json(world)["placements"] == ["Shard(0)", "Partial(sum)", "Replicate()"]
    assert Sharding.from_json(lay.to_json(world)) == lay
    assert lay.without_partial() == Sharding.of((Shard(0), 2))
    assert Sharding.of((Shard(0), 2), (Partial(), 2)) != Sharding.of((Shard(0), 2))
    assert "partial do not divide" in Sharding.of((Shard(0), 2), (Partial(), 3)).fits((4, 4), 8)
    assert not Sharding.of((Partial(), 2)).is_replicated()


def test_axis_names_follow_the_tensors_rank_the_same_way_everywhere():
    """Dim 2 of a 5-d tensor is D whatever else is split (it once read H when dim 4 was not split,
    D when it was); without the rank it is d2, never a guess; explicit names are kept."""
    for splits in ([(Shard(2), 2)], [(Shard(2), 2), (Shard(4), 2)], [(Shard(0), 2), (Shard(2), 2)]):
        sh = Sharding.of(*splits)
        assert sh.names[[p.dim for p in sh.placements].index(2)] == "d2"
        five = dict(zip((p.dim for p in sh.placements), sh.named_for(5).names))
        assert five[2] == "D" and five.get(4, "W") == "W"
        assert dict(zip((p.dim for p in sh.placements), sh.named_for(4).names))[2] == "H"
        assert sh.to_spec((4, 4, 8, 8, 8), 8).mesh.names[:len(splits)] == sh.named_for(5).names
    assert [dim_name(d, 5) for d in range(5)] == ["N", "C", "D", "H", "W"]
    assert [dim_name(d, 3) for d in range(3)] == ["N", "C", "W"] and dim_name(2) == "d2" and dim_name(5, 5) == "d5"
    assert Sharding.of((Shard(2), 2, "rows")).named_for(5).names == ("rows",)


@pytest.mark.parametrize("lay,world,mesh_shape,names,placements", [
    (Sharding(), 4, (4,), ("replica",), "[Replicate()]"),
    (Sharding.of((Shard(0), 4)), 4, (4,), ("N",), "[Shard(0)]"),
    (Sharding.of((Shard(0), 2), (Shard(2), 2)), 8, (2, 2, 2), ("N", "H", "replica"), "[Shard(0), Shard(2), Replicate()]"),
    (Sharding.of((Shard(0), 2), (Partial(), 2)), 8, (2, 2, 2), ("N", "partial", "replica"), "[Shard(0), Partial(sum), Replicate()]"),
    (Sharding.of((Shard(1), 2), (Shard(3), 2)), 4, (2, 2), ("C", "W"), "[Shard(1), Shard(3)]"),
], ids=lambda v: str(v))
def test_to_spec_matches_layout_arithmetic(lay, world, mesh_shape, names, placements):
    shape = (6, 5, 7, 3)
    spec = lay.to_spec(shape, world)
    assert spec.mesh.shape == mesh_shape and spec.mesh.names == names
    assert str(spec) == placements == lay.placements_str(world)
    for r in range(world):
        assert spec.local_bounds(r) == lay.local_bounds(shape, r, world)
        if lay.is_partial:
            assert spec.partial_key(r) == (lay.partial_index(r, world),)
