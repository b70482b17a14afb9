"""Plan time of tournament training (LTFB): price T trainers of N/T ranks each, pick T.

A trainer is one plan (the per-layer ILP, any decomposition) on n = N/T ranks; T of them run
at once on disjoint sub-meshes. Per trainer, in seconds (every term a cost-model figure, never
measured; B = the plan's batch, I = the tournament interval in steps)::

    step_s        the trainer plan's predicted step (``plan.predicted.step_time_s``), its compute
                  (fwd + bwd) scaled by the profile's slowdown of min(T*n, R) ranks on a node
                  over min(n, R) (the plan was priced alone on the node; R ranks per node)
    ingest_s      data ingestion per step: 0 when the trainer's shard fits in its ranks' memory
                  (an in-memory data store, filled once before training); otherwise the batch
                  read from storage,  B*sample_bytes / rate + B*latency_s / n,  with
                  rate = min(nodes_of_trainer * node_read_bytes_per_s, aggregate_bytes_per_s / T)
                  (every trainer reads at once). Prefetched in the background: a step takes
                  max(step_s, ingest_s).
    exchange_s    one tournament's exchange: every rank sends its shard of the model (weights,
                  every buffer whole, and with "weights+optimizer" the optimizer state) to the
                  corresponding rank of the partner trainer and receives the partner's, both at
                  once on a full-duplex link:  p2p(state_bytes_per_rank)  on the link between
                  partners (inter-node as soon as the world spans nodes: partners are paired at
                  random), its latency raised to the profile's in-situ p2p latency with the job's
                  ranks on the node. Priced in the plan's dtype, and in each dtype a run may
                  hold the model in (``RUN_DTYPES``: ``exchange_s_float64``, ...; a run reports
                  the figures of its own dtype beside the bytes it sent)
    eval_s        2 models x ((tournament_samples / B) forwards of the plan (``predicted.fwd_s``,
                  scaled by the same slowdown) + one in-situ all-reduce latency over the trainer's
                  n ranks for the metric); one model when T = 1
    round_s       I * max(step_s, ingest_s) + exchange_s + eval_s
    samples/s     T * I * B / round_s                   (the whole job)

Memory per rank: the plan's predicted memory + one received copy of the partner's state (the
exchange buffer), ``memory_per_rank_bytes``; the planner's one chooser holds it to the limit
(``planner.strategies``: else the T is infeasible, "a trainer too small for its plan's
memory"); the data store is host memory (``data_store_bytes_per_rank``, default: the same
limit).

Which T: the planner's job-level strategy ``planner.strategies.trainers`` offers each priced T
as a candidate (``cost_s`` = 1 / samples per second, priority T) to the one chooser;
``planner.make_tournament_plan`` is the entry point. This module only prices.

What the model leaves out: the one-off filling of the data store, the random pairing's
partner landing on the same node (priced as inter-node), congestion of the storage system
beyond its aggregate rate, the metric's own reductions, and statistical efficiency (how many
samples a tournament population needs to reach an accuracy: it prices throughput only).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifacts import TOURNAMENT_EXCHANGES, Plan
from ..errors import AutoparError
from ..cost.primitives import insitu_latency_s
from ..decomp.ir import DTYPE_BYTES


class TrainersError(AutoparError):
    """--trainers that cannot run: not a divisor of the world, or trainers too small."""


class TournamentDataError(TrainersError):
    """A model file whose data the tournament cannot draw or split: its inputs are not a batch
    of samples along dim 0 (a PyG batch of concatenated graphs), or ``example_inputs`` refuses
    the data set's size."""


