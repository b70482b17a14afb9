"""``autopar explain PLAN LAYER``: why one layer of a plan got its decomposition.

plan.json keeps, per layer, the candidates the solver saw with their total time and memory
(``layers[].alternatives``) but not their forward / backward / communication split nor the
transitions each would need. ``explain`` therefore prices them again, as ``make_plan`` did and
without starting a process (``reprice``): the plan's recorded layer graph (no tracing), its
calibration profile (``calibration.path``, with the on-demand shape cache it recorded when that
is still here), mesh, placement, batch, batch-norm statistics, speed factor, and its planning
options (``options``: kinds, candidate cap, optimizer state); a plan made before plan.json kept
its options is re-priced with the kinds of its recorded candidates and the default optimizer
state. The re-priced totals are then
held against the recorded ones: a plan whose profile (or shape cache) changed since says so,
and its recorded totals are printed beside today's prices.

For each candidate ``i`` of the layer (``explain_layer``):

    own_s        = fwd + bwd (compute and exposed communication) + gradient all-reduce
    transitions_s = sum over the edges into and out of the layer, every neighbour at its
                   planned choice, of the transition's fwd + bwd
    step_s       = ``cost.table.evaluate`` of the plan with only this layer swapped to ``i``

and whether that swap is allowed: within the memory limit (``solver.memory_limit_bytes``) and
holding a tied parameter (GPT-2's wte / lm_head) as the other layers that use it do
(``cost.table.tied_choice_sets``). The chosen candidate wins when its ``step_s`` is the lowest
of the allowed swaps; the report says by how much against the runner-up and how the difference
splits into the layer's own cost, its transitions and the rest of the step (gradient-sync
overlap, optimizer). When a swap prices lower, the plan-level reason is named where the plan
records one (the native runtime's data-parallel plan, a plan-level graph-parallel choice, a
solver gap, a pinned layer, a changed profile).

Only a plan file is read; a missing profile falls back to the recorded totals.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import AutoparError
from .artifacts import load_plan
from .cost.table import build_cost_table, evaluate, pricing_profile, tied_choice_sets
from .decomp import REGISTRY, decomposition_from_json  # noqa: F401  (registers every kind)
from .decomp.base import CostContext
from .planner.load import with_shapes
from .profile import load_profile
from .profile.shapes import cache_path, load_cache

#: a re-priced total within this relative difference of the recorded one matches
MATCH_RTOL = 1e-6


@dataclass(frozen=True)
class Candidate:
    """One candidate of the layer, priced (seconds, bytes per rank)."""
    choice: str
    fwd_compute_s: float
    bwd_compute_s: float
    comm_s: float                  # exposed fwd + bwd communication of the layer itself
    grad_sync_s: float
    memory_bytes: float
    transitions_s: float | None    # None: not re-priced
    step_s: float | None           # the plan's step with this layer swapped; None: not re-priced
    plan_memory_bytes: float | None
    recorded_s: float | None       # the plan's recorded total for it (None: not recorded)
    blocked: str = ""              # why the solver could not take it ("" if it could)
    chosen: bool = False

    @property
    def own_s(self) -> float:
        return self.fwd_compute_s + self.bwd_compute_s + self.comm_s + self.grad_sync_s


@dataclass(frozen=True)
class Explanation:
    layer: int
    name: str
    module: str
    kinds: tuple[str, ...]
    out_shape: tuple[int, ...]
    chosen: str
    candidates: tuple[Candidate, ...]
    illegal: dict
    neighbours: tuple[str, ...]     # "in <- 28 ln_1: sample(4)" lines
    source: str                     # where the prices come from
    plan_matches: bool              # every layer of the plan re-priced as plan.json recorded it
    notes: tuple[str, ...]          # mismatches, plan-level choices
    why: str


# ---- finding the layer -------------------------------------------------------------------------

def find_layer(plan, text: str) -> int:
    """The layer index that ``text`` names: an index, a layer name, or a module with one layer.
    A name the plan lacks is an ``AutoparError`` listing the nearest (``difflib``)."""
    names = {d.name: d.layer for d in plan.layers}
    t = str(text).strip()
    if t.lstrip("-").isdigit():
        i = int(t)
        if any(d.layer == i for d in plan.layers):
            return i
        lo, hi = min(names.values()), max(names.values())
        raise AutoparError(f"layer {i} is not in the plan (its layers are {lo}..{hi})",
                           "give an index in that range, or a layer or module name (`autopar plan --verbose` lists them)")
    if t in names:
        return names[t]
    by_module = [d for d in plan.layers if d.module == t]
    if len(by_module) == 1:
        return by_module[0].layer
    if by_module:
        listed = ", ".join(f"{d.layer} ({d.name}: {'+'.join(d.kinds)})" for d in by_module[:8])
        raise AutoparError(f"module {t!r} has {len(by_module)} layers: {listed}"
                           + (" ..." if len(by_module) > 8 else ""), "give one of their indices or names")
    pool = list(names) + sorted({d.module for d in plan.layers if d.module})
    near = difflib.get_close_matches(t, pool, n=6, cutoff=0.3)
    raise AutoparError(f"no layer or module named {t!r} in the plan" +
                       (f"; nearest: {', '.join(near)}" if near else ""),
                       "give a layer index, a layer name or a module name (`autopar plan --verbose` lists them)")


# ---- re-pricing ----------------------------------------------------------------------------------

def _profile_path(plan, plan_path: Path) -> Path | None:
    """The plan's profile: its recorded path as given (the folder ``autopar plan`` ran in), else
    relative to the plan's folder or one of its parents (a repository's root)."""
    rec = plan.calibration.path
    if not rec:
        return None
    p = Path(rec)
    if p.is_absolute():
        return p if p.is_file() else None
    if p.is_file():
        return p
    for base in Path(plan_path).resolve().parents:
        if (base / p).is_file():
            return base / p
    return None


def _loss_output(plan) -> str | None:
    """The graph's output when the plan priced the vocabulary-parallel loss (a ``vocab_head``
    candidate on the output layer), as ``planner.vocab_loss_output`` decided at plan time."""
    out = plan.graph_json.get("output")
    for d in plan.layers:
        seen = [a.choice for a in d.alternatives] + list(d.illegal)
        if any(str(c).startswith("vocab_head") for c in seen):
            return out
    return None


def _kinds(plan) -> list[str] | None:
    """The decomposition kinds of every recorded candidate (``--kinds`` as planned); None when
    the plan records no candidates."""
    kinds = set()
    for d in plan.layers:
        for a in d.alternatives:
            kinds.add(a.choice.split("(")[0])
    kinds = {k for k in kinds if k in REGISTRY}
    return sorted(kinds) if kinds else None


def reprice(plan, plan_path: str | Path):
    """(the cost table ``make_plan`` solved, re-built from the plan's record, or None, and where
    its prices come from or why they could not be re-computed). Starts no process."""
    path = _profile_path(plan, Path(plan_path))
    if path is None:
        return None, (f"the plan's profile {plan.calibration.path!r} is not here: the recorded "
                      "totals only (no forward / backward / communication split, no transitions)")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = load_profile(path, check_machine=False)
    src = f"re-priced with {path}"
    shapes = plan.calibration.shapes or {}
    sod = plan.calibration.shapes_on_demand or {}
    if shapes.get("path"):                    # the shape file the plan was made with (--shapes)
        try:
            profile, used = with_shapes(profile, shapes["path"])
            src += (f" and its shape file {used.path}" + ("" if used.sha256 == shapes.get("sha256") else
                                                          " (changed since the plan was made)"))
        except AutoparError as e:
            src += f" without its shape file ({e})"
    elif sod.get("cached"):
        cached, why = load_cache(cache_path(path), profile.fingerprint)
        if cached and not why:
            profile = replace(profile, exact={**cached, **profile.exact})
            src += f" and its shape cache ({len(cached)} shapes; {sod['cached']} when planned)"
        else:
            src += f" without its shape cache ({sod['cached']} shapes when planned, none here)"
    m = plan.mesh
    profile = profile.with_topology(m.ranks_per_node, m.nodes)
    opts = getattr(plan, "options", None)      # recorded since plans carry their PlanOptions
    if opts is not None:
        kinds = [k for k in opts.kinds if k != "graphs"] or None if opts.kinds else None
        cap, state = opts.max_candidates, opts.optimizer_state_per_param
    else:                                      # older plans: what their candidates show
        kinds, cap, state = _kinds(plan), int(plan.solver.max_candidates_per_layer or 8), 1.0
    ctx = CostContext(profile=pricing_profile(profile), world=m.world_size, ranks_per_node=m.ranks_per_node,
                      batch_size=plan.model.batch_size, max_candidates=cap, optimizer_state_per_param=state,
                      placement=plan.placement(), batch_norm=plan.bn_stats(),
                      speed_factor=plan.calibration.speed_factor, loss_output=_loss_output(plan))
    graph = plan.graph()
    table = build_cost_table(graph, ctx, kinds=kinds, edges=False)
    # a pinned layer (``autopar.pins``) may hold a candidate pruned for price: add it back
    missing = [k for k, o in enumerate(table.layers)
               if plan.layer(o.layer.index).choice not in {str(c) for c in o.choices}]
    if missing:
        full = build_cost_table(graph, ctx, kinds=kinds, prune=False, edges=False)
        layers = list(table.layers)
        for k in missing:
            f, want = full.layers[k], plan.layer(full.layers[k].layer.index).choice
            idx = [i for i, c in enumerate(f.choices) if str(c) == want]
            if idx:
                o = layers[k]
                layers[k] = replace(o, choices=list(o.choices) + [f.choices[idx[0]]],
                                    costs=list(o.costs) + [f.costs[idx[0]]],
                                    exact_keys=list(o.exact_keys) + [f.exact_keys[idx[0]]] if o.exact_keys else [])
        table.layers = layers
    return table.ensure_edges(), src


def stale_layers(plan, table, choice: list[int]) -> list[int]:
    """The layers whose re-priced planned choice differs from the price plan.json recorded
    (fwd, bwd, gradient sync and memory); [] when the whole plan re-prices as made."""
    out = []
    for k, o in enumerate(table.layers):
        d, c = plan.layer(o.layer.index), o.costs[choice[k]]
        if not all(math.isclose(a, b, rel_tol=MATCH_RTOL, abs_tol=1e-12) for a, b in
                   ((c.fwd_s, d.fwd_s), (c.bwd_s, d.bwd_s), (c.grad_sync_s, d.grad_sync_s),
                    (c.memory_bytes, d.memory_bytes))):
            out.append(o.layer.index)
    return out


# ---- the explanation -----------------------------------------------------------------------------

def _tie_blocked(table, choice: list[int], li: int) -> dict[int, str]:
    """{candidate of layer ``li``: why it breaks a tied parameter} against the plan's other layers."""
    out: dict[int, str] = {}
    for q, ways in tied_choice_sets(table):
        if not any(li in w for w in ways):
            continue
        others = [w for w in ways if all(choice[m] in w[m] for m in w if m != li)]
        ok = {i for w in others for i in w.get(li, [])}
        partners = sorted({m for w in ways for m in w if m != li})
        for i in range(len(table.layers[li].choices)):
            if i not in ok:
                out[i] = (f"holds the tied parameter {q} differently from layer"
                          f"{'s' if len(partners) > 1 else ''} {', '.join(map(str, partners))}")
    return out


