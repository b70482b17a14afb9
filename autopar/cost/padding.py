"""Padding as a planning decision: one global maximum against k size buckets.

A padded GNN (LBANN's CCGrid 2022 form, ``strategies/examples/gnn_pcqm4m.py``) runs every graph
of a step at one padded shape ``(N_b, E_b)`` (nodes, edges). One global maximum gives one shape
and the most padded work; k buckets give k shapes, less padded work, and each shape costs a
plan, a trace and warm-up steps once. This module is the pure part: buckets, how often each
shape runs, how much of its work is padding, and the choice. The step time of each shape comes
from the cost model (``autopar.planner.make_padded_plan`` plans the model at each shape and
passes a ``ShapePrice``); nothing here imports torch or the solver.

Buckets (``make_buckets``): for k buckets, ``N_b`` and ``E_b`` are the graph-weighted
quantiles b/k of the node count and of the edge count (b < k), and ``(N_k, E_k)`` the global
maximum; buckets nest. A graph goes to the first bucket that holds both its nodes and its
edges. ``F_b`` = fraction of graphs that fit bucket b.

Which shape a step runs (``sampling``):

* ``random`` (the default; the training is unchanged): a mini-batch of B graphs is drawn as
  usual and padded to the smallest bucket that holds all of them, so every rank runs the same
  shape. ``P_b = F_b^B - F_{b-1}^B`` (``F_0 = 0``): with large B nearly every step is the top
  bucket.
* ``grouped``: mini-batches are formed within one bucket (a bucketing sampler; this changes
  which graphs share a step, not the function of a step). ``P_b`` = fraction of graphs whose
  smallest bucket is b.

Padded work of a step at bucket b (``padded_work_fraction``)::

    waste_b = (W_edge,b * (1 - e_b / E_b) + W_node,b * (1 - n_b / N_b)) / W_b

``W_edge`` / ``W_node`` = the priced compute (forward + backward) of the layers whose tensors
run over the edge / node axis, ``W_b`` = all priced compute, ``n_b`` / ``e_b`` = the mean node
and edge counts of the graphs in such a step (random sampling: the mean over graphs that fit
bucket b, an approximation that ignores the conditioning on the batch maximum; grouped: the
mean over the graphs of bucket b).

Imbalance across ranks (``rank_imbalance``): if each rank padded its own B/P graphs to its own
bucket instead, ranks would run different shapes and the step would wait on the slowest: with
``m = B/P``, ``q_b = F_b^m - F_{b-1}^m``, ``imbalance = 1 - sum q_b T_b / sum P_b T_b`` (the
slowest rank's bucket is the batch's bucket, so the step time is the same and that fraction of
rank-time is idle). The planner therefore pads a step to one shape on all ranks; the figure
says what per-rank padding would leave idle. Zero for grouped sampling and one global maximum.

Choice (``decide``)::

    total_s(k) = steps * sum_b P_b T_b  +  sum_b (shape_setup_s + warmup_steps * T_b)

``T_b`` the priced step time at bucket b, ``steps`` the training steps the shapes are used
for (default one epoch: graphs / B), ``shape_setup_s`` a plan, trace and first-call warm-up of
one shape (ASSUMED, stated in the plan): every shape of a policy is prepared before training,
whether or not a step then runs at it. The smallest ``total_s`` wins; ties keep fewer shapes
(the planner's one chooser, ``planner.strategies``, compares the policies by it: ``decide`` here
applies the same rule for callers without the planner).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .graph_sizes import GraphSizes

SAMPLINGS = ("random", "grouped")
#: one plan + trace + first-call warm-up of a shape, seconds (ASSUMED; ``--shape-cost``)
DEFAULT_SHAPE_SETUP_S = 2.0
DEFAULT_WARMUP_STEPS = 2


@dataclass(frozen=True)
class Bucket:
    """A padded shape: every graph of a step at this bucket has ``nodes`` nodes and ``edges``
    edges after padding."""
    nodes: int
    edges: int

    def __str__(self) -> str:
        return f"N{self.nodes}/E{self.edges}"


@dataclass(frozen=True)
class ShapePrice:
    """The cost model's figures for the model planned at one padded shape (per step, per rank):
    ``step_time_s`` the predicted step; ``edge_work_s`` / ``node_work_s`` / ``other_work_s``
    the priced compute (forward + backward) of layers over the edge axis, the node axis, and
    the rest (per-graph layers: pooling output, the head)."""
    step_time_s: float
    edge_work_s: float
    node_work_s: float
    other_work_s: float
    plan: str | None = None           # where the plan of this shape was written, if it was

    @property
    def work_s(self) -> float:
        return self.edge_work_s + self.node_work_s + self.other_work_s


def _quantile(values, counts, q: float) -> int:
    """The smallest value whose graph-weighted cumulative fraction reaches ``q``."""
    total = sum(counts)
    acc = 0
    for v, c in sorted(zip(values, counts)):
        acc += c
        if acc >= q * total - 1e-9:
            return v
    return max(values)


def make_buckets(sizes: GraphSizes, k: int) -> tuple[Bucket, ...]:
    """k (or fewer, when quantiles repeat) nested buckets: bucket b pads to the graph-weighted
    b/k quantile of the node count and of the edge count; the last is the global maximum
    (module docstring)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    out: list[Bucket] = []
    for b in range(1, k + 1):
        if b == k:
            nb, eb = sizes.max_nodes, sizes.max_edges
        else:
            nb = _quantile(sizes.nodes, sizes.counts, b / k)
            eb = _quantile(sizes.edges, sizes.counts, b / k)
        if out and nb <= out[-1].nodes and eb <= out[-1].edges:
            continue
        out.append(Bucket(max(nb, out[-1].nodes if out else 0), max(eb, out[-1].edges if out else 0)))
    return tuple(out)


