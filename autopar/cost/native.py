"""Which runtime a plan will get, and the native data-parallel plan as a priced alternative.

A plan whose every layer is ``sample(P)`` over the whole world, or computed from constants and
weights only (``decomp.ir.batch_free_layers``: position ids and their embedding, masks),
runs the user's own module on each rank (``runtime.native``); any other plan runs its traced
program op by op, which costs ``traced_gap`` more per op than the module does
(``calibrate.traced_gap``, measured per calibration). The layer prices of the cost table are
the same for both (they include the op-by-op runtime's own per-op work, ``runtime_op``), so::

    T_native = T(choice with each layer's compute less n_ops(layer) * traced_gap * slowdown)
    T_traced = T(choice)

(``T``: ``cost.table.evaluate``, the ILP's step model; ``n_ops`` counts the layer's ops that
its price charges per-op runtime work, i.e. all but views, which are priced free.) The ILP prices
layers alone and cannot see this plan-wide discount, so after it (``choose_runtime``) the native
data-parallel assignment (``sample(P)`` everywhere, batch-free layers ``replicate``) is priced
and taken when it fits the memory limit and ``T_native(dp) <= T_traced(ILP plan)``: a user who
would otherwise train with DDP never gets a plan the model itself says is slower than DDP's.
Runtime choices that the native path may still refuse at run time (a buffer updated in forward,
global batch-norm statistics, an output whose block differs; ``runtime.native.why_not_native``)
are the runtime's to report; the plan records what the planner expected (``plan.json`` key
``runtime``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RuntimeChoice:
    """The plan's expected runtime and the comparison that chose it."""
    choice: list[int]                   # one option index per layer (the table's order)
    runtime: str                        # "native" or "traced"
    step_time_s: float                  # predicted step of ``choice`` on that runtime
    ilp_step_time_s: float              # the ILP's plan, priced as the ILP prices it
    native_dp_step_time_s: float | None  # the native data-parallel plan (None: no such plan)
    traced_gap_s: float                 # per op, as the profile measured it
    n_ops: int
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"expected": self.runtime, "step_time_s": self.step_time_s,
                "ilp_step_time_s": self.ilp_step_time_s,
                "native_data_parallel_step_time_s": self.native_dp_step_time_s,
                "traced_gap_per_op_s": self.traced_gap_s, "ops": self.n_ops, "reason": self.reason}


def native_choice(table) -> list[int] | None:
    """The pure data-parallel assignment of ``table``: per layer the option ``sample(P)`` over
    the whole world, or ``replicate`` for a batch-free layer; None when a layer has neither."""
    from ..decomp.ir import batch_free_layers
    world = table.ctx.world
    if world <= 1:
        return None
    free = batch_free_layers(table.graph)
    out = []
    for lay, o in zip(table.graph.layers, table.layers):
        want = "replicate" if lay.index in free else "sample"
        idx = [i for i, d in enumerate(o.choices)
               if d.kind == want and (want == "replicate" or getattr(d, "parts", None) == world)]
        if not idx:
            return None
        out.append(idx[0])
    return out


def runs_native(table, choice: list[int]) -> bool:
    """True when ``choice`` is the native data-parallel assignment (module docstring)."""
    nat = native_choice(table)
    return nat is not None and list(nat) == list(choice)


def choose_runtime(table, choice: list[int], evaluate, memory_limit_bytes: float | None) -> tuple[RuntimeChoice, Any]:
    """(the runtime decision, the StepPrediction of its choice) for the ILP's ``choice``
    (module docstring); ``evaluate`` is ``cost.table.evaluate``."""
    from ..calibrate.traced_gap import traced_gap_s
    from .primitives import compute_drift, straggler
    ctx = table.ctx
    prof = ctx.profile
    gap = traced_gap_s(prof)
    slow = prof.slowdown(ctx.ranks_on_node) * (1.0 + straggler(prof, ctx.ranks_on_node) if ctx.world > 1 else 1.0) \
        * compute_drift(prof, ctx.ranks_on_node)
    n_ops = sum(_priced_ops(lay) for lay in table.graph.layers)
    ilp_pred = evaluate(table, choice)
    nat = native_choice(table)
    if nat is not None and list(nat) == list(choice):
        pred = _native_prediction(table, choice, evaluate, gap, slow)
        return RuntimeChoice(list(choice), "native", pred.step_time_s, ilp_pred.step_time_s,
                             pred.step_time_s, gap, n_ops,
                             "the ILP's plan is pure data parallelism: it runs the user's module"), pred
    if nat is None:
        return RuntimeChoice(list(choice), "traced", ilp_pred.step_time_s, ilp_pred.step_time_s, None, gap,
                             n_ops, "no native data-parallel plan: some layer cannot take sample over the "
                                    "whole world"), ilp_pred
    nat_pred = _native_prediction(table, nat, evaluate, gap, slow)
    fits = memory_limit_bytes is None or nat_pred.memory_per_rank_bytes <= memory_limit_bytes
    if fits and nat_pred.step_time_s <= ilp_pred.step_time_s:
        return RuntimeChoice(list(nat), "native", nat_pred.step_time_s, ilp_pred.step_time_s,
                             nat_pred.step_time_s, gap, n_ops,
                             f"native data parallelism ({nat_pred.step_time_s * 1e3:.3f} ms, {n_ops} ops "
                             f"without the op-by-op runtime's {gap * 1e6:.1f} us each) beats the ILP's "
                             f"op-by-op plan ({ilp_pred.step_time_s * 1e3:.3f} ms)"), nat_pred
    why = ("does not fit the memory limit" if not fits else
           f"is slower ({nat_pred.step_time_s * 1e3:.3f} ms vs {ilp_pred.step_time_s * 1e3:.3f} ms)")
    return RuntimeChoice(list(choice), "traced", ilp_pred.step_time_s, ilp_pred.step_time_s,
                         nat_pred.step_time_s, gap, n_ops,
                         f"the native data-parallel plan {why}"), ilp_pred


def _priced_ops(layer) -> int:
    """Ops of ``layer`` that the layer price charges the runtime's per-op work (views are
    priced free, ``cost.primitives``: there is nothing of theirs to take back)."""
    from ..ops import family_of
    return sum(1 for op in layer.ops if not family_of(op.kind).free)


def _native_prediction(table, choice: list[int], evaluate, gap_s: float, slow: float):
    """``evaluate`` of ``choice`` with every layer's compute less its ops' op-by-op gap (a third
    forward, two thirds backward, as ``runtime_op`` is priced): the same step model, so the
    gradient all-reduces' overlap is recomputed, not assumed."""
    import dataclasses
    layers = list(table.layers)
    for l, (lay, ci) in enumerate(zip(table.graph.layers, choice)):
        o = layers[l]
        d = _priced_ops(lay) * gap_s * slow
        c = o.costs[ci]
        c2 = dataclasses.replace(c, fwd_compute_s=max(0.0, c.fwd_compute_s - d / 3.0),
                                 bwd_compute_s=max(0.0, c.bwd_compute_s - 2.0 * d / 3.0))
        costs = list(o.costs)
        costs[ci] = c2
        layers[l] = dataclasses.replace(o, costs=costs)
    return evaluate(dataclasses.replace(table, layers=layers), choice)