def explain_layer(plan, plan_path: str | Path, layer: str | int) -> Explanation:
    """The explanation of one layer (module docstring)."""
    li = find_layer(plan, str(layer))
    d = plan.layer(li)
    recorded = {a.choice: a.time_s for a in d.alternatives}
    notes: list[str] = list(_stage_notes(plan, d, li))
    gp = plan.solver.extra.get("graph_parallel") or {}
    if str(gp.get("chosen", "")).startswith("graphs"):
        notes.append(f"plan-level choice: {gp['chosen']} (whole graphs per rank, the user's module run natively) "
                     f"over the best op-by-op plan: {gp.get('why')}; every layer takes it, so there is no "
                     "per-layer choice to compare")
        table, source = None, "the totals plan.json recorded (a plan-level graph-parallel choice)"
    else:
        try:
            table, source = reprice(plan, plan_path)
        except AutoparError as e:
            table, source = None, f"the totals plan.json recorded (re-pricing failed: {e})"
    choice: list[int] | None = None
    if table is not None:
        try:
            choice = [[str(c) for c in o.choices].index(plan.layer(o.layer.index).choice) for o in table.layers]
        except ValueError:
            bad = [o.layer.index for o in table.layers if plan.layer(o.layer.index).choice not in [str(c) for c in o.choices]]
            notes.append(f"re-priced, layer{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad[:6]))} no longer "
                         f"keep{'s' if len(bad) == 1 else ''} the planned choice among their candidates: "
                         "the step with a swap is not computed")
    cands: list[Candidate] = []
    if table is None:
        for a in d.alternatives:
            cands.append(Candidate(a.choice, math.nan, math.nan, math.nan, math.nan, a.memory_bytes,
                                   None, None, None, a.time_s, chosen=a.choice == d.choice))
        why = (f"{d.choice} is the plan-level graph-parallel choice (note above)" if gp.get("chosen", "").startswith("graphs")
               else _why_recorded(d, cands, plan))
        return Explanation(li, d.name, d.module, tuple(d.kinds), tuple(d.out_shape), d.choice, tuple(cands),
                           dict(d.illegal), (), source, False, tuple(notes), why)
    o = table.layers[li]
    limit = plan.solver.memory_limit_bytes
    blocked = _tie_blocked(table, choice, li) if choice is not None else {}
    edges = [e for e in table.edges if li in (e.src, e.dst)]
    neighbours = []
    if choice is not None:
        for e in edges:
            other = e.src if e.dst == li else e.dst
            od = plan.layer(other)
            neighbours.append(f"{'in  <-' if e.dst == li else 'out ->'} {other} {od.module or od.name} "
                              f"({e.value}): {od.choice}")
    for i, (dec, k) in enumerate(zip(o.choices, o.costs)):
        trans = step = mem = None
        if choice is not None:
            trans = sum((e.fwd_s[i][choice[e.dst]] + e.bwd_s[i][choice[e.dst]]) if e.src == li else
                        (e.fwd_s[choice[e.src]][i] + e.bwd_s[choice[e.src]][i]) for e in edges)
            swapped = list(choice)
            swapped[li] = i
            pred = evaluate(table, swapped)
            step, mem = pred.step_time_s, pred.memory_per_rank_bytes
        why_not = blocked.get(i, "")
        if not why_not and limit is not None and mem is not None and mem > limit * (1 + 1e-12):
            why_not = f"the plan would need {mem / 2**20:.2f} MiB per rank, over the {limit / 2**20:.2f} MiB limit"
        cands.append(Candidate(str(dec), k.fwd_compute_s, k.bwd_compute_s, k.fwd_comm_s + k.bwd_comm_s,
                               k.grad_sync_s, k.memory_bytes, trans, step, mem, recorded.get(str(dec)),
                               why_not, chosen=str(dec) == d.choice))
    # do today's prices match the plan's?
    diffs = [c for c in cands if c.recorded_s is not None and
             not math.isclose(c.fwd_compute_s + c.bwd_compute_s + c.comm_s + c.grad_sync_s, c.recorded_s,
                              rel_tol=MATCH_RTOL, abs_tol=1e-12)]
    missing = sorted(set(recorded) - {c.choice for c in cands})
    if diffs or missing:
        notes.append("today's prices differ from the plan's recorded ones ("
                     + ", ".join(f"{c.choice}: {c.recorded_s * 1e3:.3f} ms recorded, {c.own_s * 1e3:.3f} today"
                                 for c in diffs[:3])
                     + (f"; not re-priced: {', '.join(missing)}" if missing else "")
                     + "): the profile or its shape cache changed since the plan was made; the comparison "
                       "below uses today's prices (re-plan to bring plan.json up to date)")
    elif recorded:
        source += "; every candidate matches the plan's recorded total"
    stale = stale_layers(plan, table, choice) if choice is not None else [-1]
    if choice is not None and stale and not (diffs or missing):
        notes.append(f"layer{'s' if len(stale) > 1 else ''} {', '.join(map(str, stale[:6]))}"
                     f"{' ...' if len(stale) > 6 else ''} re-price{'' if len(stale) > 1 else 's'} otherwise than "
                     "plan.json recorded (the profile or its shape cache changed): the step column uses today's prices")
    rt = plan.runtime
    if rt is not None and rt.expected == "native" and choice is not None:
        notes.append(f"the plan runs the user's module natively, predicted {plan.predicted.step_time_s * 1e3:.3f} ms "
                     f"({rt.reason}); the step column prices every candidate op by op, as the solver "
                     "compared them")
    why = _why(plan, d, cands, choice is not None)
    return Explanation(li, d.name, d.module, tuple(d.kinds), tuple(d.out_shape), d.choice, tuple(cands),
                       dict(o.illegal), tuple(neighbours), source, not stale, tuple(notes), why)