def fit_fractions(sizes: GraphSizes, buckets: tuple[Bucket, ...]) -> list[float]:
    """``F_b``: fraction of graphs that fit bucket b (nodes and edges)."""
    total = sizes.graphs
    return [sum(c for n, e, c in zip(sizes.nodes, sizes.edges, sizes.counts)
                if n <= b.nodes and e <= b.edges) / total for b in buckets]


def _own_bucket_fractions(sizes: GraphSizes, buckets) -> list[float]:
    F = fit_fractions(sizes, buckets)
    return [F[i] - (F[i - 1] if i else 0.0) for i in range(len(F))]


def step_fractions(sizes: GraphSizes, buckets, batch_size: int, sampling: str = "random") -> list[float]:
    """``P_b``: fraction of steps that run at bucket b (module docstring)."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    if sampling == "grouped":
        return _own_bucket_fractions(sizes, buckets)
    F = fit_fractions(sizes, buckets)
    cum = [f ** batch_size for f in F]
    return [cum[i] - (cum[i - 1] if i else 0.0) for i in range(len(cum))]


def mean_sizes(sizes: GraphSizes, buckets, sampling: str = "random") -> list[tuple[float, float]]:
    """(mean nodes, mean edges) of the graphs in a step at each bucket (module docstring)."""
    out = []
    for i, b in enumerate(buckets):
        lo = buckets[i - 1] if (i and sampling == "grouped") else None
        sel = [(n, e, c) for n, e, c in zip(sizes.nodes, sizes.edges, sizes.counts)
               if n <= b.nodes and e <= b.edges and not (lo and n <= lo.nodes and e <= lo.edges)]
        cnt = sum(c for *_, c in sel)
        out.append((sum(n * c for n, _, c in sel) / cnt, sum(e * c for _, e, c in sel) / cnt) if cnt else (0.0, 0.0))
    return out


def padded_work_fraction(price: ShapePrice, bucket: Bucket, mean_nodes: float, mean_edges: float) -> float:
    """``waste_b`` (module docstring): the fraction of the priced compute spent on padding."""
    if price.work_s <= 0:
        return 0.0
    waste = (price.edge_work_s * (1 - mean_edges / bucket.edges if bucket.edges else 0.0)
             + price.node_work_s * (1 - mean_nodes / bucket.nodes))
    return max(0.0, waste / price.work_s)


@dataclass(frozen=True)
class PaddingCandidate:
    """One padding policy priced: its buckets and, per bucket, the fraction of steps, the
    predicted step time, the padded fractions of nodes, edges and work."""
    k: int
    sampling: str
    buckets: tuple[Bucket, ...]
    rows: tuple[Mapping[str, Any], ...]
    expected_step_time_s: float
    padded_work_fraction: float
    rank_imbalance: float
    distinct_shapes: int
    shape_cost_s: float
    total_s: float

    @property
    def policy(self) -> str:
        return "global_max" if len(self.buckets) == 1 else f"{len(self.buckets)}_buckets"

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "k": self.k, "sampling": self.sampling,
                "buckets": [dict(r) for r in self.rows],
                "expected_step_time_s": self.expected_step_time_s,
                "padded_work_fraction": self.padded_work_fraction, "rank_imbalance": self.rank_imbalance,
                "distinct_shapes": self.distinct_shapes, "shape_cost_s": self.shape_cost_s,
                "total_s": self.total_s}


def price_candidate(sizes: GraphSizes, buckets: tuple[Bucket, ...], prices: Mapping[Bucket, ShapePrice],
                    batch_size: int, world_size: int, steps: int, sampling: str = "random",
                    shape_setup_s: float = DEFAULT_SHAPE_SETUP_S,
                    warmup_steps: int = DEFAULT_WARMUP_STEPS, k: int | None = None) -> PaddingCandidate:
    """Price one bucketing (module docstring: ``P_b``, ``waste_b``, imbalance, ``total_s``)."""
    P = step_fractions(sizes, buckets, batch_size, sampling)
    means = mean_sizes(sizes, buckets, sampling)
    own = _own_bucket_fractions(sizes, buckets)
    T = [prices[b].step_time_s for b in buckets]
    rows = []
    shape_cost = 0.0
    for b, p, (mn, me), g, t in zip(buckets, P, means, own, T):
        pr = prices[b]
        waste = padded_work_fraction(pr, b, mn, me)
        # every shape of the policy is planned and warmed up before training, used or not
        shape_cost += shape_setup_s + warmup_steps * t
        rows.append({"nodes": b.nodes, "edges": b.edges, "graph_fraction": g, "step_fraction": p,
                     "step_time_s": t, "mean_nodes": mn, "mean_edges": me,
                     "padded_node_fraction": 1 - mn / b.nodes,
                     "padded_edge_fraction": (1 - me / b.edges) if b.edges else 0.0,
                     "padded_work_fraction": waste, "plan": pr.plan})
    expected = sum(p * t for p, t in zip(P, T))
    work = sum(p * prices[b].work_s for p, b in zip(P, buckets))
    waste_all = (sum(p * prices[b].work_s * r["padded_work_fraction"] for p, b, r in zip(P, buckets, rows))
                 / work) if work > 0 else 0.0
    imbalance = 0.0
    if sampling == "random" and len(buckets) > 1 and expected > 0:
        m = max(1, math.ceil(batch_size / max(1, world_size)))
        F = fit_fractions(sizes, buckets)
        cum = [f ** m for f in F]
        q = [cum[i] - (cum[i - 1] if i else 0.0) for i in range(len(cum))]
        imbalance = max(0.0, 1 - sum(qi * t for qi, t in zip(q, T)) / expected)
    return PaddingCandidate(k=k if k is not None else len(buckets), sampling=sampling, buckets=buckets,
                            rows=tuple(rows), expected_step_time_s=expected, padded_work_fraction=waste_all,
                            rank_imbalance=imbalance, distinct_shapes=len(buckets), shape_cost_s=shape_cost,
                            total_s=steps * expected + shape_cost)


@dataclass(frozen=True)
class PaddingDecision:
    """The choice and every candidate priced (what ``plan.json`` records under ``padding``)."""
    chosen: PaddingCandidate
    candidates: tuple[PaddingCandidate, ...]
    steps: int
    batch_size: int
    shape_setup_s: float
    warmup_steps: int
    sizes_source: str
    graphs: int
    notes: tuple[str, ...] = field(default=())

    def sampling_str(self) -> str:
        return f"{self.chosen.sampling} sampling"

    def to_json(self) -> dict[str, Any]:
        c = self.chosen
        return {"policy": c.policy, "sampling": c.sampling,
                "buckets": [dict(r) for r in c.rows],
                "expected_step_time_s": c.expected_step_time_s,
                "padded_work_fraction": c.padded_work_fraction, "rank_imbalance": c.rank_imbalance,
                "distinct_shapes": c.distinct_shapes, "steps": self.steps, "batch_size": self.batch_size,
                "shape_setup_s": self.shape_setup_s,
                "shape_setup_source": "ASSUMED: one plan, trace and first-call warm-up per shape (--shape-cost)",
                "warmup_steps": self.warmup_steps,
                "graph_sizes": {"source": self.sizes_source, "graphs": self.graphs},
                "candidates": [x.to_json() for x in self.candidates], "notes": list(self.notes)}


def candidate_buckets(sizes: GraphSizes, max_buckets: int) -> dict[int, tuple[Bucket, ...]]:
    """k -> buckets for k = 1..max_buckets (distinct bucketings only; k = 1 is the global max)."""
    out: dict[int, tuple[Bucket, ...]] = {}
    for k in range(1, max(1, max_buckets) + 1):
        b = make_buckets(sizes, k)
        if b not in out.values():
            out[k] = b
    return out


def price_policies(sizes: GraphSizes, price_shape: Callable[[Bucket], ShapePrice], batch_size: int,
                   world_size: int, max_buckets: int = 4, sampling: str = "random", steps: int | None = None,
                   shape_setup_s: float = DEFAULT_SHAPE_SETUP_S,
                   warmup_steps: int = DEFAULT_WARMUP_STEPS) -> tuple[tuple[PaddingCandidate, ...], int]:
    """(every policy priced: the global maximum and k = 2..max_buckets buckets, the steps they
    are priced for). ``price_shape`` is called once per distinct bucket. The choice is the
    planner's (``planner.strategies.buckets``: the smallest ``total_s``, ties to fewer shapes)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    steps = steps if steps is not None else max(1, math.ceil(sizes.graphs / batch_size))
    prices: dict[Bucket, ShapePrice] = {}
    cands = []
    for k, buckets in candidate_buckets(sizes, max_buckets).items():
        for b in buckets:
            if b not in prices:
                prices[b] = price_shape(b)
        cands.append(price_candidate(sizes, buckets, prices, batch_size, world_size, steps, sampling,
                                     shape_setup_s, warmup_steps, k=k))
    return tuple(cands), steps


