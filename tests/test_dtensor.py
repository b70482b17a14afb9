"""``to_dtensor``: an autopar mesh + placements as torch's DeviceMesh + DTensor placements, at
world 2 and 4 over gloo (float64).

For each spec that maps (Shard, Replicate, Partial; even and uneven extents whose blocks agree;
ranks in another order; a sub-mesh): ``distribute_tensor(full, mesh, placements).to_local()``
is autopar's own block (``DistSpec.local_bounds``) on every rank of the mesh, and autopar's
local tensors (``scatter``, partial addends random) are a DTensor whose ``full_tensor()`` is the
full tensor. For every spec tried, the pure check ``mismatch`` says None exactly when DTensor's
own local tensor is autopar's block on every rank (so an uneven Shard it refuses really differs:
5 rows over 4 ranks are 2,1,1,1 by tensor_split, 2,2,1,0 by torch.chunk; and so does a mesh
whose ranks decrease along an axis). PaddedShard and an uneven Shard are refused with
``DTensorMismatch`` naming the placement.
"""

import pytest
import torch

from autopar.decomp.distspec import DistSpec, PaddedShard, Partial, Replicate, Shard, scatter
from autopar.decomp.mesh import Mesh
from autopar.runtime.dtensor import DTensorMismatch, device_mesh, mismatch, to_dtensor
from autopar.runtime.launch import run_ranks

W2, W4 = Mesh.world(2), Mesh.world(4)
GRID = W4.reshape((2, 2), ("a", "b"))
CROSSED = Mesh((0, 2, 1, 3), (2, 2), ("a", "b"))

EXACT = {
    2: [DistSpec(W2, (Shard(0),), (6, 5)), DistSpec(W2, (Shard(1),), (6, 5)),      # 5 over 2: 3,2 both
        DistSpec(W2, (Replicate(),), (3, 4)), DistSpec(W2, (Partial(),), (3, 4)),
        DistSpec(Mesh((0, 1), (2,), ("x",)), (Shard(0),), (7, 2))],
    4: [DistSpec(GRID, (Shard(0), Shard(1)), (6, 5)), DistSpec(GRID, (Shard(0), Shard(0)), (7, 3)),
        DistSpec(W4, (Shard(1),), (2, 7)),                                          # 7 over 4: 2,2,2,1 both
        DistSpec(GRID, (Replicate(), Shard(1)), (3, 7)), DistSpec(CROSSED, (Shard(0), Partial()), (4, 6)),
        DistSpec(GRID, (Partial(), Replicate()), (3, 3)), DistSpec(Mesh((1, 3), (2,), ("x",)), (Shard(0),), (5, 2)),
        DistSpec(GRID, (Shard(1), Shard(1)), (2, 7))],                               # 7 -> 4,3 -> 2,2 / 2,1
}
REFUSED = {2: [DistSpec(Mesh((1, 0), (2,), ("x",)), (Shard(0),), (7, 2))],        # ranks decrease
           4: [DistSpec(W4, (Shard(0),), (5, 3)), DistSpec(W4, (Shard(1),), (2, 6)), DistSpec(Mesh((0, 3, 2, 1), (4,), ("x",)), (Shard(0),), (4, 2))]}


def _full(shape, k):
    g = torch.Generator().manual_seed(k)
    return torch.randint(-9, 9, shape, generator=g).double(), g


def _check(rank, world):
    from torch.distributed.tensor import DTensor, distribute_tensor
    out = []
    for k, spec in enumerate(EXACT[world]):
        full, g = _full(spec.shape, k)
        dm, placements = to_dtensor(spec)            # every process: it creates process groups
        if rank not in spec.mesh.ranks:
            out.append(None)
            continue
        local = distribute_tensor(full, dm, placements).to_local()
        box = tuple(slice(s, s + e) for s, e in spec.local_bounds(rank))
        block_ok = spec.is_partial or torch.equal(local, full[box])
        mine = scatter(full, spec, lambda sh: torch.randint(-9, 9, sh, generator=g).double())[rank]
        back = DTensor.from_local(mine, dm, placements, run_check=False, shape=torch.Size(spec.shape),
                                  stride=full.stride()).full_tensor()
        out.append((block_ok, torch.equal(back, full)))
    agree = []
    for k, spec in enumerate(EXACT[world] + REFUSED[world]):
        full, _ = _full(spec.shape, k)
        dm = device_mesh(spec.mesh)
        if spec.is_partial or rank not in spec.mesh.ranks:
            continue
        local = distribute_tensor(full, dm, [p.to_torch() for p in spec.placements]).to_local()
        box = tuple(slice(s, s + e) for s, e in spec.local_bounds(rank))
        agree.append((k, torch.equal(local, full[box])))
    return out, agree


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_distribute_tensor_gives_autopar_blocks(world):
    res = run_ranks(_check, world, timeout_s=180)
    for k, spec in enumerate(EXACT[world]):
        for r in range(world):
            got = res[r][0][k]
            if r not in spec.mesh.ranks:
                assert got is None
                continue
            assert got[0], f"{spec} on {spec.mesh}: rank {r}'s DTensor block is not autopar's"
            assert got[1], f"{spec} on {spec.mesh}: autopar's locals are not that DTensor"
    specs = EXACT[world] + REFUSED[world]
    assert all(mismatch(spec) is not None for spec in REFUSED[world])
    for k, spec in enumerate(specs):
        if spec.is_partial:
            continue
        same = all(ok for r in spec.mesh.ranks for kk, ok in res[r][1] if kk == k)
        assert same == (mismatch(spec) is None), f"{spec}: the pure check disagrees with DTensor"


def test_refusals_name_the_placement():
    with pytest.raises(DTensorMismatch, match=r"PaddedShard\(0, 8\)"):
        to_dtensor(DistSpec(W4, (PaddedShard(0, 8),), (6, 3)))
    with pytest.raises(DTensorMismatch, match=r"Shard\(0\) on axis world of extent 5: rank 1 holds \[2, 3\)"):
        to_dtensor(DistSpec(W4, (Shard(0),), (5, 3)))
    with pytest.raises(DTensorMismatch, match=r"axis x holds ranks \[1, 0\] in decreasing order"):
        to_dtensor(DistSpec(Mesh((1, 0), (2,), ("x",)), (Replicate(),), (2, 2)))
    assert mismatch(DistSpec(GRID, (Shard(0), Shard(0)), (7, 3))) is None