def _stage_notes(plan, d, li: int) -> list[str]:
    """For a plan that runs pipeline stages (plan.json ``runtime.stages``): what runs this layer
    -- its block's stage and, under a stage plan, the stage plan's choice for it -- beside the
    whole-world decision explained below (kept for comparison, not run)."""
    rt = plan.runtime
    extra = dict(rt.extra) if rt is not None else {}
    if rt is None or rt.expected != "stages" or "stages" not in extra:
        return []
    out = [f"this plan runs pipeline stages ({rt.reason}); the decision explained below is the whole-world "
           "solver's, recorded for comparison, not what runs"]
    sp = extra.get("stage_plan")
    layers = (sp or {}).get("graph", {}).get("layers") or []
    if sp and li < len(layers) and layers[li].get("name") == d.name:
        unit = sp["units"][li]
        stage = next((s for s in extra["stages"]["stages"] if s["layers"][0] <= unit < s["layers"][1]), None)
        where = f"stage {stage['index']} (ranks {stage['ranks']})" if stage else "its stage"
        out.append(f"under the stage plan (the model on {sp['world_size']} ranks per stage, one microbatch) this "
                   f"layer is {sp['choices'][li]}, run on {where}")
    return out


def _plan_level_reasons(plan, d) -> list[str]:
    """What the plan records that can keep a layer off its cheapest single swap."""
    out = []
    rt = plan.runtime
    if rt is not None and rt.expected == "native":
        out.append(f"the plan runs natively ({rt.reason}); its layers were priced op by op to compare")
    if plan.solver.gap:
        out.append(f"the solver stopped at a gap of {plan.solver.gap:.2g}")
    pin = getattr(d, "pinned", "") or (d.extra or {}).get("pinned")
    if pin:
        out.append(f"this layer was pinned (--pin {pin})" if isinstance(pin, str) else "this layer was pinned (--pin)")
    return out


