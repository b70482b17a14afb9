"""Rank placement search: price and solve the plan under several placements, keep the fastest.

The cost model prices every collective on the link its ranks use, and which link that is
depends on where the logical ranks run (``autopar.decomp.rankmap``). Under block placement
(the identity) the innermost mesh axes are node-local; under local stride ``s`` the mesh axis of
logical stride ``s`` is, e.g. the sample axis of ``Channel(S, s)`` whose gradient allreduce is
the heaviest traffic of a wide layer. For SUPER's branch decompositions block placement is the
interleaved placement (each sample block's branch ranks on one node: joins intra-node) and
stride G x R the branch-contiguous one (``decomp.rankmap``). Which placement
is best depends on the plan, and the plan on the placement, so the search solves the ILP per
placement:

1. candidates: block, and each local stride ``s`` of ``candidate_strides`` (``1 < s <= W / R``,
   ``s | W``, on the ladder of prime-factor powers: at most log2(W) strides). On one node
   (``W <= R``) every placement prices the same and only block is tried;
2. one cost table per placement, all sharing one pricing memo (``ctx.cost_memo``, see
   ``decomp.base.price_once``): a choice is re-priced only where the placement moves one of its
   groups across or within nodes; transitions (an all-to-all over the world, inter-node under
   every placement) come from a cache;
3. block is solved first. Every other placement gets two bounds on how much faster it can be,
   the smaller of which counts: ``T_block - lower_bound_s`` (every layer at its cheapest
   choice, communication between layers free) and::

       gain_s <= D_s = sum over layers of max over its kept choices c of
                       sum over time terms of max(0, term_block(c) - term_s(c))

   (the step time is a max-plus expression in which each term appears at most once per path,
   so lowering the terms by d lowers it by at most sum(d). Strictly, the bound is against the
   block optimum over the same choices: pruning to ``max_candidates`` per layer happens per
   placement, and like the plan itself the search is exact over the candidates kept.) Placements are
   taken in the order of decreasing D_s; one is solved only when ``T_block - D_s`` could beat
   the best step time so far by more than ``MIN_GAIN`` (0.5 %), and at most ``MAX_SOLVED``
   (2) besides block are solved, which bounds planning time at large worlds (ResNet-50 at
   1024 ranks: 7 strides priced, at most 3 solved in all). Placements not solved are recorded with their bound
   and the reason;
4. the placement with the lowest predicted step time wins; ties keep block.

Before any of this, a profile that prices every collective alike on both link levels
(``levels_price_alike``: a single-node profile's "inter" entries copy its "intra" ones, as the
shipped CPU profile's do) settles the search without pricing: pricing reads a placement only
through the link level of its groups (``CostContext.level``), and the level reaches a price
only through ``collective_time_s`` (the same under both levels here) and the text of a gradient
all-reduce's latency signature (``cost.table.bucket_allreduce_s`` pays each signature's latency
once per bucket). Under block placement two groups with equal size, first and last rank have
one level, so their signatures are equal; under another placement they may differ, never
merge where block's differ. Every placement therefore prices every plan at least as high as
block, block's optimum is the search's optimum (ties keep block), and the other placements are
recorded as not priced, with that reason: what the full search finds too (each bound D_s is 0),
without building 8 more tables (ResNet-50 at 1024 ranks on the CPU profile: 0.7 s).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..decomp.base import CostContext
from ..decomp.rankmap import RankMap, branch_role, candidate_strides
from ..errors import PlacementError
from ..profile.profile import LEVELS, Profile

#: a placement other than the best so far is solved only if it might be this much faster
MIN_GAIN = 0.005
#: at most this many placements besides block are solved (those with the largest bounds)
MAX_SOLVED = 2
#: why a placement was not priced when the profile prices both link levels alike
ALIKE_NOTE = ("not priced: the profile prices collectives alike within and across nodes, so no "
              "placement prices a plan below block")
#: the LayerCost terms a placement can change (the optimizer step is local)
TIME_TERMS = ("fwd_compute_s", "bwd_compute_s", "fwd_comm_s", "bwd_comm_s", "grad_sync_s")


@dataclass(frozen=True)
class PlacementTrial:
    """One placement the search looked at."""

    placement: RankMap
    solved: bool
    step_time_s: float | None          # predicted step time when solved
    gain_bound_s: float                # D_s: at most this much faster than block
    note: str = ""
    block_step_time_s: float | None = None

    @property
    def step_time_at_least_s(self) -> float | None:
        """What the bound says of this placement's step time: block's minus D_s."""
        if self.block_step_time_s is None:
            return None
        return max(0.0, self.block_step_time_s - self.gain_bound_s)

    def to_json(self) -> dict[str, Any]:
        return {"placement": self.placement.to_json(), "name": str(self.placement),
                "solved": self.solved, "step_time_s": self.step_time_s,
                "gain_bound_s": self.gain_bound_s, "step_time_at_least_s": self.step_time_at_least_s,
                "note": self.note}


@dataclass
class PlacementResult:
    placement: RankMap
    table: Any
    solution: Any
    prediction: Any
    mode: str
    trials: list[PlacementTrial] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the CLI: the placement and why (and, for SUPER's branch units, whether
        it is their interleaved or branch-contiguous placement)."""
        try:
            chosen = [o.choices[i] for o, i in zip(self.table.layers, self.solution.choice)]
        except (AttributeError, TypeError):
            chosen = []
        role = branch_role(self.placement, chosen)
        name = f"{self.placement} ({role} for the branch units)" if role else str(self.placement)
        if len(self.trials) == 1:
            return f"placement: {name} ({self.trials[0].note})"
        block = self.trials[0]
        if all(t.note == ALIKE_NOTE for t in self.trials[1:]):
            return (f"placement: {name}, predicted {self.prediction.step_time_s * 1e3:.4g} ms (the profile "
                    f"prices collectives alike within and across nodes: the {len(self.trials) - 1} other "
                    f"placements price no plan below block, not priced)")
        solved = [t for t in self.trials if t.solved]
        return (f"placement: {name}, predicted {self.prediction.step_time_s * 1e3:.4g} ms "
                f"(block {block.step_time_s * 1e3:.4g} ms; {len(self.trials)} placements priced, "
                f"{len(solved)} solved: " + ", ".join(f"{t.placement} {t.step_time_s * 1e3:.4g} ms"
                                                      for t in solved) + ")")

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "chosen": self.placement.to_json(), "chosen_name": str(self.placement),
                "min_gain": MIN_GAIN, "max_solved": MAX_SOLVED, "tried": [t.to_json() for t in self.trials]}


