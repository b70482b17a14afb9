"""Exact-shape pricing of every op: the specs a model's plans ask for, their keys, their
measurement, and the cost model preferring them (plan.json says which source priced a layer)."""

import copy

from autopar.calibrate.exact_ops import measure_ops
from autopar.profile.keys import op_key
from autopar.cost.exact import exact_specs_for_model


def test_specs_cover_convs_linears_and_other_ops(root):
    specs = exact_specs_for_model(root / "strategies/examples/resnet2d.py", 2, 8)
    kinds = {s["op"] for s in specs}
    assert kinds == {"conv", "linear", "generic"}
    generic = [s for s in specs if s["op"] == "generic"]
    assert {s["kind"] for s in generic} >= {"batch_norm", "pool", "unary", "binary"}
    # local shapes: sample(2) halves the batch of 8
    assert any(s["in_shapes"][0][0] == 4 for s in generic)
    assert len({op_key(s) for s in generic}) == len(generic)


def test_measured_ops_are_preferred_and_reported(root, profile):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    model = root / "strategies/examples/resnet2d.py"
    specs = [s for s in exact_specs_for_model(model, 2, 8) if s["op"] == "generic"]
    measured = measure_ops(specs[:6], repeats=2, warmup=1)
    assert all(v["fwd"] > 0 and v["bwd_data"] >= 0 for v in measured.values())
    prof = copy.deepcopy(profile)
    # pretend every generic op takes 1 s: layers made of them must now be priced "exact"
    for s in specs:
        prof.exact[op_key(s)] = {"fwd": 1.0, "bwd_data": 1.0}
    r = make_plan(model, PlanOptions(world_size=2, batch_size=8, write=False, kinds=["sample"]),
                  PlanHooks(profile=prof))
    srcs = {l.module or l.name: l.source for l in r.plan.layers}
    assert srcs["pool"] == "exact"                      # a max-pool layer: all its ops measured
    assert srcs["stem.0"] == "mixed"                    # conv from the fit, bn + relu exact
    pool = next(l for l in r.plan.layers if l.module == "pool")
    assert pool.predicted.fwd_compute_s >= 1.0
