"""Stage 3, price: the cost context (batch-norm statistics, machine speed, the profile as priced)
and the maker of cost tables, which pins the layers the request fixes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..artifacts import PlanOptions
from ..cost.native import native_choice
from ..cost.table import build_cost_table, pricing_profile
from ..decomp import REGISTRY
from ..decomp.base import CostContext
from ..decomp.bn import BatchNormStats, resolve
from ..decomp.ir import BATCH_NORM
from ..errors import AutoparError
from ..pins import pin_table, resolve as resolve_pins
from ..profile.history import usual_speed
from .load import Loaded, Request
from .trace import Traced


@dataclass(frozen=True)
class Priced:
    """The cost context every table of this plan is priced in, and how it was set."""
    ctx: CostContext
    bn: BatchNormStats
    machine: Any                # ``profile.history.MachineSpeed`` or None (priced as measured)
    machine_why: str

    def speed_json(self) -> dict[str, Any]:
        if self.machine is not None:
            return self.machine.to_json()
        return {"speed_factor": 1.0, "not_applied": self.machine_why}


def batch_norm_stats(o: PlanOptions, graph, batch_size: int, world_size: int) -> BatchNormStats:
    """The plan's batch-norm statistics (``decomp.bn``) from ``--batch-norm`` / ``--bn-group``;
    a named error (the first training batch norm) when the group does not divide the batch."""
    try:
        return resolve(o.batch_norm, o.bn_group, batch_size, world_size)
    except ValueError as e:
        bns = [(lay, op) for lay in graph.layers for op in lay.ops
               if op.kind == BATCH_NORM and op.attrs.get("training", True)]
        if not bns:     # no batch norm: the choice changes nothing
            return BatchNormStats("global")
        lay, op = bns[0]
        raise AutoparError(f"batch norm {getattr(op, 'module', None) or lay.module or lay.name} ({op.name}): {e}",
                           "give a --bn-group that divides the samples every rank holds, or --batch-norm global") from None


def price(loaded: Loaded, traced: Traced, req: Request) -> Priced:
    """The cost context; says which batch-norm statistics and machine speed it prices."""
    o, world, batch = req.options, req.world, loaded.batch_size
    bn = batch_norm_stats(o, traced.graph, batch, world)
    if bn.local:
        req.say(f"batch-norm statistics: local, per group of {bn.group} samples (what torch DDP computes)")
    elif o.batch_norm == "local":
        req.say(f"batch-norm statistics: global (batch {batch} does not split evenly over {world} "
                f"ranks, so no per-rank group exists; --bn-group G chooses local groups)")
    machine, why = None, "off (the default; --speed-history opts in)"
    if o.speed_history:
        machine, why = usual_speed(loaded.profile)
    if machine is not None:
        req.say(f"machine speed: the probe usually reads {machine.usual_probe_s * 1e3:.2f} ms here "
                f"({machine.events} readings), the profile's kernels were measured at "
                f"{machine.profile_nominal_s * 1e3:.2f} ms: local compute priced at "
                f"{machine.priced_at_s * 1e3:.2f} ms between them, x{machine.factor:.3f}")
    ctx = CostContext(profile=pricing_profile(loaded.profile), world=world, ranks_per_node=loaded.ranks_per_node,
                      optimizer_state_per_param=o.optimizer_state_per_param, batch_size=batch,
                      max_candidates=o.max_candidates, batch_norm=bn,
                      speed_factor=machine.factor if machine is not None else 1.0,
                      loss_output=traced.loss_output)
    return Priced(ctx, bn, machine, why)


@dataclass
class TableMaker:
    """``make(ctx)``: the cost table of one placement, pinned as the request says. Keeps what
    each table took to price (``tables_s``) and, per table, the pins applied and whether a
    native data-parallel plan existed before pinning (for the runtime's reason)."""
    graph: Any
    req: Request
    tables_s: list[float] = field(default_factory=list)
    pin_marks: dict[int, dict[int, str]] = field(default_factory=dict)   # id(table) -> {layer: pin}
    dp_unpinned: dict[int, bool] = field(default_factory=dict)           # id(table) -> native plan before pins

    def make(self, ctx: CostContext):
        t = time.perf_counter()
        req, kinds = self.req, list(self.req.table_kinds) if self.req.table_kinds else None
        # transitions are priced when a table is solved (most placements are only bounded)
        tab = build_cost_table(self.graph, ctx, kinds=kinds, choice_filter=req.choice_filter, edges=False)
        if req.layer_pins:
            # pins choose among every legal candidate, also those pruned for price: the pinned
            # layers' options come from the unpruned table, the others' are as unpinned
            full = build_cost_table(self.graph, ctx, kinds=kinds, prune=False, choice_filter=req.choice_filter,
                                    edges=False)
            self.dp_unpinned[id(tab)] = native_choice(tab) is not None
            self.pin_marks[id(tab)] = pin_table(tab, full, resolve_pins(req.layer_pins, full, REGISTRY, kinds))
        if req.force:
            force_choices(tab, req.force)
        self.tables_s.append(time.perf_counter() - t)
        return tab


def force_choices(table, force: dict[int, str]) -> None:
    """Keep only the forced choice of each layer in ``force`` (a test hook: index -> choice or kind)."""
    for li, want in force.items():
        o = table.layers[li]
        idx = [i for i, d in enumerate(o.choices) if str(d) == want or d.kind == want]
        if not idx:
            why = (o.illegal or {}).get(want)
            raise AutoparError(f"layer {li}: {want} is not a legal (kept) choice"
                               + (f" ({why})" if why else "") + f"; choices: {[str(d) for d in o.choices]}",
                               "pick one of the listed choices")
        keep = idx[0]
        o.choices, o.costs = [o.choices[keep]], [o.costs[keep]]
        if o.exact_keys:
            o.exact_keys = [o.exact_keys[keep]]
        for e in table.edges or ():
            if e.src == li:
                e.fwd_s, e.bwd_s = [e.fwd_s[keep]], [e.bwd_s[keep]]
            if e.dst == li:
                e.fwd_s = [[row[keep]] for row in e.fwd_s]
                e.bwd_s = [[row[keep]] for row in e.bwd_s]