def placements_for(mode: str | int, world: int, ranks_per_node: int) -> list[RankMap]:
    """The placements to try for ``mode``: "search", "block" or an integer local stride."""
    if isinstance(mode, int) or (isinstance(mode, str) and mode.strip().isdigit()):
        return [RankMap(world, int(mode))]
    if mode == "block":
        return [RankMap.identity(world)]
    if mode == "search":
        return [RankMap.identity(world)] + [RankMap(world, s)
                                              for s in candidate_strides(world, ranks_per_node)]
    raise PlacementError(f"unknown placement {mode!r}",
                         "use search, block, or an integer local stride that divides the world size")


def levels_price_alike(profile) -> bool:
    """True when ``profile`` prices every collective the same on both link levels: its
    ``collective_time_s`` is ``Profile``'s own (behind the pricing memo of
    ``cost.table.pricing_profile``, if any), whose only use of the level is to pick
    ``collectives[kind][level]``, and for every kind both levels hold the same group sizes
    with the same ``alpha_s`` and ``beta_s_per_byte``. Anything else (another profile class,
    a level missing, any constant differing): False, and the search prices every placement."""
    impl = getattr(profile, "_collective_impl", None) or getattr(profile, "collective_time_s", None)
    if getattr(impl, "__func__", None) is not Profile.collective_time_s:
        return False
    colls = getattr(profile, "collectives", None)
    if not isinstance(colls, dict) or not colls:
        return False

    def consts(table):
        if not isinstance(table, dict):
            return None
        try:
            return {str(p): (float(e["alpha_s"]), float(e["beta_s_per_byte"])) for p, e in table.items()}
        except (KeyError, TypeError, ValueError):
            return None

    for per_level in colls.values():
        if not isinstance(per_level, dict):
            return False
        first = consts(per_level.get(LEVELS[0]))
        if first is None or any(consts(per_level.get(lv)) != first for lv in LEVELS[1:]):
            return False
    return True


