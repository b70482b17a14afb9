"""Mesh-to-mesh redistribution on real gloo ranks (world 4, float64): a tensor moves from a
2-rank sub-mesh to the other two ranks (a stage to the next), from a 2x2 mesh to a 4-rank 1-D
mesh (the same ranks, and the ranks in another order) with other placements and back, and
from a sub-mesh to the world and back. Every destination rank holds exactly the full tensor's
block (``scatter``, padding included), a rank off the destination gets an empty tensor, and
the backward is the adjoint of the forward::

    sum over ranks <dy, f(x)>  ==  sum over ranks <f*(dy), x>

with each rank running backward through its own result (the gradients travel back point to
point). The refusals (a misshapen block, a mesh beyond the comm, a mesh whose ranks decrease
where a collective needs them in order) are checked without processes."""

import pytest
import torch

from autopar.decomp.distspec import DistSpec, PaddedShard, Partial, Replicate, Shard, scatter
from autopar.decomp.mesh import Mesh
from autopar.runtime.comm import Comm
from autopar.runtime.launch import run_ranks
from autopar.runtime.redistribute import RedistributionError, redistribute_across

SHAPE = (6, 5)
W4 = Mesh.world(4)
GRID = W4.reshape((2, 2), ("a", "b"))
FIRST, SECOND = Mesh((0, 1), (2,), ("x",)), Mesh((2, 3), (2,), ("x",))
BACKWARDS = Mesh((3, 2, 1, 0), (4,), ("y",))


def _spec(mesh, *placements):
    return DistSpec(mesh, placements, SHAPE)


PAIRS = [
    (_spec(FIRST, Shard(0)), _spec(SECOND, Shard(0))),                  # a stage to the next
    (_spec(FIRST, Partial()), _spec(SECOND, Shard(1))),
    (_spec(FIRST, Replicate()), _spec(SECOND, Partial())),
    (_spec(FIRST, PaddedShard(0, 8)), _spec(SECOND, Replicate())),
    (_spec(GRID, Shard(0), Shard(1)), _spec(W4, Shard(1))),             # 2x2 -> 1-D, same ranks
    (_spec(W4, Shard(1)), _spec(GRID, Shard(0), Shard(1))),             # and back
    (_spec(GRID, Shard(0), Partial()), _spec(BACKWARDS, Shard(0))),     # 2x2 -> ranks reversed
    (_spec(BACKWARDS, Shard(0)), _spec(GRID, Replicate(), Shard(1))),   # and back
    (_spec(Mesh((1, 3), (2,), ("x",)), Shard(1)), _spec(W4, Shard(0))),  # sub-mesh -> world
    (_spec(W4, PaddedShard(0, 8)), _spec(Mesh((1, 3), (2,), ("x",)), Replicate())),  # and back
]


def _full_and_pieces(shape, seed):
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(-9, 9, shape, generator=g).double()
    return full, (lambda sh: torch.randint(-9, 9, sh, generator=g).double())


def _cases(rank, world, pairs):
    comm = Comm.from_env()
    out = []
    for k, (src, dst) in enumerate(pairs):
        full, pieces = _full_and_pieces(src.shape, k)      # every rank draws the same tensors
        x = None
        if rank in src.mesh.ranks:
            x = scatter(full, src, pieces)[rank].clone().requires_grad_()
        y = redistribute_across(x, src, dst, comm, dtype=torch.float64)
        lhs = rhs = 0.0
        if y is not None:
            dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * k + rank))
            (y * dy).sum().backward()          # off the destination y is empty: a zero loss
            lhs = float((y.detach() * dy).sum())
            if x is not None:
                assert x.grad is not None and x.grad.shape == x.shape, (k, rank)
                rhs = float((x.grad * x.detach()).sum())
        out.append((None if y is None else y.detach().numpy(), lhs, rhs))
    return out


@pytest.mark.dist
def test_mesh_to_mesh_world4_forward_and_adjoint():
    res = run_ranks(_cases, 4, args=(PAIRS,), timeout_s=180)
    for k, (src, dst) in enumerate(PAIRS):
        where = f"{src} on {src.mesh} -> {dst} on {dst.mesh}"
        full, _ = _full_and_pieces(src.shape, k)
        ref = scatter(full, dst)
        for r in range(4):
            y = res[r][k][0]
            if r in dst.mesh.ranks:
                assert torch.equal(torch.from_numpy(y), ref[r]), f"{where}: rank {r}"
            elif r in src.mesh.ranks:
                assert y.shape == (0,), f"{where}: rank {r} off the destination"
            else:
                assert y is None, f"{where}: rank {r} of neither mesh"
        lhs = sum(res[r][k][1] for r in range(4))
        rhs = sum(res[r][k][2] for r in range(4))
        assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-9), f"{where}: backward is not the adjoint"


def test_refusals_name_the_problem():
    comm = Comm(rank=0, world=4)
    src, dst = _spec(FIRST, Shard(0)), _spec(SECOND, Shard(0))
    with pytest.raises(RedistributionError, match=r"pass its local tensor of shape \(3, 5\)"):
        redistribute_across(torch.zeros(6, 5), src, dst, comm)
    with pytest.raises(RedistributionError, match="names rank 5"):
        redistribute_across(None, src, _spec(Mesh((4, 5), (2,), ("x",)), Shard(0)), comm)
    odd = Mesh((0, 2, 1, 3), (4,), ("x",))     # same ranks, another order: an all-gather on it
    with pytest.raises(RedistributionError, match="do not increase"):
        redistribute_across(torch.zeros(2, 5), _spec(odd, Shard(0)),
                            DistSpec(odd, (Replicate(),), SHAPE), comm)
