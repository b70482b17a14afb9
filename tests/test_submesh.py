"""Plans on disjoint sub-meshes of one world: two different plans executed at once on the two
halves of a world of 4, each equal to its own single-process reference (float64)."""

from __future__ import annotations

import importlib.util

import pytest

from autopar.runtime.comm import Comm

pytestmark = pytest.mark.dist


def test_comm_maps_mesh_ranks_to_global_ranks():
    c = Comm(1, 2, ranks=(2, 3))
    assert c.global_rank(0) == 2 and c.global_rank(1) == 3
    with pytest.raises(ValueError, match="distinct"):
        Comm(0, 2, ranks=(2, 2))
    with pytest.raises(ValueError, match="increase"):
        Comm(0, 2, ranks=(3, 2))
    with pytest.raises(ValueError, match="2 ranks"):
        Comm(0, 2, ranks=(0, 1, 2))


def _plans(root, tmp_path, profile):
    """Two different plans of two ranks each: data parallel and spatial."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.pipeline import make_plan
    model = root / "strategies/examples/resnet2d.py"
    out = []
    for name, kinds in (("sample", ["sample"]), ("spatial", ["spatial"])):
        r = make_plan(model, PlanOptions(world_size=2, batch_size=4, kinds=kinds,
                                         out_dir=tmp_path / name), PlanHooks(profile=profile))
        out.append(str(r.plan_path))
    return out


def _rank_main(rank, world, plan_paths):
    import torch

    from autopar.artifacts import load_plan
    from autopar.decomp import decomposition_from_json
    from autopar.runtime.comm import Comm, assemble, create_groups
    from autopar.runtime.entry import build_user_model, synthetic_batch
    from autopar.runtime.model import plan_partitions

    meshes = [(0, 1), (2, 3)]
    plans = [load_plan(p) for p in plan_paths]
    # every process creates every group of every plan, in one order (collective)
    groups = []
    for plan, ranks in zip(plans, meshes):
        graph = plan.graph()
        decisions = {d.layer: decomposition_from_json(d.decomposition) for d in plan.layers}
        parts = plan_partitions(graph, decisions, len(ranks))
        groups += [tuple(ranks[r] for r in g) for part in parts for g in part if 1 < len(g) < len(ranks)]
        groups.append(ranks)
    create_groups(groups)

    mine = 0 if rank < 2 else 1
    plan, path = plans[mine], plan_paths[mine]
    comm = Comm.from_env(ranks=meshes[mine])
    spec = importlib.util.spec_from_file_location(f"gen{mine}", plan.module_path(path))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    mf, model = build_user_model(plan, path, seed=0)
    model.double()
    dm = gen.PlannedModel(plan, model, comm)
    xs, ys = synthetic_batch(mf, plan.batch_size, seed=1)
    xs = [x.double() for x in xs]
    out = dm(*dm.shard_inputs(xs))
    loss = dm.local_loss(out, ys, mf.loss_fn())
    loss.backward()
    dm.finish_grads()
    full_out = assemble(out.detach(), dm.loss_layout(), dm.graph.value_shape(dm.graph.output), comm, "value")
    loss_t = comm.all_reduce_(loss.detach().clone().reshape(1))
    grads = dm.full_grads()
    # this half's own single-process reference
    torch.manual_seed(0)
    ref = mf.build_model().double()
    rout = ref(*xs)
    rloss = mf.loss_fn()(rout, ys)
    rloss.backward()
    worst = float((full_out - rout).abs().max() / rout.abs().max())
    worst = max(worst, float((loss_t[0] - rloss).abs() / rloss.abs()))
    for name, p in ref.named_parameters():
        worst = max(worst, float((grads[name] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)))
    kinds = sorted({d.decomposition["kind"] for d in plan.layers})
    return {"mesh": meshes[mine], "kinds": kinds, "worst_rel": worst}


def test_two_plans_on_two_halves_each_equal_to_its_reference(root, tmp_path, profile):
    from autopar.runtime.launch import run_ranks
    paths = _plans(root, tmp_path, profile)
    res = run_ranks(_rank_main, 4, args=(paths,), timeout_s=180)
    assert res[0]["kinds"] != res[2]["kinds"], res       # two different plans
    assert "spatial" in res[2]["kinds"] and "sample" in res[0]["kinds"]
    for r in res:
        assert r["worst_rel"] <= 1e-9, r
