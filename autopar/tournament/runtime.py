"""Run time of tournament training: one rank of one trainer (no solver, tracer or cost imports).

Trainer t runs the plan on global ranks ``[t*n, (t+1)*n)`` (a ``Comm`` of that sub-mesh);
every process creates, up front and in one order, every trainer's groups and one two-rank
group per pair of corresponding ranks of every two trainers (``exchange_groups``): the
exchange is point to point inside those pair groups, so a dead trainer poisons only the pair
groups it is in, never a survivor's own mesh or another pair.

A round (every ``interval`` steps):

1. the trainer's ranks meet (a barrier on its mesh) and its mesh rank 0 posts "ready" for the
   round on the **board** (``Board``: one file per (round, trainer), created once, first
   writer wins, so every rank reads the same verdict);
2. every rank waits until every trainer's verdict for the round exists: "ready", or "dead"
   (posted for it by a rank that saw its death marker, written by its dying rank or by the
   launcher, or by the first rank whose wait ran past the time-out): the living are the
   "ready" ones, the same set on every rank, with no collective among trainers;
3. pairing: the living shuffled with ``Random(pairing_seed, round)``, paired in order, an odd
   one plays itself (``pairing``), identical on every rank;
4. exchange: each rank sends its shard of every parameter, every buffer (running statistics
   and their counters) and, with "weights+optimizer", the momentum, each tensor in its own
   dtype, to the corresponding rank of the partner and
   receives the partner's (one flat message each way, with the run's time-out); the trainer's
   ranks agree on success (a MIN all-reduce on the mesh): a failed exchange keeps the own model
   and marks the partner dead;
5. evaluation: the own model, then the partner's (loaded into the same shards), on the
   trainer's own tournament set (``evaluate``: the model in training mode, the plan's
   batch-norm statistics, every buffer left as it was); the partner's is kept only if its metric is
   lower (``decide``: a non-finite metric loses and is reported).

Data: ``make_dataset(n_samples, seed)`` of the model file (default: ``example_inputs`` /
``example_targets`` drawn with the seed), ``shard(dataset, t, T)`` (default: the t-th of T
contiguous blocks); of its shard a trainer trains on the first ``train_samples_per_trainer``
samples (batch after batch, cyclically) and holds out the next ``tournament_samples``.
Metric: the model file's ``tournament_metric(output, inputs, targets) -> float`` on the whole
tournament set's output, or by default the mean loss over the tournament set's batches.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..artifacts import load_plan, Plan, TrainerLevel
from ..modelfile import load_model_file
from ..runtime.comm import assemble, Comm, create_groups, _GROUPS
from ..runtime.entry import build_user_model
from ..runtime.model import plan_groups


# ---- pairing and decisions (pure) --------------------------------------------------------------

def pairing(alive: Sequence[int], seed: int, round_: int) -> dict[int, int]:
    """Partner of every living trainer in round ``round_``: the living (sorted) shuffled with a
    generator seeded by (seed, round), paired in order; an odd one out plays itself. The same on
    every rank for the same inputs (no communication)."""
    order = sorted(int(t) for t in alive)
    random.Random(f"ltfb:{int(seed)}:{int(round_)}").shuffle(order)
    out: dict[int, int] = {}
    for i in range(0, len(order) - 1, 2):
        a, b = order[i], order[i + 1]
        out[a], out[b] = b, a
    if len(order) % 2:
        out[order[-1]] = order[-1]
    return out


def decide(own: float, partner: float | None) -> tuple[bool, str]:
    """(keep the partner's model?, note). Lower wins; ties keep the own model; a non-finite
    metric counts as a loss for its model (both non-finite: keep the own)."""
    if partner is None:
        return False, "no partner"
    fo, fp = math.isfinite(own), math.isfinite(partner)
    if not fo and not fp:
        return False, "both metrics non-finite: own kept"
    if not fp:
        return False, "partner's metric non-finite: counts as a loss"
    if not fo:
        return True, "own metric non-finite: counts as a loss"
    return (partner < own), ""


def safe_metric(fn, *args) -> tuple[float, str]:
    """Call a metric; an exception or a non-finite value is reported, never raised."""
    try:
        v = float(fn(*args))
    except Exception as e:  # the user's metric failed: the model loses, the run goes on
        return math.inf, f"metric raised {e.__class__.__name__}: {e}"
    if not math.isfinite(v):
        return v, f"metric returned {v}"
    return v, ""


# ---- data ---------------------------------------------------------------------------------------

@dataclass
class TrainerData:
    train_inputs: list
    train_targets: Any
    tour_inputs: list
    tour_targets: Any


def _take(x, a, b):
    return None if x is None else x[a:b]


def full_dataset(mf, level: TrainerLevel):
    """The whole data set: T shards of (train + tournament) samples each."""
    import torch
    n = level.trainers * (level.train_samples_per_trainer + level.tournament_samples)
    fn = getattr(mf.module, "make_dataset", None)
    if fn is not None:
        xs, ys = fn(n, level.data_seed)
    else:
        torch.manual_seed(level.data_seed)
        xs, ys = mf.example_inputs(n), mf.example_targets(n)
    xs = list(xs) if isinstance(xs, (tuple, list)) else [xs]
    return xs, ys


def trainer_data(mf, level: TrainerLevel, t: int, dataset=None) -> TrainerData:
    """Trainer ``t``'s training samples and tournament set (module docstring)."""
    xs, ys = dataset if dataset is not None else full_dataset(mf, level)
    T = level.trainers
    fn = getattr(mf.module, "shard", None)
    if fn is not None:
        sx, sy = fn((xs, ys), t, T)
        sx = list(sx) if isinstance(sx, (tuple, list)) else [sx]
    else:
        per = len(xs[0]) // T
        sx, sy = [x[t * per:(t + 1) * per] for x in xs], _take(ys, t * per, (t + 1) * per)
    a, b = level.train_samples_per_trainer, level.tournament_samples
    if len(sx[0]) < a + b:
        raise ValueError(f"trainer {t}'s shard has {len(sx[0])} samples, fewer than {a} + {b}")
    return TrainerData([x[:a] for x in sx], _take(sy, 0, a), [x[a:a + b] for x in sx], _take(sy, a, a + b))


def batch_of(data_inputs, data_targets, step: int, B: int):
    """Batch ``step`` (cyclic over the training samples)."""
    nb = len(data_inputs[0]) // B
    i = step % nb
    return [x[i * B:(i + 1) * B] for x in data_inputs], _take(data_targets, i * B, (i + 1) * B)


def cast_float(ts, dtype):
    return [x.to(dtype) if x.is_floating_point() else x for x in ts]


def cast_target(y, dtype):
    return y.to(dtype) if (y is not None and y.is_floating_point()) else y


# ---- the board: verdicts every rank reads alike --------------------------------------------------

class Board:
    """A folder of small files, each created once (written aside, then hard-linked into place:
    the first writer wins and a reader never sees half a file). ``dead-<t>.json``: trainer t
    stopped (who saw it, when, why); ``round-<k>-<t>``: trainer t's verdict for round k."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _create(self, name: str, text: str) -> str:
        final = self.root / name
        tmp = self.root / f".{name}.{os.getpid()}.{time.monotonic_ns()}"
        tmp.write_text(text)
        try:
            os.link(tmp, final)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return final.read_text()

    def _read(self, name: str) -> str | None:
        try:
            return (self.root / name).read_text()
        except FileNotFoundError:
            return None

    def last_progress(self, t: int) -> float | None:
        """Wall time of trainer t's latest round post (None before its first)."""
        ts = [f.stat().st_mtime for f in self.root.glob(f"round-*-{t}")]
        return max(ts) if ts else None

    def mark_dead(self, t: int, info: dict[str, Any]) -> None:
        self._create(f"dead-{t}.json", json.dumps(info))

    def dead(self, t: int) -> dict[str, Any] | None:
        s = self._read(f"dead-{t}.json")
        return None if s is None else json.loads(s)

    def post(self, k: int, t: int, verdict: str) -> str:
        return self._create(f"round-{k}-{t}", verdict)

    def verdicts(self, k: int, trainers: int, timeout_s: float, poll_s: float = 0.005) -> dict[int, str]:
        """Wait until every trainer has a verdict for round ``k``; return them. A trainer with a
        death marker is posted dead; one silent past ``timeout_s`` is posted dead (hung)."""
        deadline = time.monotonic() + timeout_s
        out: dict[int, str] = {}
        while True:
            for u in range(trainers):
                if u in out:
                    continue
                v = self._read(f"round-{k}-{u}")
                if v is None and self.dead(u) is not None:
                    v = self.post(k, u, "dead")
                if v is None and time.monotonic() > deadline:
                    self.mark_dead(u, {"trainer": u, "round": k, "reason":
                                       f"hung: not ready for round {k} within the time-out ({timeout_s:.0f} s)",
                                       "seen_by": "a peer's wait", "time": time.time()})
                    v = self.post(k, u, "dead")
                if v is not None:
                    out[u] = v
            if len(out) == trainers:
                return out
            time.sleep(poll_s)


# ---- groups --------------------------------------------------------------------------------------

def exchange_groups(level: TrainerLevel) -> list[tuple[int, int]]:
    """One group per pair of corresponding ranks of every two trainers."""
    n, T = level.ranks_per_trainer, level.trainers
    return [(a * n + i, b * n + i) for a in range(T) for b in range(a + 1, T) for i in range(n)]


def all_groups(plan: Plan) -> list[tuple[int, ...]]:
    level = plan.trainers
    out = [g for t in range(level.trainers) for g in plan_groups(plan, level.trainer_ranks(t))]
    return out + exchange_groups(level)


# ---- model state -------------------------------------------------------------------------------

def state_tensors(dm, opt, exchange: str) -> list:
    """This rank's tensors that an exchange moves, in one fixed order: every parameter shard,
    every buffer (running statistics and their counters: the model is its parameters and its
    buffers) and, with "weights+optimizer", every momentum buffer."""
    import torch
    dm.flush_batch_norm()      # the running statistics the plan defines (collective in the trainer)
    ts = [p.data for p in dm.params.values()]
    ts += [b for _, b in sorted(dm.bufs.items())]
    if exchange == "weights+optimizer":
        for p in dm.params.values():
            st = opt.state.setdefault(p, {})
            if st.get("momentum_buffer") is None:
                st["momentum_buffer"] = torch.zeros_like(p.data)
            ts.append(st["momentum_buffer"])
    return ts


def pack(ts) -> Any:
    """One flat message of ``ts``' bytes, each tensor in its own dtype (the run's dtype for
    parameters and floating buffers; a counter in its integer dtype): what the wire carries and
    ``exchange_bytes`` counts is exactly the tensors' bytes."""
    import torch
    if not ts:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in ts])