def check_tournament_data(mf, B: int, n: int) -> None:
    """Refuse, at plan time, a model file whose data the tournament runtime cannot use: it
    draws ``n`` samples (``make_dataset(n, seed)``, else ``example_inputs(n)``) and cuts them
    along dim 0 into shards and batches of ``B`` (``runtime.trainer_data`` / ``batch_of``), so
    every input and target of ``example_inputs(B)`` must have B rows."""
    import torch
    torch.manual_seed(0)
    xs, ys = mf.example_inputs(B), mf.example_targets(B)
    xs = list(xs) if isinstance(xs, (tuple, list)) else [xs]
    shapes = [tuple(x.shape) for x in xs] + ([tuple(ys.shape)] if ys is not None else [])
    if any(not sh or sh[0] != B for sh in shapes):
        raise TournamentDataError(
            f"{mf.name}: the tournament cuts its data set into shards and batches of {B} samples along dim 0, "
            f"but the model file's batch of {B} is not {B} rows in every input (shapes {shapes}; a PyG batch "
            f"concatenates its graphs' nodes and edges)",
            "train it without --trainers (autopar plan without the trainer level); no environment variable "
            "makes such a batch splittable by rows")
    if hasattr(mf.module, "make_dataset"):
        return
    try:
        with torch.device("meta"):
            mf.example_inputs(n), mf.example_targets(n)
        return
    except Exception:       # noqa: BLE001 - retried on real tensors: meta may not do what the file does
        pass
    try:
        mf.example_inputs(n), mf.example_targets(n)
    except Exception as e:  # noqa: BLE001 - the model file's own refusal, named
        raise TournamentDataError(
            f"{mf.name}: the tournament draws its data set of {n} samples with example_inputs({n}), which "
            f"refuses: {type(e).__name__}: {e}",
            f"give the model file make_dataset(n, seed) -> (inputs, targets) of n samples (the trainers' "
            f"batch is {B})") from None


@dataclass(frozen=True)
class IngestionModel:
    """How fast a trainer reads its data when its shard does not fit in memory. Per node client
    read rate, aggregate storage rate (shared by all trainers), per-sample latency; ``source``
    says where the numbers came from (a profile's ``storage`` section, a flag, or assumed)."""
    node_read_bytes_per_s: float = 1.0e9
    aggregate_bytes_per_s: float = 1.0e12
    per_sample_latency_s: float = 0.0
    source: str = "assumed default (1 GB/s per node, 1 TB/s aggregate): not calibrated"

    @staticmethod
    def from_profile(profile, override_bytes_per_s: float | None = None) -> "IngestionModel":
        st = dict(getattr(profile, "extra", {}) or {}).get("storage") if profile is not None else None
        if st is None and profile is not None:
            st = (getattr(profile, "provenance", {}) or {}).get("storage")
        m = IngestionModel()
        if st:
            m = IngestionModel(float(st.get("node_read_bytes_per_s", m.node_read_bytes_per_s)),
                               float(st.get("aggregate_bytes_per_s", m.aggregate_bytes_per_s)),
                               float(st.get("per_sample_latency_s", 0.0)),
                               str(st.get("source", "the profile's storage section")))
        if override_bytes_per_s is not None:
            m = dataclasses.replace(m, node_read_bytes_per_s=float(override_bytes_per_s),
                                    source="--storage-rate")
        return m


@dataclass(frozen=True)
class TournamentOptions:
    """The trainer-level knobs of ``autopar plan --trainers`` (the rest is ``PlanOptions``)."""
    trainers: int | str = 1                 # an integer or "auto"
    interval_steps: int = 10
    pairing_seed: int = 0
    exchange: str = "weights"
    metric: str | None = None               # None: "model_file" if it defines tournament_metric
    tournament_samples: int | None = None   # per trainer; default 2 batches
    train_samples_per_trainer: int | None = None   # default 8 batches
    data_seed: int = 0
    dataset_samples: int | None = None      # the whole data set (pricing); default T*(train+tour)
    sample_bytes: float | None = None       # per sample in storage; default from the model file
    data_store_bytes_per_rank: float | None = None
    ingestion: IngestionModel | None = None

    def __post_init__(self) -> None:
        if self.trainers != "auto" and (not isinstance(self.trainers, int) or self.trainers < 1):
            raise TrainersError(f"--trainers must be a positive integer or 'auto', got {self.trainers!r}",
                                "give e.g. --trainers 2 or --trainers auto")
        if self.interval_steps < 1:
            raise TrainersError(f"--interval must be >= 1 step, got {self.interval_steps}",
                                "give the number of training steps between tournaments")
        if self.exchange not in TOURNAMENT_EXCHANGES:
            raise TrainersError(f"unknown exchange {self.exchange!r}", f"choose {', '.join(TOURNAMENT_EXCHANGES)}")


