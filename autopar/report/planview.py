"""The printed plan (``autopar plan``, ``autopar.planner.format_plan_table``): a summary of
what was decided and what was priced, then one row per layer with the routine ones folded.

Summary (``summary_lines``), every figure read from the plan itself: the model, mesh and
batch; the decompositions used and on how many layers; the predicted step time with the
data-parallel plan's prediction beside it and the memory per rank; then the strategies
priced as plan.json records them (runtime: native module or op by op; graph parallelism;
rank placement; tournament trainers; padding; the machine's speed history when opted in;
pinned layers); the solver.

Fold rule (``fold_rows``): a layer is *routine* when it holds no parameter, is not pinned,
and costs less than ``FOLD_SHARE`` of the predicted step, its cost being

    layer_cost_s = fwd + bwd + gradient sync (``LayerDecision``) + the transitions into it

Each run of two or more consecutive routine layers prints as one row (``  9-27  (19 layers:
other, squeeze, binary ...)  2.1 % of step``); a lone routine layer keeps its own row.
``verbose`` prints every layer.

Imports nothing heavy: the plan is read as ``autopar.artifacts.Plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: a parameter-free layer below this share of the predicted step is folded (module docstring)
FOLD_SHARE = 0.01
#: op kinds named in a folded row before "..."
FOLD_KINDS_SHOWN = 4

_HEADER = (f"{'#':>7} {'module':<22} {'ops':<22} {'out shape':<18} {'decomposition':<18} "
           f"{'fwd ms':>8} {'bwd ms':>8} {'sync ms':>8} {'mem MiB':>8} src")


@dataclass(frozen=True)
class Fold:
    """A run of consecutive routine layers, printed as one row."""
    first: int                   # layer index of the first and the last layer of the run
    last: int
    layers: int                  # how many layers
    kinds: tuple[str, ...]       # op kinds, in order of first appearance
    choices: tuple[str, ...]     # decompositions, in order of first appearance
    cost_s: float                # sum of the layers' ``layer_cost_s``
    share: float                 # cost_s / predicted step time


def is_pinned(decision) -> bool:
    """Whether ``autopar plan --pin`` fixed this layer's decomposition (``LayerDecision.pinned``,
    the pin that took it); pinned layers are never folded and are marked."""
    return bool(getattr(decision, "pinned", False) or (getattr(decision, "extra", None) or {}).get("pinned"))


def layers_with_params(plan) -> set[int]:
    """Indices of the plan's layers with at least one parameter (from the recorded graph)."""
    return {int(lay["index"]) for lay in plan.graph_json.get("layers", ())
            if any(op.get("params") for op in lay.get("ops", ()))}


def layer_costs_s(plan) -> dict[int, float]:
    """``layer_cost_s`` of every layer (module docstring)."""
    into: dict[int, float] = {}
    for t in plan.transitions:
        into[t.dst] = into.get(t.dst, 0.0) + t.fwd_s + t.bwd_s
    return {d.layer: d.fwd_s + d.bwd_s + d.grad_sync_s + into.get(d.layer, 0.0) for d in plan.layers}


def fold_rows(plan, share: float = FOLD_SHARE) -> list:
    """The table's rows in layer order: a ``LayerDecision`` per layer shown, a ``Fold`` per run
    of two or more consecutive routine layers (module docstring)."""
    step = float(plan.predicted.step_time_s)
    params = layers_with_params(plan)
    cost = layer_costs_s(plan)

    def routine(d) -> bool:
        return (d.layer not in params and not is_pinned(d) and step > 0
                and cost[d.layer] < share * step)

    out: list = []
    run: list = []

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            kinds = tuple(dict.fromkeys(k for d in run for k in d.kinds))
            choices = tuple(dict.fromkeys(d.choice for d in run))
            c = sum(cost[d.layer] for d in run)
            out.append(Fold(run[0].layer, run[-1].layer, len(run), kinds, choices, c, c / step))
        run.clear()

    for d in plan.layers:
        if routine(d):
            run.append(d)
        else:
            flush()
            out.append(d)
    flush()
    return out


def _layer_row(r) -> str:
    src = r.source + (", pinned" if is_pinned(r) else "")
    return (f"{r.layer:>7} {(r.module or r.name)[:22]:<22} {'+'.join(r.kinds)[:22]:<22} "
            f"{str(tuple(r.out_shape))[:18]:<18} {r.choice[:18]:<18} "
            f"{r.fwd_s * 1e3:8.3f} {r.bwd_s * 1e3:8.3f} {r.grad_sync_s * 1e3:8.3f} "
            f"{r.memory_bytes / 2**20:8.2f} {src}")


def _fold_row(f: Fold) -> str:
    kinds = ", ".join(f.kinds[:FOLD_KINDS_SHOWN]) + (" ..." if len(f.kinds) > FOLD_KINDS_SHOWN else "")
    return (f"{f'{f.first}-{f.last}':>7}  ({f.layers} layers: {kinds}; {', '.join(f.choices)})  "
            f"{100 * f.share:.1f} % of step")


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.3f} ms"


def _mib(b: float | None) -> str:
    return f"{b / 2**20:.1f} MiB"