def unpack_into(flat, ts) -> None:
    off = 0
    for t in ts:
        k = t.numel() * t.element_size()
        # (a copy first: a dtype view needs its bytes aligned to the element size)
        t.copy_(flat[off:off + k].clone().view(t.dtype).view(t.shape))
        off += k


def discard_pending_batch_norm(dm) -> None:
    """Forget the running-statistics updates recorded since the last flush (every rank of the
    trainer alike, no communication): an evaluation's training-mode forwards record some, and
    the evaluation leaves every buffer as it was (``evaluate``)."""
    rt = getattr(dm, "bn_runtime", None)
    if rt is not None:
        rt.acc = {}
    nat = dm.__dict__.get("_native")
    if nat is not None:
        nat._pending = False


# ---- evaluation ---------------------------------------------------------------------------------

def evaluate(dm, comm, mf, data: TrainerData, B: int, metric: str, loss_fn, dtype) -> tuple[float, str]:
    """The metric of ``dm``'s current weights on the tournament set (no gradients; buffers left
    as they were). Collective over the trainer's mesh; the same value on every rank of it."""
    import torch
    dm.flush_batch_norm()     # nothing pending from training: only this evaluation's, discarded below
    saved = {q: b.detach().clone() for q, b in dm.bufs.items()}
    nb = len(data.tour_inputs[0]) // B
    shares, outs = [], []
    with torch.no_grad():
        for i in range(nb):
            xs, ys = batch_of(data.tour_inputs, data.tour_targets, i, B)
            xs, ys = cast_float(xs, dtype), cast_target(ys, dtype)
            out = dm(*dm.shard_inputs(xs))
            if metric == "loss":
                shares.append(dm.local_loss(out, ys, loss_fn).reshape(1).to(torch.float64))
            else:
                shape = dm.graph.value_shape(dm.graph.output)
                outs.append(assemble(out.detach(), dm.loss_layout(), shape, comm, "value"))
    discard_pending_batch_norm(dm)
    for q, b in dm.bufs.items():
        b.copy_(saved[q])
    if metric == "loss":
        s = comm.all_reduce_(torch.cat(shares))
        return safe_metric(lambda: s.mean())
    ins = cast_float(data.tour_inputs, dtype)
    return safe_metric(mf.module.tournament_metric, torch.cat(outs), ins, cast_target(data.tour_targets, dtype))


