"""The planner: model file -> layer graph -> cost table -> solver -> plan-level strategies ->
plan.json + generated module, as stage functions over typed values::

    load (planner.load)  -> Loaded     model file, batch, profile on the planned cluster shape
    trace (planner.trace) -> Traced    layer graph (trace cache), vocabulary-loss output
    price (planner.price) -> Priced    cost context (batch norm, machine speed); tables pinned
    solve (planner.solve) -> Solved    the placement search's solved table
    choose (planner.choose) -> Chosen  every strategy's candidates, one rule (planner.strategies)
    build (planner.build) -> Plan      the typed plan, checked
    write (planner.write)              the generated module and plan.json, atomically

``make_plan`` (``planner.make``) strings them together; it starts no process (missing shapes are
named by ``planner.shapes``, measured only by the explicit step ``autopar plan --measure-shapes``).
Padding buckets and tournament training are job-level strategies (``planner.strategies.buckets``,
``.trainers``): ``planner.above`` re-plans through ``make_plan`` and chooses with the same rule.
"""

from __future__ import annotations

from .load import load_calibration, parse_bytes
from .above import make_padded_plan, make_tournament_plan, plan_above
from .make import PlanResult, make_plan
from .strategies.buckets import DEFAULT_PADDING_ENV, PaddingOptions, shape_price_of
from .price import batch_norm_stats
from .text import format_plan_table, format_timings
from .trace import attention_units, vocab_loss_output, vocab_loss_output_cached
from .write import default_plan_dir, rel_path

__all__ = ["DEFAULT_PADDING_ENV", "PaddingOptions", "PlanResult", "attention_units", "batch_norm_stats",
           "default_plan_dir", "format_plan_table", "format_timings", "load_calibration", "make_padded_plan",
           "make_plan", "make_tournament_plan", "parse_bytes", "plan_above", "rel_path", "shape_price_of", "vocab_loss_output",
           "vocab_loss_output_cached"]
