"""Collective order in backward: every rank issues the same collectives on a process group in
the same order, whatever order backward produces gradients in on it.

Ranks of one plan run different autograd graphs (a bias added on one rank of a row-parallel
layer gets its gradient there in backward, elsewhere only in ``GradSync.finish``). Gradient
all-reduces launched mid-backward used to share their process group with the synchronous
collectives of backward (a transition's all-to-all, a partial sum's all-reduce): gnn_pcqm4m's
forced ``channel(2,2)`` and ``channel_filter(1,2,2)`` plans at world 4 hung in backward, and
with equal sizes gloo would sum the wrong tensors. ``GradSync`` now launches the buckets of a
group in bucket order on the group's gradient twin (``Comm.grad_group``).
"""

from __future__ import annotations

import pytest

from autopar.artifacts import PlanHooks, PlanOptions
from autopar.execute.runner import ExecuteOptions, execute
from autopar.planner import make_plan


def _grads_with_a_backward_collective(rank, world):
    """``w2`` is used on rank 0 only (its bucket completes in backward there, in ``finish``
    elsewhere), between the uses of ``w1`` sits a sum over the world whose backward is a
    synchronous all-reduce of the same size as each bucket (16 bytes: every parameter its own
    bucket)."""
    import torch

    from autopar.runtime.comm import Comm, all_reduce_sum
    from autopar.runtime.gradsync import GradSync

    comm = Comm.from_env()
    comm.ensure_partitions([])          # as DistModel does: the groups and their gradient twins
    everyone = tuple(range(world))
    w1 = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    w2 = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    sync = GradSync(comm, [(w1, everyone), (w2, everyone)], bucket_cap_bytes=8)
    assert len(sync.buckets) == 2
    out = {}
    for step in range(2):               # the second step reuses the buckets
        w1.grad = w2.grad = None
        x = torch.full((4,), float(rank + 1), dtype=torch.float64)
        z = all_reduce_sum(x * w1, comm, everyone)       # backward: all-reduce on the world
        loss = (z * w2).sum() if rank == 0 else z.sum()
        loss.backward()
        sync.finish()
        out[step] = (w1.grad.tolist(), w2.grad.tolist())
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_gradient_buckets_never_interleave_with_backward_collectives(world):
    from autopar.runtime.launch import run_ranks
    res = run_ranks(_grads_with_a_backward_collective, world, timeout_s=60)
    s = sum(range(1, world + 1))        # z = S w1 with S = sum_r (r + 1)
    for rank, out in enumerate(res):
        for step in range(2):
            g1, g2 = out[step]
            # dz = 1 on every rank, summed by the backward all-reduce: dh_r = world, and
            # dw1 = sum_r x_r world = S world; dw2 = z on rank 0 only = S
            assert g1 == [float(s * world)] * 4, (rank, step, g1)
            assert g2 == [float(s)] * 4, (rank, step, g2)


def _forced(model, world, kind, profile):
    """The plan with every layer where ``kind`` is legal pinned to its cheapest choice of that
    kind, the rest left to the ILP (``bench_plan_quality.py``'s ``only:<kind>`` candidates)."""
    base = make_plan(model, PlanOptions(world_size=world, write=False, placement="block"),
                     PlanHooks(profile=profile))
    force = {}
    for li, o in enumerate(base.table.layers):
        own = [(c.fwd_s + c.bwd_s + c.grad_sync_s, str(d)) for d, c in zip(o.choices, o.costs) if d.kind == kind]
        if own:
            force[li] = min(own)[1]
    return force


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["channel", "channel_filter"])
def test_padded_gnn_forced_channel_plans_validate_at_world_4(kind, root, tmp_path):
    """The plans that hung (planned with the shipped CPU profile, as the benchmark plans them):
    validation (float64, against one process) and a timed step finish."""
    from autopar.planner import load_calibration
    _, profile = load_calibration(str(root / "calibration/cpu-2core-gloo.json"))
    model = root / "strategies/examples/gnn_pcqm4m.py"
    force = _forced(model, 4, kind, profile)
    assert force, f"no layer of gnn_pcqm4m takes {kind}"
    r = make_plan(model, PlanOptions(world_size=4, out_dir=str(tmp_path / "plan"), placement="block"),
                  PlanHooks(profile=profile, force=force))
    kinds = {d.choice.split("(")[0] for d in r.plan.layers}
    assert kind in kinds and len(kinds) > 2, kinds      # a mixed plan: transitions in backward
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=1, instrumented_steps=1, ddp=False,
                                                 timeout_s=90), out_dir=tmp_path / "run",
                     progress=lambda s: None)
    assert run.validation.passed and run.validation.dtype == "float64", \
        [c.tensor for c in run.validation.failures]