def decision(sizes: GraphSizes, cands: tuple[PaddingCandidate, ...], chosen: PaddingCandidate, steps: int,
             batch_size: int, sampling: str = "random", shape_setup_s: float = DEFAULT_SHAPE_SETUP_S,
             warmup_steps: int = DEFAULT_WARMUP_STEPS) -> PaddingDecision:
    """The ``PaddingDecision`` of ``chosen`` among ``cands``, with its notes."""
    notes = []
    if sampling == "random" and len(chosen.buckets) == 1 and len(cands) > 1:
        notes.append(f"with random mini-batches of {batch_size} graphs, a step is at the top bucket "
                     f"{100 * cands[-1].rows[-1]['step_fraction']:.1f} % of the time "
                     f"({len(cands[-1].buckets)} buckets): buckets save little; grouped sampling "
                     f"(--bucket-sampling grouped) forms batches within a bucket")
    return PaddingDecision(chosen=chosen, candidates=tuple(cands), steps=steps, batch_size=batch_size,
                           shape_setup_s=shape_setup_s, warmup_steps=warmup_steps,
                           sizes_source=sizes.source, graphs=sizes.graphs, notes=tuple(notes))


def decide(sizes: GraphSizes, price_shape: Callable[[Bucket], ShapePrice], batch_size: int,
           world_size: int, max_buckets: int = 4, sampling: str = "random", steps: int | None = None,
           shape_setup_s: float = DEFAULT_SHAPE_SETUP_S,
           warmup_steps: int = DEFAULT_WARMUP_STEPS) -> PaddingDecision:
    """``price_policies``, then the smallest ``total_s`` (ties: fewer shapes), the rule the
    planner's chooser applies (``planner.strategies``: smallest ``cost_s``, then priority = the
    distinct shapes); for callers without the planner (tests, benchmarks of this module)."""
    cands, steps = price_policies(sizes, price_shape, batch_size, world_size, max_buckets, sampling, steps,
                                  shape_setup_s, warmup_steps)
    chosen = min(cands, key=lambda c: (c.total_s, c.distinct_shapes))
    return decision(sizes, cands, chosen, steps, batch_size, sampling, shape_setup_s, warmup_steps)