def _count_choices(plan) -> str:
    counts: dict[str, int] = {}
    for d in plan.layers:
        counts[d.choice] = counts.get(d.choice, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    shown = ", ".join(f"{c} on {n} layer{'s' if n > 1 else ''}" for c, n in ranked[:6])
    return shown + (f", {len(ranked) - 6} more" if len(ranked) > 6 else "")


def _data_parallel(plan) -> str:
    """The data-parallel plan's prediction as plan.json records it (``runtime``)."""
    rt = plan.runtime
    dp = rt.native_data_parallel_step_time_s if rt is not None else None
    step = plan.predicted.step_time_s
    if dp:
        if rt.expected == "native" and abs(dp - step) <= 1e-12 * max(dp, step):
            return f"data parallelism {_ms(dp)} (this plan)"
        if "memory limit" in rt.reason:
            return f"data parallelism {_ms(dp)} but over the memory limit"
        return f"data parallelism {_ms(dp)} ({dp / step:.2f}x this plan)"
    if rt is not None and rt.ilp_step_time_s is not None:    # compared, and no data-parallel plan
        return "no data-parallel plan (runtime below)"
    return "data parallelism not recorded in this plan"


def summary_lines(plan) -> list[str]:
    """The summary printed above the table (module docstring)."""
    m, pr, s = plan.mesh, plan.predicted, plan.solver
    search = plan.placement_search
    place = (search.chosen_name if search is not None else None) or str(m.placement_json.get("kind", "block"))
    shape = (f"{m.nodes} node{'s' if m.nodes > 1 else ''} x {m.ranks_per_node} ranks"
             if m.nodes * m.ranks_per_node == plan.world_size else
             f"{m.ranks_per_node} ranks per node of a {m.nodes}-node cluster")
    lines = [f"{plan.model.name} at world {plan.world_size} ({shape}, batch {plan.model.batch_size}): "
             f"{len(plan.layers)} layers"]
    lines.append(f"  decompositions: {_count_choices(plan)}")
    limit = s.memory_limit_bytes
    lines.append(f"  predicted step time {_ms(pr.step_time_s)}, {_data_parallel(plan)}; memory "
                 f"{_mib(pr.memory_per_rank_bytes)} per rank" + (f" (limit {_mib(limit)})" if limit else ""))
    lines.append(f"    fwd {pr.fwd_s * 1e3:.3f}, bwd {pr.bwd_s * 1e3:.3f}, exposed comm "
                 f"{pr.exposed_comm_s * 1e3:.3f}, optimizer {pr.optimizer_s * 1e3:.3f} ms")
    if plan.runtime is not None:
        lines.append(f"  runtime: {plan.runtime.expected} ({plan.runtime.reason})")
    gp = s.extra.get("graph_parallel")
    if gp:
        lines.append(f"  graph parallelism (graphs({gp.get('parts')}), whole graphs per rank): "
                     f"{gp.get('chosen')} chosen ({gp.get('why')})")
    cand = s.candidates or {}
    tried = search.tried if search is not None else ()
    solved = sum(1 for t in tried if t.solved)
    lines.append(f"  priced: {cand.get('choices', '?')} layer choices, {cand.get('pairs', '?')} transition pairs"
                 f"; placement: {place}" + (f" ({len(tried)} priced, {solved} solved)" if len(tried) > 1 else
                                           f" ({tried[0].note})" if tried and tried[0].note else ""))
    if plan.trainers is not None:
        tl = plan.trainers
        lines.append(f"  trainers: {tl.trainers} of {tl.ranks_per_trainer} ranks each (tournament training, "
                     f"a tournament every {tl.interval_steps} steps)")
    if plan.padding is not None:
        pad = plan.padding
        lines.append(f"  padding: {pad.policy}, {len(pad.buckets)} bucket(s), sampling {pad.sampling}, "
                     f"expected step {_ms(pad.expected_step_time_s)}")
    ms = plan.calibration.machine_speed or {}
    if plan.calibration.speed_factor != 1.0:
        lines.append(f"  local compute priced at this machine's usual speed, x{ms['speed_factor']} "
                     f"(--speed-history, {ms.get('history')})")
    pinned = [d for d in plan.layers if is_pinned(d)]
    if pinned:
        pins = [p for p in dict.fromkeys(str(getattr(d, "pinned", "") or "") for d in pinned) if p]
        lines.append(f"  pinned: {len(pinned)} layer{'s' if len(pinned) > 1 else ''} "
                     f"({', '.join(str(d.layer) for d in pinned[:8])}{' ...' if len(pinned) > 8 else ''})"
                     + (f" by --pin {', '.join(pins)}" if pins else ""))
    gap = "n/a" if s.gap is None else f"{s.gap:.2g}"
    lines.append(f"  solver: {s.solver} {s.status} in {s.time_s:.2f} s, gap {gap}, {s.variables} variables")
    return lines


def format_plan(plan, verbose: bool = False) -> str:
    """Summary, blank line, the layer table (folded unless ``verbose``), the transitions."""
    rows: list[str] = summary_lines(plan) + ["", _HEADER]
    items: Sequence = plan.layers if verbose else fold_rows(plan)
    for it in items:
        rows.append(_fold_row(it) if isinstance(it, Fold) else _layer_row(it))
    shown = plan.transitions if verbose else plan.transitions[:6]
    rows.append(f"transitions: {len(plan.transitions)}" + ("  " if plan.transitions else "") + ", ".join(
        f"{t.value}: {t.src_placement}->{t.dst_placement}" for t in shown)
        + (" ..." if len(shown) < len(plan.transitions) else ""))
    return "\n".join(rows)
