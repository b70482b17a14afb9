"""Which exact local shapes a model's plans need measured (issue: exact-shape kernel cache).

Pricing every candidate decomposition of every layer asks the profile for the local
convolution and linear shapes it would run; recording those requests gives exactly the set to
measure. ``autopar calibrate --model M`` and ``autopar plan --exact`` measure them into the
profile, after which the cost model prefers them to the fitted curves and ``plan.json`` says
per layer which source priced it ("exact", "fit" or "mixed").
"""

from __future__ import annotations

from pathlib import Path

from ..decomp.base import CostContext
from ..modelfile import load_model_file
from ..profile.keys import op_key, shape_key
from ..profile.schema import COLLECTIVES, OP_CLASSES, PROFILE_SCHEMA
from ..profile.profile import Profile
from ..trace.cache import trace_cached
from .table import build_cost_table


def exact_specs_for_model(model: str | Path, world_size: int, batch_size: int | None = None,
                          ranks_per_node: int | None = None, profile=None,
                          kinds: list[str] | None = None) -> list[dict]:
    if profile is None:
        profile = _neutral_profile()
    mf = load_model_file(model)
    batch = batch_size or mf.default_batch_size() or max(8, world_size)
    graph, _ = trace_cached(mf, batch)
    log: list[dict] = []
    ctx = CostContext(profile=profile, world=world_size,
                      ranks_per_node=ranks_per_node or world_size, batch_size=batch,
                      prefer_exact=False, spec_log=log)
    build_cost_table(graph, ctx, kinds=kinds, prune=False)
    seen: dict[str, dict] = {}
    for spec in log:
        seen.setdefault(op_key(spec) if spec["op"] == "generic" else shape_key(spec), spec)
    return list(seen.values())


def _neutral_profile():
    """Round numbers: which shapes are asked for does not depend on the timings (pricing runs
    unpruned), so enumeration needs no calibrated profile."""
    kernels = {c: {"t0_s": 1e-6, "s_per_flop": 1e-10, "s_per_byte": 1e-10} for c in OP_CLASSES}
    coll = {k: {lvl: {"2": {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9}} for lvl in ("intra", "inter")}
            for k in COLLECTIVES}
    return Profile(schema=PROFILE_SCHEMA, fingerprint={}, provenance={"kind": "neutral"},
                   topology={"ranks_per_node": 1, "nodes": 1}, kernels=kernels, collectives=coll)
