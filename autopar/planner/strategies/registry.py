"""The plan-level strategy registry and its one chooser (the seam described in
``autopar.planner.strategies``): ``Candidate``, ``SubPlan``, ``LevelPrediction``, ``Offer``,
``JobOffer``, ``register_strategy`` / ``STRATEGIES``, the memory rule and ``choose``. A module of
its own, below the strategies that register into it, so that no strategy imports the package
whose ``__init__`` imports it (no import circle).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ...decomp import REGISTRY
from ...errors import AutoparError, InfeasiblePlan


@dataclass(frozen=True)
class SubPlan:
    """One part of a plan on a sub-mesh: the ranks it runs on, its cost table and choice."""
    ranks: tuple[int, ...]
    table: Any
    choice: tuple[int, ...]


@dataclass(frozen=True)
class LevelPrediction:
    """The prediction of a job-level candidate (several plans): ``cost_s``, the seconds the
    chooser compares, per ``per`` (the unit every candidate of its strategy shares);
    ``step_time_s`` the step its plans are predicted to take (padding: the expected step over
    the buckets; trainers: one trainer's step), for reading; ``memory_per_rank_bytes`` the
    largest of its plans' (what the memory rule holds to the limit)."""
    cost_s: float
    per: str
    step_time_s: float
    memory_per_rank_bytes: float


@dataclass(frozen=True)
class Candidate:
    """A whole plan a strategy offers: ``table`` and ``choice`` (one option index per layer of
    ``table``), its ``prediction`` (``cost.table.StepPrediction``), or why it is ``illegal``.
    ``runtime``: how it runs, "traced" (op by op) or "native" (the user's module). ``note`` is
    added to the solver's notes when it is chosen. ``parts``: per-stage sub-plans (empty: one
    plan over the whole world)."""
    strategy: str
    label: str
    prediction: Any = None
    illegal: str | None = None
    table: Any = None
    choice: tuple[int, ...] = ()
    runtime: str = "traced"
    forced: bool = False
    priority: int = 0
    note: str = ""
    parts: tuple[SubPlan, ...] = ()
    detail: Any = None            # the strategy's own priced value, for its record

    @property
    def step_time_s(self) -> float | None:
        return None if self.prediction is None else float(self.prediction.step_time_s)

    @property
    def cost_s(self) -> float | None:
        """The figure the chooser compares (module docstring): the prediction's ``cost_s``
        (job-level), else its step."""
        if self.prediction is None:
            return None
        return float(getattr(self.prediction, "cost_s", self.prediction.step_time_s))

    @property
    def memory_per_rank_bytes(self) -> float | None:
        return None if self.prediction is None else float(self.prediction.memory_per_rank_bytes)

    def to_json(self, chosen: bool) -> dict[str, Any]:
        out = {"strategy": self.strategy, "label": self.label, "step_time_s": self.step_time_s,
               "memory_per_rank_bytes": self.memory_per_rank_bytes, "illegal": self.illegal,
               "chosen": chosen}
        if isinstance(self.prediction, LevelPrediction):
            out.update({"level": "job", "cost_s": self.cost_s, "per": self.prediction.per})
        return out


@dataclass(frozen=True)
class Offer:
    """What every strategy is offered: the request (``planner.load.Request``), the loaded model
    and profile, the layer graph, and the solver's op-by-op plan (its table, solution and
    prediction) under the placement the search kept."""
    req: Any
    loaded: Any
    graph: Any
    table: Any
    solution: Any
    prediction: Any
    dp_unpinned: bool = False     # the table had a native data-parallel plan before its pins
    # ``make_plan`` itself, for a strategy that re-plans the model (pipeline stages on a
    # sub-mesh): passed in by ``planner.make``, so that no strategy imports the planner
    replan: Callable[..., Any] | None = None

    @property
    def memory_limit_bytes(self) -> float | None:
        return self.req.memory_limit_bytes


@dataclass(frozen=True)
class JobOffer:
    """What a job-level strategy is offered (``planner.above.plan_above``): the model file, the
    request's ``PlanOptions`` and ``PlanHooks``, the strategy's own options (``PaddingOptions``,
    ``TournamentOptions``), ``make_plan`` (passed in: the planner is above the registry) and
    where progress lines go."""
    model_file: Any
    options: Any
    hooks: Any
    level_options: Any
    make_plan: Callable[..., Any]
    say: Callable[[str], None] = lambda s: None

    @property
    def memory_limit_bytes(self) -> float | None:
        return self.options.memory_limit_bytes


class Strategy(Protocol):
    name: str
    priority: int
    level: str          # "plan" (the default when absent) or "job"

    def offer(self, base: Any) -> Sequence[Candidate]: ...


def level_of(strategy) -> str:
    return getattr(strategy, "level", "plan")


#: name -> strategy, in registration order
STRATEGIES: dict[str, Strategy] = {}


def register_strategy(cls):
    """Class decorator: register one instance of ``cls`` under ``cls.name``."""
    inst = cls() if isinstance(cls, type) else cls
    if not getattr(inst, "name", None) or not hasattr(inst, "offer"):
        raise TypeError(f"{cls!r}: a strategy needs a name and offer(base)")
    STRATEGIES[inst.name] = inst
    return cls


def strategy_kinds() -> dict[str, tuple[str, str]]:
    """The ``--kinds`` names that ask for a plan-level strategy, not a decomposition of each
    layer: name -> (the strategy, what listing the name asks), from each registered strategy's
    ``kinds`` (absent: none), in registration order."""
    out: dict[str, tuple[str, str]] = {}
    for s in STRATEGIES.values():
        for kind, meaning in (getattr(s, "kinds", None) or {}).items():
            out.setdefault(kind, (s.name, meaning))
    return out


class UnknownKindError(AutoparError):
    """A ``--kinds`` name (``PlanOptions.kinds``) that neither registry knows."""


def check_kinds(kinds) -> None:
    """Every name in ``kinds`` is a decomposition kind (``decomp.REGISTRY``: the cost table
    prices it per layer) or a plan-level strategy's kind (``strategy_kinds``); else
    ``UnknownKindError`` lists both sets, each strategy kind with what it asks."""
    plan_level = strategy_kinds()
    bad = [k for k in kinds or () if k not in REGISTRY and k not in plan_level]
    if bad:
        layer = ", ".join(sorted(k for k in REGISTRY if k not in plan_level))
        strat = "; ".join(f"{k} ({s} strategy: {m})" for k, (s, m) in plan_level.items())
        raise UnknownKindError(f"unknown kind(s) {bad} in --kinds; decomposition kinds (one per layer): {layer}; "
                               f"plan-level strategy kinds: {strat}",
                               "choose from these (comma-separated), or drop --kinds to consider all")


def memory_fit_bytes(memory_per_rank_bytes: float, memory_limit_bytes: float | None) -> str | None:
    """The plan-level memory rule: None when ``memory_per_rank_bytes`` fits the per-rank limit
    (no limit: always), else why not. The one place a whole plan is held to the limit (the
    solvers hold each layer choice to it inside the ILP)."""
    if memory_limit_bytes is None or memory_per_rank_bytes <= memory_limit_bytes:
        return None
    return (f"{memory_per_rank_bytes / 2**20:.2f} MiB per rank over the memory limit "
            f"{memory_limit_bytes / 2**20:.2f} MiB")


def memory_fit(prediction, memory_limit_bytes: float | None) -> str | None:
    """``memory_fit_bytes`` of a ``StepPrediction`` (None: not priced, nothing to check)."""
    if prediction is None:
        return None
    return memory_fit_bytes(float(prediction.memory_per_rank_bytes), memory_limit_bytes)


def _checked(c: Candidate, memory_limit_bytes: float | None) -> Candidate:
    if c.illegal is not None:
        return c
    if c.prediction is None:
        return dataclasses.replace(c, illegal="not priced")
    why = memory_fit(c.prediction, memory_limit_bytes)
    return c if why is None else dataclasses.replace(c, illegal=why)


def check(c: Candidate, memory_limit_bytes: float | None) -> Candidate:
    """``c`` held to the rule's first clause: illegal when unpriced or over the memory limit."""
    return _checked(c, memory_limit_bytes)


def best(cands: Sequence[Candidate]) -> Candidate | None:
    """The rule's pick among legal candidates: forced first, then the smallest ``cost_s``, then
    priority."""
    legal = [c for c in cands if c.illegal is None]
    forced = [c for c in legal if c.forced]
    pool = forced or legal
    return min(pool, key=lambda c: (0.0 if c.forced else c.cost_s, c.priority)) if pool else None


@dataclass(frozen=True)
class Choice:
    """Every candidate offered (memory-checked) and the one chosen (None: none legal and no
    fallback given)."""
    chosen: Candidate | None
    candidates: tuple[Candidate, ...]

    def others(self, strategy: str) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.strategy != strategy)


