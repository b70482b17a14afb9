"""Which runtime a plan will get, and the native data-parallel plan as a priced alternative.

A plan whose every layer is ``sample(P)`` over the whole world, or computed from constants and
weights only (``decomp.ir.batch_free_layers``: position ids and their embedding, masks), runs
the user's own module on each rank (``runtime.native``); any other plan runs its traced program
op by op. Both pay per-op runtime work beyond the kernels (dispatch, the autograd engine), the
op-by-op runtime more: the profile measures both per op family (``calibrate.overhead``:
``runtime_op``'s ``by_family`` and ``native_by_family``). The layer prices of the cost table
charge the op-by-op figures (``cost.primitives.op_compute_s``), so::

    gap(op)   = runtime_overhead_s(kind) - runtime_overhead_s(kind, native=True)
    T_native  = T(choice, every layer's compute less sum over its ops of gap(op) * slowdown)
    T_traced  = T(choice)

(``T``: ``cost.table.evaluate``, the ILP's step model, so the gradient all-reduces' overlap is
recomputed; a third of each gap in forward, two thirds in backward, as the per-op work is
priced). The ILP prices layers alone and cannot see this plan-wide difference, so after it
(``choose_runtime``) the native data-parallel assignment (``sample(P)`` everywhere, batch-free
layers ``replicate``) is priced and taken when it fits the memory limit and
``T_native(dp) <= T_traced(ILP plan)``: a user who would otherwise train with DDP never gets a
plan the model itself says is slower than DDP's. Reasons only the module can tell (a buffer
updated in forward, an output whose block differs; ``runtime.native.why_not_native``) may still
send such a plan op by op at run time, where the run says so; the plan records what the planner
expected (``plan.json`` key ``runtime``).

Both runtimes also pay a gradient reducer's own work beyond the all-reduces (a hook per
parameter tensor, each gradient copied into its bucket and back): the table prices it in every
choice that syncs gradients (``cost.table.price_grad_reducer``; measured on torch DDP's
reducer, which the native runtime uses, and charged the same to the op-by-op runtime's
``GradSync``, which does the same work in Python), so the two plans compare on it too.
``RuntimeChoice.reducer_s`` says how much of the chosen plan's step it is (``plan.json``
``runtime.grad_reducer_s``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .primitives import _compute_slowdown, overhead_shares, runtime_overhead_s
from .table import native_choice, plan_grad_reducer_s  # noqa: F401  (native_choice: the data-parallel plan this prices)


@dataclass(frozen=True)
class RuntimeChoice:
    """The plan's expected runtime and the comparison that chose it."""
    choice: list[int]                   # one option index per layer (the table's order)
    runtime: str                        # "native" or "traced"
    step_time_s: float                  # predicted step of ``choice`` on that runtime
    ilp_step_time_s: float              # the ILP's plan, priced as the ILP prices it
    native_dp_step_time_s: float | None  # the native data-parallel plan (None: no such plan)
    gap_s: float                        # op-by-op minus native per-op work, whole plan, slowest rank
    n_ops: int
    reason: str
    reducer_s: float = 0.0              # gradient reducer work in the chosen plan's step (``plan_grad_reducer_s``)

    def to_json(self) -> dict[str, Any]:
        return {"expected": self.runtime, "step_time_s": self.step_time_s,
                "ilp_step_time_s": self.ilp_step_time_s,
                "native_data_parallel_step_time_s": self.native_dp_step_time_s,
                "op_by_op_runtime_gap_s": self.gap_s, "grad_reducer_s": self.reducer_s,
                "ops": self.n_ops, "reason": self.reason}


def runs_native(table, choice: list[int]) -> bool:
    """True when ``choice`` is the native data-parallel assignment (module docstring)."""
    nat = native_choice(table)
    return nat is not None and list(nat) == list(choice)


