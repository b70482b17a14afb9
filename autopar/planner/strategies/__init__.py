"""Plan-level strategies behind one seam.

A strategy is a module that offers candidates for a whole plan, each with the cost model's
prediction or the reason it is illegal (``Candidate``). The ILP chooses one decomposition per
layer; a strategy works a level above: run the plan natively (``native``: the user's own module
under data parallelism), whole graphs per rank (``graphs``), or anything a new module offers.
``choose`` applies ONE rule to every candidate:

1. a candidate whose predicted memory per rank exceeds the limit is illegal (``memory_fit``:
   the only place the memory limit is checked at plan level);
2. a candidate the request forces (``--kinds graphs``, ``--pin '*=graphs'``) wins when legal;
3. otherwise the fastest predicted step wins, ties going to the lower ``priority``
   (native 0 < the ILP's op-by-op plan 1 < graphs 2 < others).

plan.json lists every candidate priced (``strategies``: name, label, prediction, why illegal,
which was chosen).

Adding one: a module with a class that has ``name``, ``priority`` and ``offer(base: Offer) ->
Sequence[Candidate]`` (optionally ``record(base, choice) -> dict`` for what plan.json keeps about
it), decorated with ``register_strategy``, plus one import line. A candidate holds its cost
table and one choice per layer; ``parts`` is for strategies whose plan is several sub-plans on
sub-meshes (pipeline stages, later): one ``SubPlan`` per stage with its ranks, table and choice.
The padding buckets (``planner.padding``) and the tournament (``tournament.pricing``) are
strategies of the level above: they re-plan the model per bucket / per trainer count through
``make_plan`` and choose among those plans by their own objective (steps of an epoch, samples
per second).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from ...errors import AutoparError


@dataclass(frozen=True)
class SubPlan:
    """One part of a plan on a sub-mesh: the ranks it runs on, its cost table and choice."""
    ranks: tuple[int, ...]
    table: Any
    choice: tuple[int, ...]


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
    def memory_per_rank_bytes(self) -> float | None:
        return None if self.prediction is None else float(self.prediction.memory_per_rank_bytes)

    def to_json(self, chosen: bool) -> dict[str, Any]:
        return {"strategy": self.strategy, "label": self.label, "step_time_s": self.step_time_s,
                "memory_per_rank_bytes": self.memory_per_rank_bytes, "illegal": self.illegal,
                "chosen": chosen}


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

    @property
    def memory_limit_bytes(self) -> float | None:
        return self.req.memory_limit_bytes


class Strategy(Protocol):
    name: str
    priority: int

    def offer(self, base: Any) -> Sequence[Candidate]: ...


#: name -> strategy, in registration order
STRATEGIES: dict[str, Strategy] = {}


def register_strategy(cls):
    """Class decorator: register one instance of ``cls`` under ``cls.name``."""
    inst = cls() if isinstance(cls, type) else cls
    if not getattr(inst, "name", None) or not hasattr(inst, "offer"):
        raise TypeError(f"{cls!r}: a strategy needs a name and offer(base)")
    STRATEGIES[inst.name] = inst
    return cls


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


def best(cands: Sequence[Candidate]) -> Candidate | None:
    """The rule's pick among legal candidates: forced first, then fastest, then priority."""
    legal = [c for c in cands if c.illegal is None]
    forced = [c for c in legal if c.forced]
    pool = forced or legal
    return min(pool, key=lambda c: (0.0 if c.forced else c.step_time_s, c.priority)) if pool else None


@dataclass(frozen=True)
class Choice:
    """Every candidate offered (memory-checked) and the one chosen."""
    chosen: Candidate
    candidates: tuple[Candidate, ...]

    def others(self, strategy: str) -> tuple[Candidate, ...]:
        return tuple(c for c in self.candidates if c.strategy != strategy)


def choose(cands: Sequence[Candidate], memory_limit_bytes: float | None, fallback: Candidate) -> Choice:
    """Apply the rule (module docstring). ``fallback`` (the solver's own plan, which the solver
    held to the memory limit) is kept when no candidate is legal."""
    checked = tuple(_checked(c, memory_limit_bytes) for c in cands)
    for c in checked:
        if c.forced and c.illegal is not None:
            raise AutoparError(f"{c.label} was asked for but is illegal: {c.illegal}",
                               "plan with other --kinds or a higher --memory-limit")
    pick = best(checked)
    return Choice(pick if pick is not None else fallback, checked)


def offer_all(base) -> list[Candidate]:
    out: list[Candidate] = []
    for s in STRATEGIES.values():
        out.extend(s.offer(base))
    return out


# the built-in strategies (one import line each)
from . import op_by_op, native, graphs  # noqa: E402,F401
from . import sharded  # noqa: E402,F401