def choose(cands: Sequence[Candidate], memory_limit_bytes: float | None,
           fallback: Candidate | None = None) -> Choice:
    """Apply the rule (module docstring). ``fallback`` (the solver's own plan, which the solver
    held to the memory limit) is kept when no candidate is legal; without one, ``chosen`` is
    then None (the caller raises ``none_fits``)."""
    checked = tuple(_checked(c, memory_limit_bytes) for c in cands)
    for c in checked:
        if c.forced and c.illegal is not None:
            raise AutoparError(f"{c.label} was asked for but is illegal: {c.illegal}",
                               "plan with other --kinds or a higher --memory-limit")
    pick = best(checked)
    return Choice(pick if pick is not None else fallback, checked)


def offer_all(base) -> list[Candidate]:
    """Every plan-level strategy's candidates for ``base`` (an ``Offer``), in registration order."""
    out: list[Candidate] = []
    for s in STRATEGIES.values():
        if level_of(s) == "plan":
            out.extend(s.offer(base))
    return out


def why_none_fits(cands: Sequence[Candidate], level: str = "plan") -> list[str]:
    """One line per strategy registered at ``level`` (and any other that offered): why each of
    its candidates is illegal and the smallest memory per rank its priced candidates reach; a
    strategy that offered nothing for this request says so."""
    by: dict[str, list[Candidate]] = {}
    for c in cands:
        by.setdefault(c.strategy, []).append(c)
    names = [n for n, s in STRATEGIES.items() if level_of(s) == level] + [n for n in by if n not in STRATEGIES]
    out = []
    for name in dict.fromkeys(names):
        cs = by.get(name)
        if not cs:
            out.append(f"{name}: offered no candidate for this request")
            continue
        mems = [c.memory_per_rank_bytes for c in cs if c.memory_per_rank_bytes is not None]
        least = f" (smallest memory reached {min(mems) / 2**20:.2f} MiB per rank)" if mems else ""
        out.append(f"{name}{least}: " + "; ".join(f"{c.label}: {c.illegal or 'legal'}" for c in cs))
    return out


def none_fits(cands: Sequence[Candidate], head: str, hint: str, level: str = "plan",
              error=InfeasiblePlan) -> AutoparError:
    """The error when no candidate is legal: ``head``, then every strategy with its reasons
    (``why_none_fits``); ``error`` (default ``InfeasiblePlan``) keeps them in ``.strategies``."""
    lines = why_none_fits(cands, level)
    e = error(head + "; every strategy:\n  " + "\n  ".join(lines), hint)
    e.strategies = tuple(lines)
    return e