# ---- per-rank state ---------------------------------------------------------------------------

#: the dtypes a tournament run may hold its model in (``autopar execute --validate-dtype``): the
#: exchange is priced in each (``price_trainers``: ``exchange_s_<dtype>`` and the figures after it)
RUN_DTYPES = ("float32", "float64")
_FLOAT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def graph_buffers(plan: Plan) -> dict[str, tuple[int, str]]:
    """Every buffer the traced graph names, (elements, dtype): a batch norm's running mean and
    variance (one per channel, in the op's dtype) and the counters of the buffer-only ops
    (``num_batches_tracked``). What ``model_buffers`` falls back on."""
    graph = plan.graph()
    out: dict[str, tuple[int, str]] = {}
    for lay in graph.layers:
        for op in lay.ops:
            for q in op.buffers.values():
                if op.kind == "batch_norm" and op.in_shapes:
                    out[q] = (int(op.in_shapes[0][1]), op.dtype)
    for op in graph.buffer_updates:
        for q in op.buffers.values():
            out.setdefault(q, (max(1, math.prod(op.out_shape)), op.dtype))
    return out


def model_buffers(mf, plan: Plan | None = None) -> dict[str, tuple[int, str]]:
    """Every buffer of the model file's model (what a run's exchange sends), (elements, dtype),
    from a build on the meta device (nothing allocated); the graph's (``graph_buffers``) when
    the model cannot be built there."""
    import torch
    try:
        with torch.device("meta"):
            m = mf.build_model()
        return {q: (int(b.numel()), str(b.dtype).removeprefix("torch.")) for q, b in m.named_buffers()}
    except Exception:   # a model file that cannot build on meta: the buffers the trace names
        return graph_buffers(plan) if plan is not None else {}


def state_bytes_per_rank(plan: Plan, exchange: str = "weights", optimizer_state_per_param: float = 1.0,
                         dtype: str | None = None, buffers: dict[str, tuple[int, str]] | None = None) -> float:
    """Bytes one rank sends in an exchange (what the run's ``runtime.pack`` sends): its shard of
    every parameter (the largest over the mesh's ranks), times (1 + optimizer state per
    parameter) with "weights+optimizer", plus every buffer whole (running statistics and their
    counters: every rank holds and sends them). ``dtype``: the floating dtype the run holds the
    model in (None: the plan's traced dtype); integer buffers keep theirs. ``buffers``: (elements,
    dtype) by name (None: ``graph_buffers``)."""
    graph = plan.graph()          # (planning loads no runtime module: the shards from the decisions)
    decisions = {d.layer: d.decomposition() for d in plan.layers}
    shards = {}
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    for lay in graph.layers:
        for op in lay.ops:
            for role, q in op.param_names.items():
                shapes[q] = (tuple(op.params[role]), _FLOAT_BYTES[dtype] if dtype else lay.itemsize)
                shards[q] = decisions[lay.index].param_shard(op, role)
    n = plan.world_size
    per_rank = []
    for r in range(n):
        tot = 0.0
        for q, (shape, item) in shapes.items():
            sh = shards.get(q)
            local = sh.local_shape(shape, r, n) if sh is not None else shape
            tot += math.prod(local) * item
        per_rank.append(tot)
    mult = 1.0 + (optimizer_state_per_param if exchange == "weights+optimizer" else 0.0)
    buffers = graph_buffers(plan) if buffers is None else buffers
    buf_bytes = sum(numel * (_FLOAT_BYTES[dtype] if (dtype and bdt in _FLOAT_BYTES) else DTYPE_BYTES.get(bdt, 4))
                    for numel, bdt in buffers.values())
    return max(per_rank or [0.0]) * mult + buf_bytes


