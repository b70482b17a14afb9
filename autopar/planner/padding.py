"""Padding as a planning decision (``autopar plan --graph-sizes``): a strategy of the level above
the plan. The model is planned at each candidate bucket's padded shape (``make_plan`` with the
model file's padding variables set), the padding chosen by its objective (the steps of an epoch,
``autopar.cost.padding.decide``), and the plan of every bucket written."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..artifacts import PaddingInfo, Plan, PlanHooks, PlanOptions, write_plan
from ..cost import padding as pad
from ..cost.graph_sizes import load_graph_sizes
from ..errors import AutoparError
from ..modelfile import load_model_file, model_env
from .load import load_calibration
from .make import make_plan

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


def make_padded_plan(model_file: str | Path, options: PlanOptions, padding: PaddingOptions,
                     hooks: PlanHooks | None = None):
    """Plan a padded GNN for the graph sizes of ``padding.sizes_path``: price the model at each
    candidate bucket's padded shape (planning it with the model file's padding variables set),
    choose the padding (``autopar.cost.padding.decide``), write the plan of the largest shape as
    ``plan.json`` with the decision under ``padding``, and the plan of every other bucket
    beside it (``bucket-N<n>-E<e>/``). Returns (PlanResult, PaddingDecision)."""
    hooks = hooks or PlanHooks()
    say = hooks.progress or (lambda s: None)
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

    def plan_at(b, opts, h):
        with model_env({env_names["nodes"]: str(b.nodes), env_names["edges"]: str(b.edges)}):
            return make_plan(model_file, opts, h)

    def price(b):
        res = plan_at(b, quiet, dataclasses.replace(hooks, profile=profile, progress=None))
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
        decision = pad.decide(sizes, price, batch, options.world_size, max_buckets=padding.max_buckets,
                              sampling=padding.sampling, steps=padding.steps, **kw)
    except ValueError as e:
        raise AutoparError(f"padding: {e}", "check --max-buckets, --bucket-sampling and --train-steps") from None
    top = decision.chosen.buckets[-1]
    main = plan_at(top, dataclasses.replace(options, batch_size=batch), hooks)
    out_dir = main.plan_path.parent if main.plan_path is not None else None
    rows, written = [], []
    for b, r in zip(decision.chosen.buckets, decision.chosen.rows):
        rel = None
        if out_dir is not None and b != top:
            sub = out_dir / f"bucket-N{b.nodes}-E{b.edges}"
            res = plan_at(b, dataclasses.replace(options, batch_size=batch, out_dir=str(sub), measure_shapes=False),
                          dataclasses.replace(hooks, profile=profile, progress=None))
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
        dj["env"] = {env_names["nodes"]: str(b.nodes), env_names["edges"]: str(b.edges)}
        return PaddingInfo.from_json(dj)

    plan = dataclasses.replace(main.plan, padding=record(top, "plan.json"))
    if main.plan_path is not None:
        write_plan(plan, main.plan_path)
    for b, res in written:
        write_plan(dataclasses.replace(res.plan, padding=record(b, "plan.json")), res.plan_path)
    return dataclasses.replace(main, plan=plan), decision
