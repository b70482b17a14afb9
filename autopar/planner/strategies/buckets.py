"""Padding buckets as a job-level strategy (``autopar plan --graph-sizes``): a padded GNN
planned at each candidate bucket's padded shape (``make_plan`` with the model file's padding
variables set), each padding policy (one global maximum, k buckets) a candidate priced by
``autopar.cost.padding`` and chosen by the one chooser (``planner.strategies.choose``):

* ``cost_s`` = the policy's ``total_s``: steps x the expected step over its buckets + every
  shape's setup and warm-up (``cost.padding``'s objective, the seconds of the training the
  shapes serve);
* memory = the largest of its buckets' plans' predicted memory per rank (held to the limit by
  the chooser's rule; each bucket's plan was already solved under it);
* priority = its distinct shapes (ties keep fewer shapes).

``realize`` writes the plan of the largest shape as ``plan.json`` with the decision under
``padding`` and every policy priced first in its ``strategies`` list, and the plan of every
other bucket beside it (``bucket-N<n>-E<e>/``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...artifacts import PaddingInfo, Plan, PlanHooks, StrategyAlternative, write_plan
from ...cost import padding as pad
from ...cost.graph_sizes import load_graph_sizes
from ...errors import AutoparError
from ...modelfile import load_model_file, model_env
from ..load import load_calibration
from .registry import Candidate, LevelPrediction, register_strategy

NAME = "padding_buckets"
PER = "the whole training: steps x expected step + shape setup"

#: the environment variables a padded GNN model file reads its padded node / edge counts from
#: (``strategies/examples/gnn_pcqm4m.py``); a model file may name others in ``PADDING_ENV``
DEFAULT_PADDING_ENV = {"nodes": "AUTOPAR_GNN_NODES", "edges": "AUTOPAR_GNN_EDGES"}


@dataclass(frozen=True)
class PaddingOptions:
    """``--graph-sizes`` and its knobs (``autopar.cost.padding``): at most ``max_buckets``
    buckets, ``sampling`` "random" or "grouped", ``steps`` training steps (None: one epoch),
    ``shape_setup_s`` per distinct shape (ASSUMED), ``warmup_steps`` per distinct shape."""
    sizes_path: str
    max_buckets: int = 4
    sampling: str = "random"
    steps: int | None = None
    shape_setup_s: float | None = None
    warmup_steps: int | None = None


def shape_price_of(plan: Plan, nodes: int, edges: int, plan_file: str | None = None):
    """``ShapePrice`` of a plan made at padded shape (nodes, edges): its predicted step, and the
    priced compute of its layers split by the axis their output runs over (dim 1: ``edges`` ->
    edge axis; ``nodes`` or ``nodes + 1``, the padded extra node -> node axis; else other)."""
    edge = node = other = 0.0
    for d in plan.layers:
        w = d.predicted.compute_s
        dim1 = d.out_shape[1] if len(d.out_shape) > 1 else None
        if dim1 == edges:
            edge += w
        elif dim1 in (nodes, nodes + 1):
            node += w
        else:
            other += w
    return pad.ShapePrice(plan.predicted.step_time_s, edge, node, other, plan_file)


@dataclass(frozen=True)
class _Priced:
    """What every policy of one offer shares (kept in each candidate's ``detail``)."""
    sizes: Any
    env_names: dict
    batch: int
    profile: Any
    steps: int
    kw: dict
    plans: dict               # Bucket -> PlanResult at its padded shape (not written)
    policies: tuple           # every PaddingCandidate, in pricing order


@register_strategy
class PaddingBuckets:
    name = NAME
    priority = 0
    level = "job"
    cli_flag = "--graph-sizes"      # the ``autopar plan`` option that asks for this level

    def _plan_at(self, job, b, env_names, opts, hooks):
        with model_env({env_names["nodes"]: str(b.nodes), env_names["edges"]: str(b.edges)}):
            return job.make_plan(job.model_file, opts, hooks)

    def offer(self, job):
        padding, options, hooks, say = job.level_options, job.options, job.hooks, job.say
        model_file = job.model_file
        sizes = load_graph_sizes(padding.sizes_path)
        mf = load_model_file(model_file, lazy=True)
        env_names = dict(DEFAULT_PADDING_ENV)
        try:
            env_names.update(getattr(mf.module, "PADDING_ENV", None) or {})
        except Exception:  # noqa: BLE001 - a model file without it uses the default names
            pass
        batch = options.batch_size or mf.default_batch_size() or max(8, options.world_size)
        profile = hooks.profile
        if profile is None:
            _, profile = load_calibration(options.calibration)
        quiet = dataclasses.replace(options, write=False, out_dir=None, measure_shapes=False, batch_size=batch)
        plans: dict = {}

        def price(b):
            res = self._plan_at(job, b, env_names, quiet, dataclasses.replace(hooks, profile=profile, progress=None))
            if not any(len(d.out_shape) > 1 and d.out_shape[1] == b.edges for d in res.plan.layers):
                raise AutoparError(
                    f"{Path(model_file).name} planned at {b.nodes} nodes / {b.edges} edges has no layer over "
                    f"{b.edges} edges: it does not read its padded sizes from {env_names['nodes']} / "
                    f"{env_names['edges']}",
                    "read NODES / EDGES from those variables in the model file (as strategies/examples/"
                    "gnn_pcqm4m.py does), or name yours in PADDING_ENV = {'nodes': ..., 'edges': ...}")
            plans[b] = res
            p = shape_price_of(res.plan, b.nodes, b.edges)
            say(f"  priced padded shape {b}: step {p.step_time_s * 1e3:.3f} ms")
            return p

        kw = {}
        if padding.shape_setup_s is not None:
            kw["shape_setup_s"] = padding.shape_setup_s
        if padding.warmup_steps is not None:
            kw["warmup_steps"] = padding.warmup_steps
        say(f"padding: {sizes.graphs} graphs from {sizes.source} (at most {sizes.max_nodes} nodes, "
            f"{sizes.max_edges} edges); pricing the global maximum and up to {padding.max_buckets} buckets")
        try:
            policies, steps = pad.price_policies(sizes, price, batch, options.world_size,
                                                 max_buckets=padding.max_buckets, sampling=padding.sampling,
                                                 steps=padding.steps, **kw)
        except ValueError as e:
            raise AutoparError(f"padding: {e}", "check --max-buckets, --bucket-sampling and --train-steps") from None
        shared = _Priced(sizes, env_names, batch, profile, steps, kw, plans, policies)
        out = []
        for c in policies:
            mem = max(plans[b].plan.predicted.memory_per_rank_bytes for b in c.buckets)
            label = f"{c.policy} ({' '.join(str(b) for b in c.buckets)}, {c.sampling} sampling)"
            out.append(Candidate(NAME, label, LevelPrediction(c.total_s, PER, c.expected_step_time_s, mem),
                                 runtime="plan", priority=c.distinct_shapes, detail=(c, shared)))
        return tuple(out)

    def realize(self, job, choice):
        """Write the chosen policy's plans; (PlanResult of the largest shape, PaddingDecision)."""
        options, hooks, padding = job.options, job.hooks, job.level_options
        chosen, sh = choice.chosen.detail
        dec_kw = {k: sh.kw[k] for k in ("shape_setup_s", "warmup_steps") if k in sh.kw}
        decision = pad.decision(sh.sizes, sh.policies, chosen, sh.steps, sh.batch, padding.sampling, **dec_kw)
        alts = tuple(StrategyAlternative.from_json(c.to_json(c is choice.chosen)) for c in choice.candidates)
        top = decision.chosen.buckets[-1]
        main = self._plan_at(job, top, sh.env_names, dataclasses.replace(options, batch_size=sh.batch), hooks)
        out_dir = main.plan_path.parent if main.plan_path is not None else None
        rows, written = [], []
        for b, r in zip(decision.chosen.buckets, decision.chosen.rows):
            rel = None
            if out_dir is not None and b != top:
                sub = out_dir / f"bucket-N{b.nodes}-E{b.edges}"
                res = self._plan_at(job, b, sh.env_names,
                                    dataclasses.replace(options, batch_size=sh.batch, out_dir=str(sub),
                                                        measure_shapes=False),
                                    dataclasses.replace(hooks or PlanHooks(), profile=sh.profile, progress=None))
                written.append((b, res))
                rel = f"{sub.name}/plan.json"
            rows.append({**r, "plan": rel if b != top else "plan.json"})

        def record(b, plan_rel: str) -> PaddingInfo:
            """The decision as plan.json records it in the plan of bucket ``b`` (paths relative to
            that plan; ``env``: the padded sizes its model is imported with, ``Plan.model_env``)."""
            dj = decision.to_json()
            up = "" if b == top else "../"
            dj["buckets"] = [{**r, "plan": (up + r["plan"]) if r["plan"] else None} for r in rows]
            dj["this_bucket"] = {"nodes": b.nodes, "edges": b.edges, "plan": plan_rel}
            dj["env"] = {sh.env_names["nodes"]: str(b.nodes), sh.env_names["edges"]: str(b.edges)}
            return PaddingInfo.from_json(dj)

        def with_level(plan: Plan, b) -> Plan:
            return dataclasses.replace(plan, padding=record(b, "plan.json"), strategies=alts + tuple(plan.strategies))

        plan = with_level(main.plan, top)
        if main.plan_path is not None:
            write_plan(plan, main.plan_path)
        for b, res in written:
            write_plan(with_level(res.plan, b), res.plan_path)
        return dataclasses.replace(main, plan=plan), decision