def _import_module(path: Path):
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"autopar_generated_{abs(hash(str(path))) % 10**8}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- one rank ------------------------------------------------------------------------------------

@dataclass
class TournamentRunOptions:
    rounds: int = 3
    seed: int = 0
    lr: float = 0.01
    momentum: float = 0.9
    dtype: str = "float64"
    timeout_s: float = 600.0
    kill: tuple[int, int] | None = None     # (trainer, round): a fault injected for tests/demos
    kill_mode: str = "exit"                  # "exit": dies silently; "raise": an error; "hang": sleeps
    return_params: bool = True


class TrainerStopped(RuntimeError):
    pass


def trainer_rank_main(rank: int, world: int, plan_path: str, module_path: str, board_dir: str,
                      opts: TournamentRunOptions) -> dict[str, Any]:
    """One rank of one trainer: every group up front, then ``rounds`` x (interval steps, a
    tournament); returns its records (and, on mesh rank 0, the final full parameters)."""
    level = load_plan(plan_path).trainers
    n = level.ranks_per_trainer
    t = rank // n
    board = Board(board_dir)
    state = {"round": 0, "step": 0}
    try:
        return _trainer(rank, t, plan_path, module_path, board, opts, state)
    except BaseException as e:
        board.mark_dead(t, {"trainer": t, "rank": rank, "round": state["round"], "step": state["step"],
                            "reason": f"{e.__class__.__name__}: {e}".splitlines()[0][:300],
                            "seen_by": f"rank {rank} (its own)", "time": time.time()})
        raise