def gain_bound_s(table, base_ctx: CostContext) -> float:
    """D_s of the module docstring: the kept choices of ``table`` priced under ``base_ctx``'s
    placement (memo hits) against their price in ``table``."""
    total = 0.0
    seen: dict[tuple, float] = {}     # equal layers share their LayerCost objects (cost.table)
    for o in table.layers:
        key = tuple(map(id, o.costs))
        if key in seen:
            total += seen[key]
            continue
        best = 0.0
        for dec, c in zip(o.choices, o.costs):
            b = dec.cost(o.layer, base_ctx)
            b = table.straggle.apply(b) if table.straggle is not None else b
            d = sum(max(0.0, getattr(b, t) - getattr(c, t)) for t in TIME_TERMS)
            best = max(best, d)
        seen[key] = best
        total += best
    return total


def lower_bound_s(table) -> float:
    """A lower bound of the predicted step time of any plan over ``table``: every layer at its
    cheapest choice of forward + backward + optimizer step, transitions and gradient
    all-reduce free (``cost.table.evaluate``: step >= T_fwd + T_bwd, plus the optimizer)."""
    return sum(min(c.fwd_s + c.bwd_s + c.optim_step_s for c in o.costs) for o in table.layers)


def search_placement(ctx: CostContext, mode: str | int, build: Callable[[CostContext], Any],
                     solve: Callable[[Any], Any],
                     evaluate: Callable[[Any, list[int]], Any], settle_alike: bool = True) -> PlacementResult:
    """Plan under each placement of ``mode`` (see the module docstring); ``build(ctx)`` makes a
    cost table, ``solve(table)`` a Solution, ``evaluate(table, choice)`` a StepPrediction.
    ``settle_alike=False`` prices every placement even where the profile prices both link
    levels alike (tests compare the two)."""
    cands = placements_for(mode, ctx.world, ctx.ranks_per_node)
    label = mode if isinstance(mode, str) and not mode.strip().isdigit() else "stride"
    if len(cands) > 1 and settle_alike and levels_price_alike(ctx.profile):
        c = replace(ctx, placement=cands[0])
        table = build(c)
        sol = solve(table)
        pred = evaluate(table, sol.choice)
        t_block = pred.step_time_s
        trials = [PlacementTrial(cands[0], True, t_block, 0.0, "block placement")]
        trials += [PlacementTrial(p, False, None, 0.0, ALIKE_NOTE, t_block) for p in cands[1:]]
        return PlacementResult(cands[0], table, sol, pred, label, trials)
    if len(cands) == 1:
        c = replace(ctx, placement=cands[0])
        table = build(c)
        sol = solve(table)
        pred = evaluate(table, sol.choice)
        note = "given" if label != "search" else "one node: every placement prices the same"
        return PlacementResult(cands[0], table, sol, pred, label,
                               [PlacementTrial(cands[0], True, pred.step_time_s, 0.0, note)])
    memo: dict = {}
    base = replace(ctx, placement=cands[0], cost_memo=memo)
    table = build(base)
    sol = solve(table)
    pred = evaluate(table, sol.choice)
    best = PlacementResult(cands[0], table, sol, pred, label)
    trials = {cands[0]: PlacementTrial(cands[0], True, pred.step_time_s, 0.0, "block placement")}
    t_block = pred.step_time_s
    others = []
    for p in cands[1:]:
        tab = build(replace(base, placement=p))
        # the two bounds: no faster than block by more than D_s, nor than its lower bound
        d = min(gain_bound_s(tab, base), max(0.0, t_block - lower_bound_s(tab)))
        others.append((d, p, tab))
    n_solved = 0
    for d, p, tab in sorted(others, key=lambda x: -x[0]):
        t_best = best.prediction.step_time_s
        if t_block - d >= t_best * (1.0 - MIN_GAIN):
            trials[p] = PlacementTrial(p, False, None, d,
                                       f"not solved: at most {d * 1e3:.4g} ms faster than block "
                                       f"({t_block * 1e3:.4g} ms), not {100 * MIN_GAIN:g} % below "
                                       f"the best ({t_best * 1e3:.4g} ms)", t_block)
            continue
        if n_solved >= MAX_SOLVED:
            trials[p] = PlacementTrial(p, False, None, d,
                                       f"not solved: {MAX_SOLVED} placements with larger bounds were",
                                       t_block)
            continue
        n_solved += 1
        s = solve(tab)
        pr = evaluate(tab, s.choice)
        trials[p] = PlacementTrial(p, True, pr.step_time_s, d, "", t_block)
        if pr.step_time_s < t_best * (1.0 - 1e-9):
            best = PlacementResult(p, tab, s, pr, label)
    best.trials = [trials[p] for p in cands]
    best.table.ctx = replace(best.table.ctx, cost_memo=None, level_log=None)
    return best
