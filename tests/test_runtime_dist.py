"""Runtime collectives on real gloo processes: redistribution between layouts is exact forward
and its backward is the adjoint (gradients under the sum convention); gradient sync sums."""

import itertools

import pytest
import torch

from autopar.decomp.sharding import Sharding, Shard
from autopar.runtime.launch import run_ranks

pytestmark = pytest.mark.dist

LAYOUTS = [Sharding(), Sharding.of((Shard(0), 2)), Sharding.of((Shard(0), 4)), Sharding.of((Shard(0), 2), (Shard(2), 2)),
           Sharding.of((Shard(2), 4)), Sharding.of((Shard(1), 2), (Shard(3), 2)), Sharding.of((Shard(3), 2))]
SHAPE = (4, 3, 5, 6)


def _redistribute_cases(rank, world, pairs):
    from autopar.runtime.comm import Comm, assemble, local_slice
    from autopar.runtime.redistribute import redistribute
    comm = Comm.from_env()
    torch.manual_seed(0)
    x = torch.randn(SHAPE, dtype=torch.float64)
    g = torch.randn(SHAPE, dtype=torch.float64)
    out = []
    for src, dst in pairs:
        xl = local_slice(x, src, comm).clone().requires_grad_()
        y = redistribute(xl, src, dst, SHAPE, comm)
        fwd_ok = torch.equal(y.detach(), local_slice(x, dst, comm))
        loss_r = (y * local_slice(g, dst, comm)).sum() / dst.replicas(world)
        loss_r.backward()
        gx = assemble(xl.grad, src, SHAPE, comm, "sum")
        out.append((str(src), str(dst), fwd_ok, float((gx - g).abs().max())))
    return out


def test_redistribute_all_pairs_world4():
    pairs = [(a, b) for a, b in itertools.product(LAYOUTS, LAYOUTS)]
    res = run_ranks(_redistribute_cases, 4, args=(pairs,), timeout_s=120)
    for rank_res in res:
        for src, dst, fwd_ok, gerr in rank_res:
            assert fwd_ok, f"{src}->{dst} forward differs"
            assert gerr < 1e-12, f"{src}->{dst} backward is not the adjoint (err {gerr})"


def _gradsync(rank, world):
    from autopar.runtime.comm import Comm
    from autopar.runtime.gradsync import GradSync
    comm = Comm.from_env()
    comm.ensure_partitions([[[0, 1], [2, 3]]])
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(2))
    gs = GradSync(comm, [(a, (0, 1, 2, 3)), (b, (0, 1) if rank < 2 else (2, 3))], bucket_cap_bytes=8)
    ((a * (rank + 1)).sum() + (b * (rank + 1)).sum()).backward()
    gs.finish()
    return a.grad.tolist(), b.grad.tolist()


def test_gradsync_sums_over_each_group_concurrently():
    res = run_ranks(_gradsync, 4, timeout_s=60)
    for rank, (ga, gb) in enumerate(res):
        assert ga == [10.0] * 3
        assert gb == ([3.0] * 2 if rank < 2 else [7.0] * 2)
