"""Planned redistribution steps on real gloo ranks: the forward equals the brute-force scatter
of the destination, and the backward is the adjoint of the forward (float64)::

    sum over ranks <dy, f(x)>  ==  sum over ranks <f*(dy), x>

for Partial -> Shard, Partial -> Replicate, Shard -> Replicate, Shard(0) -> Shard(1), padded
shards both ways, and CNN layouts on meshes of different shapes (world 2, and 4 for a few)."""

import numpy as np
import pytest
import torch

from autopar.decomp.distspec import DistSpec, PaddedShard, Partial, Replicate, Shard, gather, scatter
from autopar.decomp.sharding import Sharding
from autopar.decomp.mesh import Mesh
from autopar.runtime.launch import run_ranks

pytestmark = pytest.mark.dist

SHAPE = (5, 6)
CNN_SHAPE = (4, 3, 5, 6)


def _full_and_pieces(shape, seed):
    g = torch.Generator().manual_seed(seed)
    full = torch.randint(-9, 9, shape, generator=g).double()
    return full, (lambda sh: torch.randint(-9, 9, sh, generator=g).double())


def _cases(rank, world, pairs):
    from autopar.runtime.comm import Comm
    from autopar.runtime.redistribute import redistribute_spec
    comm = Comm.from_env()
    out = []
    for k, (src, dst) in enumerate(pairs):
        full, pieces = _full_and_pieces(src.shape, k)      # every rank draws the same tensors
        x = scatter(full, src, pieces)[rank].clone().requires_grad_()
        y = redistribute_spec(x, src, dst, comm)
        dy = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * k + rank))
        (y * dy).sum().backward()
        lhs = float((y.detach() * dy).sum())
        rhs = float((x.grad * x.detach()).sum())
        out.append((y.detach().numpy(), tuple(x.grad.shape) == tuple(x.shape), lhs, rhs))
    return out


def _run(world, pairs):
    res = run_ranks(_cases, world, args=(pairs,), timeout_s=120)
    for k, (src, dst) in enumerate(pairs):
        where = f"{src} -> {dst} on {src.mesh} / {dst.mesh}"
        full, pieces = _full_and_pieces(src.shape, k)
        ys = {r: torch.from_numpy(res[r][k][0]) for r in range(world)}
        assert torch.equal(gather(ys, dst), full), where
        if not dst.is_partial:
            ref = scatter(full, dst)
            for r in range(world):
                assert torch.equal(ys[r], ref[r]), f"{where}: rank {r}"
        assert all(res[r][k][1] for r in range(world)), f"{where}: gradient shape"
        lhs = sum(res[r][k][2] for r in range(world))
        rhs = sum(res[r][k][3] for r in range(world))
        assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-9), f"{where}: backward is not the adjoint"


def test_placement_pairs_world2():
    m = Mesh.world(2)
    s = lambda p: DistSpec(m, (p,), SHAPE)   # noqa: E731
    pairs = [(Partial(), Shard(0)), (Partial(), Shard(1)), (Partial(), Replicate()),
             (Shard(0), Replicate()), (Shard(1), Replicate()), (Shard(0), Shard(1)),
             (PaddedShard(0, 6), Shard(0)), (Shard(1), PaddedShard(0, 6)),
             (PaddedShard(0, 6), Replicate()), (Replicate(), Partial()), (Replicate(), Shard(1)),
             (Partial(), PaddedShard(0, 6))]
    _run(2, [(s(a), s(b)) for a, b in pairs])


def test_placement_pairs_and_cnn_layouts_world4():
    m = Mesh.world(4).reshape((2, 2), ("a", "b"))
    s = lambda *p: DistSpec(m, p, SHAPE)   # noqa: E731
    lay = lambda *axes: Sharding.of(*axes).to_spec(CNN_SHAPE, 4)   # noqa: E731
    pairs = [(s(Shard(0), Partial()), s(Shard(0), Shard(1))),
             (s(Partial(), Partial()), s(Replicate(), Replicate())),
             (s(Shard(0), Shard(1)), s(Replicate(), Replicate())),
             (s(Shard(0), Shard(0)), s(Shard(1), Shard(1))),
             (s(PaddedShard(0, 6), Replicate()), s(Shard(1), Shard(0))),
             (lay((Shard(0), 4)), lay((Shard(0), 2), (Shard(2), 2))),     # N4 -> N2xH2: different mesh shapes
             (lay((Shard(0), 2), (Shard(3), 2)), lay((Shard(1), 4))),
             (lay((Shard(0), 2), (Partial(), 2)), lay((Shard(0), 4))),    # a partial sum kept across an edge
             (lay((Partial(), 4)), lay((Shard(0), 2), (Shard(2), 2)))]
    _run(4, pairs)