def price_trainers(plan: Plan, trainers: int, profile, opts: TournamentOptions, ranks_per_node: int,
                   memory_limit_bytes: float | None, sample_bytes: float,
                   optimizer_state_per_param: float = 1.0,
                   buffers: dict[str, tuple[int, str]] | None = None) -> dict[str, Any]:
    """Every term of the module docstring for ``trainers`` trainers running ``plan``, in the
    plan's dtype; the exchange and the figures after it (``tournament_s``, ``round_s``,
    ``samples_per_s``) also in each of ``RUN_DTYPES``, as ``<figure>_<dtype>`` (a run picks its
    own: ``tournament.run``). ``buffers``: the model's (``model_buffers``; None: the graph's)."""
    n = plan.world_size
    T = int(trainers)
    B = plan.model.batch_size
    I = opts.interval_steps
    tour = opts.tournament_samples or 2 * B
    train = opts.train_samples_per_trainer or 8 * B
    data_total = opts.dataset_samples or T * (train + tour)
    # trainers sharing a node slow each other's kernels: the plan was priced with min(n, R)
    # ranks on a node, the job runs min(T*n, R) there (the profile's measured slowdown)
    world0 = T * n
    colocation = profile.slowdown(min(world0, ranks_per_node)) / profile.slowdown(min(n, ranks_per_node))
    pr = plan.predicted
    step_s = pr.step_time_s + (pr.fwd_s + pr.bwd_s) * (colocation - 1.0)
    state = state_bytes_per_rank(plan, opts.exchange, optimizer_state_per_param, buffers=buffers)
    world = T * n
    level = "inter" if (world > ranks_per_node and T > 1) else "intra"
    on_node = min(world0, ranks_per_node)

    def exchange_time_s(nbytes: float) -> float:
        if T == 1:
            return 0.0
        # the fitted p2p, its latency raised to the in-situ one (as cost.primitives.blocking_s)
        return profile.collective_time_s("p2p", 2, nbytes, level) + max(
            0.0, insitu_latency_s(profile, 2, on_node, "p2p") - profile.collective_time_s("p2p", 2, 0.0, level))
    exchange_s = exchange_time_s(state)
    models = 2 if T > 1 else 1
    # per model: the forwards, then one blocking all-reduce of the metric over the trainer's mesh
    eval_s = models * (math.ceil(tour / B) * plan.predicted.fwd_s * colocation
                       + (insitu_latency_s(profile, n, on_node, "allreduce") if n > 1 else 0.0))
    shard_bytes = data_total / T * sample_bytes
    store_per_rank = shard_bytes / n
    store_limit = opts.data_store_bytes_per_rank if opts.data_store_bytes_per_rank is not None else memory_limit_bytes
    in_memory = store_limit is None or store_per_rank <= store_limit
    ing = opts.ingestion or IngestionModel()
    if in_memory:
        ingest_s = 0.0
        rate = None
    else:
        nodes_of_trainer = max(1, math.ceil(n / ranks_per_node))
        rate = min(nodes_of_trainer * ing.node_read_bytes_per_s, ing.aggregate_bytes_per_s / T)
        ingest_s = B * sample_bytes / rate + B * ing.per_sample_latency_s / n

    def round_s_of(exch_s: float) -> float:
        return I * max(step_s, ingest_s) + exch_s + eval_s
    round_s = round_s_of(exchange_s)
    by_dtype: dict[str, float] = {}
    for dt in RUN_DTYPES:
        st = state_bytes_per_rank(plan, opts.exchange, optimizer_state_per_param, dtype=dt, buffers=buffers)
        ex = exchange_time_s(st)
        rs = round_s_of(ex)
        by_dtype.update({f"exchange_bytes_per_rank_{dt}": st if T > 1 else 0.0, f"exchange_s_{dt}": ex,
                         f"tournament_s_{dt}": ex + eval_s, f"round_s_{dt}": rs,
                         f"samples_per_s_{dt}": T * I * B / rs if rs > 0 else math.inf})
    mem = plan.predicted.memory_per_rank_bytes + (state if T > 1 else 0.0)
    return {**by_dtype,
        "trainers": T, "ranks_per_trainer": n, "world_size": world, "batch_per_trainer": B,
        "interval_steps": I, "step_s": step_s, "plan_step_s": pr.step_time_s, "colocation_slowdown": colocation, "ingest_s": ingest_s, "data_in_memory": in_memory,
        "shard_bytes": shard_bytes, "data_store_bytes_per_rank": store_per_rank,
        "storage_read_bytes_per_s": rate, "ingestion_source": None if in_memory else ing.source,
        "exchange_s": exchange_s, "exchange_bytes_per_rank": state if T > 1 else 0.0, "exchange_link": level,
        "eval_s": eval_s, "tournament_s": exchange_s + eval_s, "round_s": round_s,
        "tournament_overhead": (exchange_s + eval_s) / round_s if round_s > 0 else 0.0,
        "samples_per_s": T * I * B / round_s if round_s > 0 else math.inf,
        "memory_per_rank_bytes": mem, "memory_limit_bytes": memory_limit_bytes,
    }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sample_bytes_of(mf, batch_size: int) -> float:
    """Bytes of one sample in storage: the model file's ``SAMPLE_BYTES``, else its example
    batch's inputs and targets divided by the batch."""
    sb = getattr(mf.module, "SAMPLE_BYTES", None)
    if sb is not None:
        return float(sb)
    import torch
    torch.manual_seed(0)
    xs, ys = mf.example_inputs(batch_size), mf.example_targets(batch_size)
    tot = sum(x.numel() * x.element_size() for x in xs) + (ys.numel() * ys.element_size() if ys is not None else 0)
    return tot / batch_size