def choose_runtime(table, choice: list[int], evaluate, memory_limit_bytes: float | None) -> tuple[RuntimeChoice, Any]:
    """(the runtime decision, the StepPrediction of its choice) for the ILP's ``choice``
    (module docstring); ``evaluate`` is ``cost.table.evaluate``."""
    gaps = layer_gaps_s(table)
    gap = sum(f + b for f, b in gaps)
    n_ops = sum(len(lay.ops) for lay in table.graph.layers)
    ilp_pred = evaluate(table, choice)
    nat = native_choice(table)
    if nat is not None and list(nat) == list(choice):
        pred = _native_prediction(table, choice, evaluate, gaps)
        return RuntimeChoice(list(choice), "native", pred.step_time_s, ilp_pred.step_time_s,
                             pred.step_time_s, gap, n_ops,
                             "the ILP's plan is pure data parallelism: it runs the user's module",
                             plan_grad_reducer_s(table, choice)), pred
    if nat is None:
        return RuntimeChoice(list(choice), "traced", ilp_pred.step_time_s, ilp_pred.step_time_s, None, gap,
                             n_ops, "no native data-parallel plan: some layer cannot take sample over the "
                                    "whole world"), ilp_pred
    nat_pred = _native_prediction(table, nat, evaluate, gaps)
    fits = memory_limit_bytes is None or nat_pred.memory_per_rank_bytes <= memory_limit_bytes
    if fits and nat_pred.step_time_s <= ilp_pred.step_time_s:
        return RuntimeChoice(list(nat), "native", nat_pred.step_time_s, ilp_pred.step_time_s,
                             nat_pred.step_time_s, gap, n_ops,
                             f"native data parallelism ({nat_pred.step_time_s * 1e3:.3f} ms: {n_ops} ops "
                             f"in the user's module, {gap * 1e3:.3f} ms less runtime work than op by op) "
                             f"beats the ILP's op-by-op plan ({ilp_pred.step_time_s * 1e3:.3f} ms)",
                             plan_grad_reducer_s(table, nat)), nat_pred
    why = ("does not fit the memory limit" if not fits else
           f"is slower ({nat_pred.step_time_s * 1e3:.3f} ms vs {ilp_pred.step_time_s * 1e3:.3f} ms)")
    return RuntimeChoice(list(choice), "traced", ilp_pred.step_time_s, ilp_pred.step_time_s,
                         nat_pred.step_time_s, gap, n_ops,
                         f"the native data-parallel plan {why}", plan_grad_reducer_s(table, choice)), ilp_pred


def layer_gaps_s(table) -> list[tuple[float, float]]:
    """Per layer: (forward, backward) seconds of per-op runtime work the op-by-op runtime pays
    beyond the native module (module docstring), on the slowest rank, in the shares
    ``op_compute_s`` charges (``primitives.overhead_shares``)."""
    prof = table.ctx.profile
    slow = _compute_slowdown(table.ctx)
    out = []
    for lay in table.graph.layers:
        f = b = 0.0
        for op in lay.ops:
            g = max(0.0, runtime_overhead_s(prof, op.kind) - runtime_overhead_s(prof, op.kind, native=True))
            sf, sb = overhead_shares(op)
            f += g * sf
            b += g * sb
        out.append((f * slow, b * slow))
    return out


def _native_prediction(table, choice: list[int], evaluate, gaps: list[tuple[float, float]]):
    """``evaluate`` of ``choice`` with every layer's compute less its gap (forward and
    backward shares, as the per-op work is priced)."""
    layers = list(table.layers)
    for l, ci in enumerate(choice):
        o, (df, db) = layers[l], gaps[l]
        if df + db <= 0.0:
            continue
        c = o.costs[ci]
        costs = list(o.costs)
        costs[ci] = dataclasses.replace(c, fwd_compute_s=max(0.0, c.fwd_compute_s - df),
                                        bwd_compute_s=max(0.0, c.bwd_compute_s - db))
        layers[l] = dataclasses.replace(o, costs=costs)
    return evaluate(dataclasses.replace(table, layers=layers), choice)