def _why(plan, d, cands: list[Candidate], swapped: bool) -> str:
    chosen = next((c for c in cands if c.chosen), None)
    if chosen is None:
        return f"{d.choice} is not among today's candidates for this layer (re-plan)"
    if len(cands) == 1:
        return f"{d.choice} is the only legal candidate kept for this layer"
    if not swapped:
        best = min(cands, key=lambda c: c.own_s)
        return (f"{d.choice} costs {chosen.own_s * 1e3:.3f} ms in this layer; the cheapest candidate on its "
                f"own is {best.choice} ({best.own_s * 1e3:.3f} ms)")
    allowed = [c for c in cands if not c.blocked or c.chosen]
    others = sorted((c for c in allowed if not c.chosen), key=lambda c: c.step_s)
    lines = []
    if not others or chosen.step_s <= others[0].step_s * (1 + 1e-12):
        lines.append(f"{d.choice} gives the lowest predicted step, {chosen.step_s * 1e3:.3f} ms, of the "
                     f"{len(allowed)} candidate{'s' if len(allowed) > 1 else ''} the solver could take here, every "
                     "other layer as planned")
        if others:
            r = others[0]
            lines.append(_split(r, chosen, "the runner-up"))
    else:
        r = others[0]
        lines.append(f"{r.choice} alone would price the step {(chosen.step_s - r.step_s) * 1e3:.3f} ms lower "
                     f"({r.step_s * 1e3:.3f} against {chosen.step_s * 1e3:.3f} ms)")
        reasons = _plan_level_reasons(plan, d)
        lines.append("kept because " + "; ".join(reasons) if reasons else
                     "the plan's prices no longer match today's (see above), or the plan is not optimal here")
    faster_blocked = [c for c in cands if c.blocked and not c.chosen and c.step_s is not None
                      and c.step_s < chosen.step_s]
    for c in faster_blocked[:3]:
        lines.append(f"{c.choice} would price {c.step_s * 1e3:.3f} ms but {c.blocked}")
    return ".\n".join(lines) + "."


