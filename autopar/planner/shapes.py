"""Missing shapes: the competitive local convolution and linear shapes of a solved plan that the
profile (and the shape file read with it) lacks, named, never measured here.

Planning starts no process. Measuring them is a step of its own, before planning: ``autopar plan
--measure-shapes`` (``autopar.calibrate.shapes_step``: measures into ``PROFILE-shapes.json`` and
plans with it, recorded in plan.json) or ``autopar calibrate --model MODEL.py`` (into the
profile). Only a profile measured on this machine, at a world it measured, can gain shapes here
(``profile.shapes.can_measure``); for any other the list is empty."""

from __future__ import annotations

from ..decomp.base import CostContext
from ..profile.keys import shape_key
from ..profile.shapes import can_measure

#: a kept choice whose time is within this factor of its layer's fastest is competitive
COMPETITIVE = 1.25


def competitive_specs(table, choice, ratio: float = COMPETITIVE) -> list[dict]:
    """Conv/linear shape specs of each layer's chosen decomposition and of every kept choice
    within ``ratio`` of the layer's fastest (priced again with a spec log; no memo)."""
    ctx = table.ctx
    log: list[dict] = []
    c2 = CostContext(profile=ctx.profile, world=ctx.world, ranks_per_node=ctx.ranks_per_node,
                     optimizer_state_per_param=ctx.optimizer_state_per_param,
                     batch_size=ctx.batch_size, max_candidates=ctx.max_candidates,
                     spec_log=log, placement=ctx.placement)
    seen_layers: set = set()
    for o, ci in zip(table.layers, choice):
        key = tuple(map(id, o.costs))
        if key in seen_layers:            # equal layers share their costs (cost.table)
            continue
        seen_layers.add(key)
        times = [c.fwd_s + c.bwd_s + c.grad_sync_s for c in o.costs]
        best = min(times)
        for i, d in enumerate(o.choices):
            if i == ci or times[i] <= ratio * best:
                d.cost(o.layer, c2)
    out: dict[str, dict] = {}
    for s in log:
        if s.get("op") in ("conv", "linear"):
            out.setdefault(shape_key(s), s)
    return list(out.values())


def missing_shapes(loaded, solved, hooks, req) -> tuple[str, ...]:
    """Shape keys of the solver's plan's competitive candidates the profile lacks, where this
    machine could measure them (else empty); says how to measure them."""
    if hooks.profile is not None or loaded.cal_path is None:
        return ()
    if can_measure(loaded.profile, req.world) is not None:
        return ()
    placed = solved.placed
    keys = tuple(shape_key(s) for s in competitive_specs(placed.table, placed.solution.choice)
                 if shape_key(s) not in loaded.profile.exact)
    if keys:
        req.say(f"exact shapes: {len(keys)} competitive local shape(s) are priced by the generic model "
                f"(the profile{' and its shape file' if loaded.shapes else ''} lack them): "
                + ", ".join(keys[:4]) + (" ..." if len(keys) > 4 else "")
                + "; measure them first with --measure-shapes (autopar plan), or autopar calibrate --model")
    return keys