def format_decision(d: "PaddingDecision") -> str:
    """The printed summary: every candidate, then the choice and its predicted waste per bucket."""
    L = [f"padding ({d.graphs} graphs from {d.sizes_source}; batch {d.batch_size}, {d.sampling_str()}, "
         f"{d.steps} steps, {d.shape_setup_s:g} s + {d.warmup_steps} warm-up steps per shape):",
         f"  {'k':>2} {'policy':<12} {'buckets (nodes/edges)':<36} {'E[step] ms':>10} {'padded':>7} {'imbal.':>7} "
         f"{'shapes':>6} {'total s':>10}"]
    for c in d.candidates:
        mark = "*" if c is d.chosen else " "
        L.append(f"{mark} {c.k:>2} {c.policy:<12} {' '.join(str(b) for b in c.buckets)[:36]:<36} "
                 f"{c.expected_step_time_s * 1e3:10.3f} {100 * c.padded_work_fraction:6.1f}% "
                 f"{100 * c.rank_imbalance:6.1f}% {c.distinct_shapes:6d} {c.total_s:10.3f}")
    L.append(f"  chosen: {d.chosen.policy}; per bucket:")
    for r in d.chosen.rows:
        L.append(f"    N{r['nodes']}/E{r['edges']}: {100 * r['graph_fraction']:.1f} % of graphs, "
                 f"{100 * r['step_fraction']:.1f} % of steps, step {r['step_time_s'] * 1e3:.3f} ms, padded "
                 f"nodes {100 * r['padded_node_fraction']:.1f} %, edges {100 * r['padded_edge_fraction']:.1f} %, "
                 f"work {100 * r['padded_work_fraction']:.1f} %")
    L += [f"  note: {n}" for n in d.notes]
    return "\n".join(L)