def _split(r: Candidate, chosen: Candidate, label: str) -> str:
    """How the runner-up's extra step time splits."""
    own = r.own_s - chosen.own_s
    tr = r.transitions_s - chosen.transitions_s
    rest = (r.step_s - chosen.step_s) - own - tr
    return (f"{label}, {r.choice}, prices {r.step_s * 1e3:.3f} ms ({_dms(r.step_s - chosen.step_s)}: "
            f"its own cost {_dms(own)}, transitions with the neighbours' choices {_dms(tr)}, "
            f"overlap of the gradient sync and the rest of the step {_dms(rest)})")


def _why_recorded(d, cands: list[Candidate], plan) -> str:
    chosen = next((c for c in cands if c.chosen), None)
    if chosen is None or chosen.recorded_s is None:
        return "the plan records no candidates for this layer"
    best = min(cands, key=lambda c: c.recorded_s)
    if best.chosen:
        return f"{d.choice} has the lowest recorded cost of this layer's {len(cands)} candidate(s)"
    return (f"{d.choice} records {chosen.recorded_s * 1e3:.3f} ms against {best.choice}'s "
            f"{best.recorded_s * 1e3:.3f} ms: the choice is made for the whole plan (transitions, "
            "gradient-sync overlap, memory), which needs the profile to re-price")


