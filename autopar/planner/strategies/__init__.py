"""Plan-level strategies behind one seam.

A strategy is a module that offers candidates for a whole plan, each with the cost model's
prediction or the reason it is illegal (``Candidate``). The ILP chooses one decomposition per
layer; a strategy works a level above it. ``choose`` applies ONE rule to every candidate, of
either level:

1. a candidate whose predicted memory per rank exceeds the limit is illegal (``memory_fit``:
   the only place the memory limit is checked at plan level);
2. a candidate the request forces (``--kinds graphs``, ``--pin '*=graphs'``) wins when legal;
3. otherwise the smallest ``cost_s`` wins (the candidate's predicted seconds per the unit its
   strategy's candidates share: a training step for plan-level candidates), ties going to the
   lower ``priority``.

When no candidate is legal, ``none_fits`` names every strategy registered at that level with
why each candidate was illegal and the smallest memory per rank its candidates reach
(``InfeasiblePlan``).

Two levels (``Strategy.level``):

* ``"plan"``: offered for the solver's table by ``planner.choose`` on every ``make_plan``
  (``Offer``): ``op_by_op`` (the ILP's plan, run op by op), ``native`` (the user's module under
  data parallelism), ``graphs`` (whole graphs per rank), ``sharded`` (FSDP2), ``stages``
  (pipeline stages on sub-meshes). Priorities: native 0 < op_by_op 1 < graphs, sharded 2 <
  stages 3. ``cost_s`` is the predicted step.
* ``"job"``: offered by ``planner.above.plan_above`` when the request asks for it
  (``JobOffer``), each candidate several plans made by ``make_plan`` (passed in, never
  imported: no import circle): ``padding_buckets`` (``--graph-sizes``: one plan per padded
  bucket; ``cost_s`` = the whole training's seconds, steps x expected step + shape setup;
  priority = distinct shapes) and ``trainers`` (``--trainers``: one trainer plan per trainer
  count; ``cost_s`` = 1 / predicted samples per second of the job; priority = trainers).
  Their ``prediction`` is a ``LevelPrediction``.

plan.json lists every candidate priced (``strategies``: name, label, prediction, why illegal,
which was chosen; job-level ones first, with ``level``, ``cost_s`` and ``per``).

Adding one: a module with a class that has ``name``, ``priority`` and ``offer(base) ->
Sequence[Candidate]`` (optionally ``record(base, choice) -> dict`` for what plan.json keeps about
it, and ``kinds``: the names ``--kinds`` accepts for it, name -> what listing it asks, which
``planner.load`` keeps out of the cost table's decomposition kinds: ``strategy_kinds``), decorated with ``register_strategy``, plus one import line (below, or in the caller for a
strategy kept outside autopar: ``tests/toys/toy_strategy.py``). A candidate holds its cost
table and one choice per layer; ``runtime`` says how its plan runs (``execute.runner``'s table
of executors is keyed by it: "native", "traced", "fsdp", "stages", "tournament"); ``parts`` is
for strategies whose plan is several sub-plans on sub-meshes: one ``SubPlan`` per stage with its
ranks, table and choice. A job-level strategy sets ``level = "job"``, offers from a
``JobOffer`` and has ``realize(job, choice)`` (writes the chosen plans, returns the caller's
result), optionally ``refuse(job, choice)`` (raises its own named error when none is legal),
and ``cli_flag``: the ``autopar plan`` option that asks for it (the CLI's job-level planners are
keyed by strategy name and found through it).
"""

from __future__ import annotations

from .registry import (  # noqa: F401  (the registry's public names, importable from here)
    Candidate, Choice, JobOffer, LevelPrediction, Offer, STRATEGIES, Strategy, SubPlan,
    UnknownKindError, best, check, check_kinds, choose, level_of, memory_fit, memory_fit_bytes,
    none_fits, offer_all, register_strategy, strategy_kinds, why_none_fits)

# the built-in strategies (one import line each)
from . import op_by_op, native, graphs  # noqa: F401
from . import sharded  # noqa: F401
from . import stages  # noqa: F401
from . import buckets, trainers  # noqa: F401  (job level)
