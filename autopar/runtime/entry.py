"""Entry points of generated modules: ``build_planned`` (one rank's model) and
``run_generated`` (the ``torchrun`` main: synthetic-data training steps, step times printed)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
import torch

from ..artifacts import Plan, load_plan
from ..decomp.rankmap import RankMap
from ..modelfile import load_model_file
from .comm import Comm
from ..decomp.graph.inputs import check_edge_indices
from .launch import init_from_env


def read_plan(plan_file: str | Path) -> Plan:
    """The typed plan (``autopar.artifacts``), checked before any collective starts."""
    return load_plan(plan_file)


def plan_placement(plan: Plan) -> RankMap:
    """The plan's rank placement (``mesh.placement``; plans made before placements existed
    load as the identity, block placement)."""
    return plan.placement()


def build_user_model(plan: Plan, plan_file: str | Path, seed: int):
    mf = load_model_file(plan.model_file(plan_file), env=plan.model_env())
    torch.manual_seed(seed)
    return mf, mf.build_model()


def build_planned(cls, plan_file: str | Path, model=None, comm: Comm | None = None, seed: int = 0):
    plan = read_plan(plan_file)
    if model is None:
        _, model = build_user_model(plan, plan_file, seed)
    return cls(plan, model, comm or Comm.from_env())


def synthetic_batch(mf, batch_size: int, seed: int):
    torch.manual_seed(seed)
    xs = mf.example_inputs(batch_size)
    ys = mf.example_targets(batch_size)
    return [x.float() if x.is_floating_point() else x for x in xs], ys


def run_generated(cls, plan_file: str | Path, argv: list[str]) -> int:
    """``torchrun --nproc-per-node N generated.py --steps S``: train S steps on synthetic data,
    through the training library (``autopar.train.parallelize``), as a user's loop would."""
    import torch.distributed as dist
    from ..train.api import parallelize
    from ..train.data import shard_batch

    ap = argparse.ArgumentParser(description="autopar generated training loop (synthetic data)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.01)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))
    plan = read_plan(plan_file)
    rank, world = init_from_env(placement=plan_placement(plan))   # relabels: ranks are logical
    mf, model = build_user_model(plan, plan_file, args.seed)
    dm = parallelize(model, plan_file, loss_fn=mf.loss_fn(), module_class=cls)
    opt = torch.optim.SGD(dm.parameters(), lr=args.lr, momentum=0.9)
    xs, ys = synthetic_batch(mf, plan.model.batch_size, args.seed + 1)
    check_edge_indices(plan.graph(), xs)   # a GNN batch's edges inside their graphs
    # a pipeline's step takes the whole batch on every rank (``train.stages.PipelineModule``)
    local, target = (xs, ys) if getattr(dm, "whole_batch", False) else shard_batch(dm, xs, ys)
    times = []
    for step in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = dm.loss(local, target)       # the single-process loss; backward: this rank's share
        loss.backward()                     # gradients summed over their groups when it ends
        opt.step()
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
        if rank == 0:
            print(json.dumps({"step": step, "loss": loss.item(), "step_time_s": float(dt)}), flush=True)
    if rank == 0:
        steady = sorted(times[1:] or times)
        print(json.dumps({"median_step_time_s": steady[len(steady) // 2],
                          "predicted_step_time_s": plan.predicted.step_time_s}), flush=True)
    dist.destroy_process_group()
    return 0