def format_table(rows: list[dict[str, Any]], chosen: int | None = None) -> str:
    head = (f"{'T':>4} {'ranks/T':>7} {'step ms':>9} {'ingest ms':>9} {'exch ms':>8} {'eval ms':>8} "
            f"{'overhead':>8} {'data':>8} {'mem MiB':>8} {'samples/s':>11}  note")
    out = [head]
    for r in rows:
        if r.get("error"):
            out.append(f"{r['trainers']:>4} {r['ranks_per_trainer']:>7} {'':>9} {'':>9} {'':>8} {'':>8} "
                       f"{'':>8} {'':>8} {'':>8} {'infeasible':>11}  {r['error']}")
            continue
        note = "<- chosen" if chosen == r["trainers"] else ("" if r.get("fits_memory", True) else "over the memory limit")
        out.append(f"{r['trainers']:>4} {r['ranks_per_trainer']:>7} {r['step_s'] * 1e3:9.3f} "
                   f"{r['ingest_s'] * 1e3:9.3f} {r['exchange_s'] * 1e3:8.3f} {r['eval_s'] * 1e3:8.3f} "
                   f"{100 * r['tournament_overhead']:7.1f}% {'memory' if r['data_in_memory'] else 'storage':>8} "
                   f"{r['memory_per_rank_bytes'] / 2**20:8.2f} {r['samples_per_s']:11.1f}  {note}")
    return "\n".join(out)


# ---- planning -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TournamentPlanResult:
    """What ``planner.make_tournament_plan`` returns: the plan with its trainer level, where it
    was written, every trainer count priced (``rows``, ``fits_memory`` by the chooser's rule) and
    the T chosen."""
    plan: Plan
    plan_path: Path | None
    module_path: Path | None
    rows: list[dict[str, Any]]
    chosen: int