# ---- printing ------------------------------------------------------------------------------------

def _ms(x: float | None, w: int = 8) -> str:
    return f"{'-':>{w}}" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:{w}.3f}"


def _dms(x: float) -> str:
    """A difference in ms, signed, with no "-0.000"."""
    return f"{round(x * 1e3, 3) + 0.0:+.3f}"


def format_explanation(ex: Explanation) -> str:
    kinds = "+".join(dict.fromkeys(ex.kinds))
    kinds = kinds if len(kinds) <= 60 else kinds[:57] + "..."
    lines = [f"layer {ex.layer} {ex.module or ex.name} ({ex.name}: {kinds}, out {tuple(ex.out_shape)}): {ex.chosen}",
             f"prices: {ex.source}"]
    lines += [f"note: {n}" for n in ex.notes]
    if ex.neighbours:
        lines.append("neighbours as planned: " + "; ".join(ex.neighbours))
    lines.append("")
    lines.append(f"  {'candidate':<20} {'fwd ms':>8} {'bwd ms':>8} {'comm ms':>8} {'sync ms':>8} {'mem MiB':>8} "
                 f"{'trans ms':>8} {'step ms':>8} {'vs chosen':>9} {'plan ms':>8}")
    chosen = next((c for c in ex.candidates if c.chosen), None)
    for c in sorted(ex.candidates, key=lambda c: (not c.chosen, c.step_s if c.step_s is not None else
                                                   (c.recorded_s or 0.0))):
        vs = ("" if c.chosen or c.step_s is None or chosen is None or chosen.step_s is None
              else f"{_dms(c.step_s - chosen.step_s):>9}")
        lines.append(f"{'*' if c.chosen else ' '} {c.choice[:20]:<20} {_ms(c.fwd_compute_s)} {_ms(c.bwd_compute_s)} "
                     f"{_ms(c.comm_s)} {_ms(c.grad_sync_s)} {c.memory_bytes / 2**20:8.2f} {_ms(c.transitions_s)} "
                     f"{_ms(c.step_s)} {vs:>9} {_ms(c.recorded_s)}" + (f"  ({c.blocked})" if c.blocked else ""))
    lines.append("  (* chosen; comm: the layer's exposed communication; sync: its gradient all-reduce; trans: "
                 "transitions to and from the neighbours' planned choices; step: the plan's step with only this "
                 "layer swapped; plan ms: the total plan.json recorded)")
    if ex.illegal:
        shown = list(ex.illegal.items())[:4]
        lines.append("illegal here: " + "; ".join(f"{k}: {v}" for k, v in shown)
                     + (f"; {len(ex.illegal) - 4} more" if len(ex.illegal) > 4 else ""))
    lines.append("")
    lines.append("why: " + ex.why)
    return "\n".join(lines)


def explain(plan_path: str | Path, layer: str | int) -> str:
    """``autopar explain``: load the plan (an older schema migrated, one this autopar cannot
    read refused naming the field) and explain ``layer``."""
    plan = load_plan(plan_path)
    return format_explanation(explain_layer(plan, plan_path, layer))