def _trainer(rank, t, plan_path, module_path, board, opts, state) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    plan = load_plan(plan_path)
    level = plan.trainers
    n, T, B, I = level.ranks_per_trainer, level.trainers, plan.model.batch_size, level.interval_steps
    create_groups(all_groups(plan))
    comm = Comm.from_env(ranks=level.trainer_ranks(t))
    dtype = getattr(torch, opts.dtype)
    gen = _import_module(Path(module_path))
    mf, model = build_user_model(plan, plan_path, opts.seed + t)
    model.to(dtype=dtype)
    dm = gen.PlannedModel(plan, model, comm)
    dm.train()
    opt = torch.optim.SGD(dm.parameters(), lr=opts.lr, momentum=opts.momentum)
    loss_fn = mf.loss_fn()
    data = trainer_data(load_model_file(plan.model_file(plan_path)), level, t)
    metric = level.metric
    records, step_s = [], []
    t_start = time.time()
    for k in range(opts.rounds):
        state["round"] = k
        if opts.kill is not None and tuple(opts.kill) == (t, k) and comm.rank == 0:
            if opts.kill_mode == "exit":
                os._exit(9)
            if opts.kill_mode == "hang":
                time.sleep(10 * opts.timeout_s + 3600)
            raise RuntimeError(f"fault injected into trainer {t} at round {k}")
        # -- interval steps
        comm.barrier()
        t0 = time.perf_counter()
        for s in range(I):
            state["step"] = k * I + s
            xs, ys = batch_of(data.train_inputs, data.train_targets, k * I + s, B)
            xs, ys = cast_float(xs, dtype), cast_target(ys, dtype)
            opt.zero_grad(set_to_none=True)
            out = dm(*dm.shard_inputs(xs))
            dm.local_loss(out, ys, loss_fn).backward()
            dm.finish_grads()
            opt.step()
        comm.barrier()
        step_s.append((time.perf_counter() - t0) / I)
        state["step"] = (k + 1) * I
        # -- tournament
        t1 = time.perf_counter()
        if comm.rank == 0:
            if board.post(k, t, "ready") != "ready":
                raise TrainerStopped(f"trainer {t} was declared dead before round {k}")
        verdicts = board.verdicts(k, T, opts.timeout_s)
        alive = sorted(u for u, v in verdicts.items() if v == "ready")
        if t not in alive:
            raise TrainerStopped(f"trainer {t} was declared dead before round {k}")
        partner = pairing(alive, level.pairing_seed, k)[t]
        t_wait = time.perf_counter() - t1
        rec = {"round": k, "step": (k + 1) * I, "alive": alive,
               "pairs": sorted({tuple(sorted(p)) for p in pairing(alive, level.pairing_seed, k).items()}),
               "trainer": t, "partner": partner, "wait_s": t_wait}
        own_ts = state_tensors(dm, opt, level.exchange)
        got = None
        t2 = time.perf_counter()
        if partner != t:
            mine = pack(own_ts)
            theirs = torch.empty_like(mine)
            me_g, other_g = rank, partner * n + comm.rank
            # the pair's own group; when the pair is the whole world (two trainers of one rank),
            # the default group (create_groups makes no group of the whole world)
            grp = _GROUPS.get(tuple(sorted((me_g, other_g))))
            ok = 1.0
            try:
                reqs = [dist.isend(mine, dst=other_g, group=grp), dist.irecv(theirs, src=other_g, group=grp)]
                for r in reqs:
                    r.wait()
            except Exception as e:
                ok = 0.0
                rec["exchange_error"] = f"{e.__class__.__name__}: {e}".splitlines()[0][:200]
            flag = comm.all_reduce_(torch.tensor([ok], dtype=torch.float64), dist.ReduceOp.MIN)
            if float(flag) > 0:
                got = theirs
            else:
                board.mark_dead(partner, {"trainer": partner, "round": k, "reason":
                                          f"exchange with trainer {t} failed: {rec.get('exchange_error', 'on a peer rank')}",
                                          "seen_by": f"rank {rank}", "time": time.time()})
        rec["exchange_s"] = time.perf_counter() - t2
        # the bytes this rank sent (every parameter shard, buffer and momentum, each in its dtype)
        rec["exchange_bytes"] = 0 if got is None else int(mine.numel() * mine.element_size())
        # -- evaluation
        t3 = time.perf_counter()
        m_own, note_own = evaluate(dm, comm, mf, data, B, metric, loss_fn, dtype)
        m_partner, note_partner = None, ""
        if got is not None:
            saved = pack(own_ts)
            unpack_into(got, own_ts)
            m_partner, note_partner = evaluate(dm, comm, mf, data, B, metric, loss_fn, dtype)
        keep, why = decide(m_own, m_partner)
        if comm.world > 1:   # one decision for the whole trainer: mesh rank 0's
            d = torch.tensor([1.0 if keep else 0.0], dtype=torch.float64)
            dist.broadcast(d, src=comm.ranks[0], group=comm.mesh_group)
            keep = bool(float(d) > 0)
        if got is not None and not keep:
            unpack_into(saved, own_ts)
        rec.update({"eval_s": time.perf_counter() - t3, "metric_own": m_own, "metric_partner": m_partner,
                    "winner": (partner if keep else t), "kept": "partner" if keep else "own",
                    "notes": [x for x in (note_own and f"own: {note_own}", note_partner and f"partner: {note_partner}",
                                          why) if x]})
        records.append(rec)
    t_end = time.time()
    out = {"rank": rank, "trainer": t, "mesh_rank": comm.rank, "records": records, "step_s": step_s,
           "t_start": t_start, "t_end": t_end, "samples": opts.rounds * I * B}
    full = dm.full_params()
    bufs = dm.full_buffers()       # collective: every rank; the floating ones assembled in full
    bufs.update({q: b for q, b in dm.bufs.items() if q not in bufs})   # counters: alike on every rank
    if opts.return_params and comm.rank == 0:
        # numpy: a torch tensor would travel as a shared-memory handle that dies with this process
        out["params"] = {q: v.detach().to(torch.float64).numpy().copy() for q, v in full.items()}
        out["buffers"] = {q: v.detach().to(torch.float64).numpy().copy() for q, v in bufs.items()}
    return out
