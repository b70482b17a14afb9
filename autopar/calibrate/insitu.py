"""Collective latency *in situ*: what a blocking collective costs between kernels of a step.

Collective benchmarks time back-to-back operations after a barrier, with every rank idle and
aligned. Inside a training step a blocking collective (batch-norm statistics, halo exchange,
a transition) is reached by the ranks at slightly different times, right after a kernel, on
cores shared with the communication threads: it costs more. This measures it the way the
runtime meets it: a convolution followed by a synchronised batch norm, forward and backward (two
collectives), against the same with a local batch norm, for each group size p:

    latency_insitu(p) = (t_sync - t_local - straggler wait) / 2

stored in the profile (``apply_insitu``). The cost model prices a blocking collective as
``max(isolated fit, latency_insitu(p) + its bandwidth term)`` (``cost.primitives.blocking_s``);
the asynchronous gradient allreduce keeps the isolated fit. The same for the other blocking
kinds (``KIND_GROUPS``), and the straggler wait itself (``Straggler``): all of it in one
launch of w ranks per world w (``measure_in_situ``), since starting w processes and their
process group costs about as much as one quantity's measurement.

Every probe is repeated, and the stored figures (but the comm interference share, from a probe
of its own) are read from its rounds by ``STORED_STAT``, their mean: a training run pays every
stall, including one that only a minority of rounds meet (a rank descheduled for a time
slice), and a step's time is the mean of its steps, so a per-step cost is priced by its mean
too. Calibrations made before 2026-12-02 stored medians,
which leave such stalls out; re-read by their mean, the five profiles that had kept their
rounds priced twenty-two prediction runs' measured steps at 11.8 / 15.1 % (in-sample /
held-out median error, 110 pairings) against 12.5 / 14.9 % by the median, the world-2 plans'
under-prediction narrowing from 12.1 to 10.3 % in-sample
(``reports/benchmarks/prediction_cross_reprice_twenty-two_sets_*.txt`` (removed; git 172578b^)). The rounds themselves
are kept in the profile (``samples["insitu_raw"]``, ``raw_rounds``) with the statistic that
read them (``samples["insitu_stat"]``), and ``estimate_in_situ`` reads them by either, so that
the other one can be tried against measured steps without calibrating again
(``benchmarks/cross_reprice.py --insitu-stat`` (removed; git 172578b^)).
"""

from __future__ import annotations

import statistics
import time
from ..profile.straggler import Straggler, fit_straggler
from ..profile.optimizer import add_optimizer_step
from ..profile.profile import load_profile, require_measured_here, save_profile
from ..runtime.comm import Comm
from ..runtime import launch as rank_launch  # looked up at each call: tests replace run_ranks
from ..runtime.ops import sync_batch_norm
from .optimizer import measure_optimizer_step
from .report import default_report_dir, write_report


def _probe_conv():
    """(input, weight) of the convolution every in-situ probe runs between its collectives
    (fixed seed): [8, 16, 32, 32] through 16 3x3 filters, about 1 ms forward and backward."""
    import torch
    torch.manual_seed(0)
    return torch.randn(8, 16, 32, 32), torch.randn(16, 16, 3, 3, requires_grad=True)


def _rank(rank, world, iters, p=None):
    import torch

    comm = Comm.from_env()
    x, w = _probe_conv()
    bw = torch.ones(16, requires_grad=True)
    bb = torch.zeros(16, requires_grad=True)
    rm, rv = torch.zeros(16), torch.ones(16)
    p = p or world
    first = (rank // p) * p
    ranks = list(range(first, first + p)) if first + p <= world else [rank]
    comm.ensure_partitions([[list(range(a, a + p)) for a in range(0, world - p + 1, p)]])

    def body(sync):
        y = torch.nn.functional.conv2d(x, w, padding=1)
        if sync:
            z = sync_batch_norm(y, bw, bb, rm, rv, True, 0.1, 1e-5, comm, ranks)
        else:
            z = torch.nn.functional.batch_norm(y, rm, rv, bw, bb, True, 0.1, 1e-5)
        z.sum().backward()
    return _time_variants(body, len(ranks) > 1, iters)


def _time_variants(body, can_sync: bool, iters: int) -> dict[str, list[float]]:
    """The times of ``iters`` runs of ``body(sync)`` for each of the variants local, sync,
    local2, sync2 (one after another, so that a slow phase of the machine does not fall on one
    variant alone), after a barrier each: ``{variant: [s, ...]}`` (``latency_s`` reduces
    them)."""
    import torch.distributed as dist
    out = {}
    for name, sync in VARIANTS:
        sync = sync and can_sync
        for _ in range(3):
            body(sync)
        dist.barrier()
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            body(sync)
            ts.append(time.perf_counter() - t)
        out[name] = [float(f"{t:.6g}") for t in ts]
    return out


#: the in-situ probes' variants (name, synchronises): each pair timed twice, interleaved
VARIANTS = (("local", False), ("sync", True), ("local2", False), ("sync2", True))


def _kind_rank(rank, world, iters, p, kind):
    """Like ``_rank`` for another kind of blocking collective: a convolution (forward and
    backward) then two small ``kind`` operations among the rank's group of p (an all-to-all as
    a layout transition does, or a neighbour exchange as a halo does), against the
    convolution alone."""
    import torch
    import torch.distributed as dist

    comm = Comm.from_env()
    x, w = _probe_conv()
    first = (rank // p) * p
    ranks = list(range(first, first + p)) if first + p <= world else [rank]
    comm.ensure_partitions([[list(range(a, a + p)) for a in range(0, world - p + 1, p)]])
    group = comm.group(ranks) if len(ranks) > 1 else None
    buf_in, buf_out = torch.ones(64 * p), torch.empty(64 * p)
    halo_out, halo_in = [torch.ones(64) for _ in range(2)], [torch.empty(64) for _ in range(2)]

    def collective():
        if kind == "all_to_all":
            dist.all_to_all_single(buf_out, buf_in, group=group)
        else:   # p2p: exchange with both neighbours on the group's ring (one for a pair)
            me = ranks.index(rank)
            peers = sorted({ranks[(me - 1) % p], ranks[(me + 1) % p]})
            ops = []
            for i, q in enumerate(peers):
                ops += [dist.P2POp(dist.isend, halo_out[i], q), dist.P2POp(dist.irecv, halo_in[i], q)]
            for r in dist.batch_isend_irecv(ops):
                r.wait()

    def body(sync):
        torch.nn.functional.conv2d(x, w, padding=1).sum().backward()
        if sync:
            collective()
            collective()
    return _time_variants(body, len(ranks) > 1, iters)


#: the blocking collectives measured in situ besides the all-reduce (layout transitions:
#: all-to-all; halos: neighbour exchange, p = 2), and their group sizes with w ranks running.
#: On the 2-core machine they wait less than a batch-norm all-reduce (fewer dependent steps for
#: a descheduled peer to hold up), and pricing them with the all-reduce's latency over-priced
#: transitions at 4 ranks about 2x.
KIND_GROUPS = {"all_to_all": lambda w: range(2, w + 1), "p2p": lambda w: [2]}


#: the gradient all-reduce of ``_overlap_rank``: 1 Mi floats (4 MiB, a few ms over gloo)
OVERLAP_FLOATS = 1 << 20
#: convolutions (forward and backward) of the compute stretch it runs behind (~10 ms here)
OVERLAP_CONVS = 6


def _overlap_rank(rank, world, iters):
    """This rank's median times of a compute stretch alone (``OVERLAP_CONVS`` convolutions,
    forward and backward), of an all-reduce of ``OVERLAP_FLOATS`` floats over the world alone
    (started asynchronously and waited), and of both together as DDP runs a gradient bucket's
    all-reduce behind the rest of backward (started, the stretch run, then waited): the three
    interleaved after a barrier each, so a slow phase of the machine falls on all alike."""
    import torch
    import torch.distributed as dist
    x, w = _probe_conv()
    buf = torch.ones(OVERLAP_FLOATS)

    def compute():
        for _ in range(OVERLAP_CONVS):
            torch.nn.functional.conv2d(x, w, padding=1).sum().backward()

    def comm():
        dist.all_reduce(buf, async_op=True).wait()

    def both():
        h = dist.all_reduce(buf, async_op=True)
        compute()
        h.wait()
    variants = {"compute": compute, "comm": comm, "both": both}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()
    for _ in range(max(5, iters // 3)):
        for name, fn in variants.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def comm_interference(per_rank) -> float:
    """The share of a gradient all-reduce that overlapping compute does NOT hide, from
    ``_overlap_rank``'s times per rank: ``(both - max(compute, comm)) / min(compute, comm)``,
    the median over ranks, clipped to [0, 1]. 0: the all-reduce runs free behind backward (a
    device computes while the network moves the gradients); 1: it costs as much as if run
    after backward (ranks, gloo's threads and its copies share the same cores)."""
    vals = []
    for r in per_rank:
        c, a, b = r["compute"], r["comm"], r["both"]
        if min(c, a) > 0:
            vals.append(min(1.0, max(0.0, (b - max(c, a)) / min(c, a))))
    return float(statistics.median(vals)) if vals else 0.0


def apply_comm_interference(profile, phi: dict[str, float]) -> None:
    """``samples["comm_interference"]``: ``{str(w): share}`` (``comm_interference``) for each
    number of ranks running; priced by ``cost.table.price_comm_interference``."""
    profile.samples["comm_interference"] = {str(w): float(v) for w, v in phi.items()}


def _step_costs_rank(rank, world, iters, lengths):
    """What ``measure_in_situ`` measures with ``world`` ranks running, in one process group
    (one start-up of w processes instead of one per quantity): the straggler rounds, then per
    group size p the all-reduce (``_rank``) and each kind of ``KIND_GROUPS`` (``_kind_rank``),
    then the gradient all-reduce behind compute (``_overlap_rank``)."""
    out = {"straggler": _straggle_rank(rank, world, iters, lengths)}
    for p in range(2, world + 1):
        out[("allreduce", p)] = _rank(rank, world, iters, p)
    for kind, groups in KIND_GROUPS.items():
        for p in groups(world):
            out[(kind, p)] = _kind_rank(rank, world, iters, p, kind)
    out["overlap"] = _overlap_rank(rank, world, iters)
    return out


#: how the in-step estimators reduce a probe's repeated rounds: "median" (a stall that most
#: rounds miss is not counted) or "mean" (every stall counted, as a long training run pays them)
STATS = ("median", "mean")
#: the statistic calibration stores (``measure_in_situ``; ``samples["insitu_stat"]``)
STORED_STAT = "mean"


def _reduce(xs, stat: str) -> float:
    return statistics.median(xs) if stat == "median" else statistics.fmean(xs)


def latency_s(rounds_by_rank: list[dict], straggle: "Straggler | None", stat: str = STORED_STAT) -> float:
    """latency = (t_sync - t_local - wait(t_local)) / 2 from the probe rounds of the ranks
    that synchronised (``{variant: [s, ...]}`` each, ``_time_variants``); the straggler share
    is priced with the compute. ``stat`` "median": per rank the lower of the two passes'
    medians of each variant, then the median over ranks; "mean": per rank the
    mean over both passes' rounds, then the median over ranks."""
    def per_rank(r, a, b):
        return min(_reduce(r[a], "median"), _reduce(r[b], "median")) if stat == "median" \
            else _reduce(list(r[a]) + list(r[b]), stat)
    sync = statistics.median([per_rank(r, "sync", "sync2") for r in rounds_by_rank])
    local = statistics.median([per_rank(r, "local", "local2") for r in rounds_by_rank])
    return max(0.0, (sync - local - (straggle.wait_s(local) if straggle else 0.0)) / 2.0)


def raw_rounds(per_rank: list[dict]) -> dict:
    """``_step_costs_rank``'s results of one world as JSON data (``samples["insitu_raw"]``):
    ``{"straggler": {str(L): [per rank: [s per round]]}, "allreduce:2": [per rank: {variant:
    [s, ...]}], ...}``."""
    out: dict = {"straggler": {str(L): [r["straggler"][L] for r in per_rank] for L in per_rank[0]["straggler"]}}
    for key in per_rank[0]:
        if isinstance(key, tuple):
            out[f"{key[0]}:{key[1]}"] = [r[key] for r in per_rank]
    return out


def estimate_in_situ(raw: dict, w: int, stat: str = STORED_STAT):
    """(Straggler, ``{str(p): all-reduce latency}``, ``{kind: {str(p): latency}}``) of w ranks
    running, from one world's probe rounds (``raw_rounds``), each quantity reduced by ``stat``
    (``STATS``): what ``measure_in_situ`` stores (``STORED_STAT``), or the other one."""
    if stat not in STATS:
        raise ValueError(f"in-situ statistic {stat!r}: one of {', '.join(STATS)}")
    lengths = sorted(raw["straggler"], key=int)
    st = fit_straggler([straggler_point(raw["straggler"][L], stat) for L in lengths])

    def lat(kind, p):
        return latency_s(raw[f"{kind}:{p}"][: (w // p) * p], st, stat)
    allreduce = {str(p): lat("allreduce", p) for p in range(2, w + 1)}
    by_kind = {kind: {str(p): lat(kind, p) for p in groups(w)} for kind, groups in KIND_GROUPS.items()}
    return st, allreduce, by_kind


def measure_in_situ(world_sizes, iters: int = 30, timeout_s: float = 300.0, lengths=None,
                    raw: dict | None = None, stat: str = STORED_STAT):
    """(straggler, all-reduce latency, latency by kind, comm interference) for each world
    w >= 2 of ``world_sizes``, one launch of w ranks each (``_step_costs_rank``):
    ``{str(w): Straggler}``, ``{str(w): {str(p): s}}`` per blocking all-reduce among p ranks
    inside a step with w running, ``{kind: the same}``, and ``{str(w): share}`` of a gradient
    all-reduce that compute does not hide (``comm_interference``). ``raw``, when given, gets
    each world's probe rounds (``raw_rounds``) under ``str(w)``, so that another statistic can
    be read from them later; ``stat`` is the one read now (``estimate_in_situ``)."""
    lengths = tuple(lengths or STRAGGLER_LENGTHS)
    straggle: dict[str, Straggler] = {}
    lat: dict[str, dict[str, float]] = {}
    by_kind: dict[str, dict[str, dict[str, float]]] = {kind: {} for kind in KIND_GROUPS}
    phi: dict[str, float] = {}
    for w in world_sizes:
        if w < 2:
            continue
        per_rank = rank_launch.run_ranks(_step_costs_rank, w, args=(iters, lengths), timeout_s=timeout_s)
        rounds = raw_rounds(per_rank)
        if raw is not None:
            raw[str(w)] = rounds
        straggle[str(w)], lat[str(w)], kinds = estimate_in_situ(rounds, w, stat)
        for kind, table in kinds.items():
            by_kind[kind][str(w)] = table
        phi[str(w)] = comm_interference([r["overlap"] for r in per_rank])
    return straggle, lat, by_kind, phi


def apply_insitu_by_kind(profile, latency_s: dict) -> None:
    profile.samples["insitu_latency_by_kind_s"] = {
        kind: {str(w): {str(p): float(t) for p, t in row.items()} for w, row in table.items()}
        for kind, table in latency_s.items()}


#: fewest synchronised rounds per straggler segment length, and of the longest (whose wait
#: alone gives sigma): its median wait over 12 rounds read sigma at 4 ranks 0.020-0.053 s^0.5
#: in three back-to-back measurements
STRAGGLER_MIN_ROUNDS = 12
STRAGGLER_LONG_ROUNDS = 24


def straggler_rounds(length: int, lengths, iters: int) -> int:
    """Rounds of segment ``length``: ``max(STRAGGLER_MIN_ROUNDS, 3 iters / length)``, and at
    least ``STRAGGLER_LONG_ROUNDS`` for the longest of ``lengths``."""
    n = max(STRAGGLER_MIN_ROUNDS, (3 * iters) // length)
    return max(n, STRAGGLER_LONG_ROUNDS) if length == max(lengths) else n


def _straggle_rank(rank, world, iters, lengths):
    """Per length L: this rank's compute time (L convolutions, forward and backward) of each
    of n synchronised rounds (each ends with a one-float all-reduce over the world, so round i
    starts together on every rank), n = ``straggler_rounds(L, lengths, iters)``."""
    import torch
    import torch.distributed as dist
    x, w = _probe_conv()
    one = torch.ones(1)
    out = {}
    for L in lengths:
        def compute():
            for _ in range(L):
                torch.nn.functional.conv2d(x, w, padding=1).sum().backward()
        compute()
        dist.barrier()
        ts = []
        for _ in range(straggler_rounds(L, lengths, iters)):
            t = time.perf_counter()
            compute()
            ts.append(float(f"{time.perf_counter() - t:.6g}"))
            dist.all_reduce(one)
        out[L] = ts
    return out


#: segment lengths (convolutions between two synchronisations) of the straggler rounds: the
#: first two short (the linear regime; one convolution alone also waits a fixed part that the
#: in-situ latency holds), the last long (about 130 ms with 4 ranks on 2 cores)
STRAGGLER_LENGTHS = (2, 8, 32)


def straggler_point(rounds_by_rank, stat: str = STORED_STAT) -> tuple[float, float]:
    """(compute seconds, wait seconds) of one segment length from each rank's compute time per
    synchronised round: a round lasts as long as its slowest rank's compute, so a rank waits
    ``max_r c_r - c_self``. Means (``stat`` "median": medians) over the rounds of the ranks' mean
    compute and mean wait: measured within the same rounds, not as the difference of two
    separately timed runs, which the machine's drift between them swamped."""
    rounds = list(zip(*rounds_by_rank))
    compute = _reduce([statistics.fmean(r) for r in rounds], stat)
    wait = _reduce([max(r) - statistics.fmean(r) for r in rounds], stat)
    return compute, wait


def apply_straggler(profile, straggle: dict[str, Straggler]) -> None:
    profile.samples["straggler_kappa"] = {str(k): float(v.kappa) for k, v in straggle.items()}
    profile.samples["straggler_sigma"] = {str(k): float(v.sigma) for k, v in straggle.items()}


def measure_insitu_latency_s(world_sizes, iters: int = 30, timeout_s: float = 300.0) -> dict[str, dict[str, float]]:
    """{str(w): {str(p): seconds per blocking all-reduce among p ranks inside a step, with w
    ranks running}} for each world w in ``world_sizes`` (>= 2) and group size 2 <= p <= w
    (``measure_in_situ``)."""
    return measure_in_situ(world_sizes, iters, timeout_s)[1]


def apply_insitu(profile, latency_s: dict[str, dict[str, float]]) -> None:
    """Store the in-situ latencies in the profile: ``samples["insitu_latency_by_world_s"]``
    (``{w: {p: s}}``) and, for readers of older profiles, ``samples["insitu_latency_s"]``
    (``{p: s}`` with p = w). The cost model charges them to blocking collectives only
    (``cost.primitives.blocking_s``), not to the gradient allreduce, which runs
    asynchronously behind backward."""
    table = {str(w): {str(p): float(t) for p, t in row.items()} for w, row in latency_s.items()}
    profile.samples["insitu_latency_by_world_s"] = table
    profile.samples["insitu_latency_s"] = {w: row[w] for w, row in table.items() if w in row}


def remeasure(profile_path, iters: int = 30, progress=print) -> None:
    """Measure the in-situ latencies again into an existing profile measured on this machine
    (fingerprint checked), replacing the old ones atomically and noting it in the provenance:
    ``python -m autopar.calibrate.insitu PROFILE [--iters N]``."""
    import datetime as _dt

    prof = load_profile(profile_path, check_machine=False)
    require_measured_here(prof, profile_path, "in-situ latencies")
    world = int(prof.provenance.get("world_size") or prof.topology.get("ranks_per_node", 2))
    t0 = time.perf_counter()
    m = measure_step_costs(prof, world, iters)
    prof.provenance.setdefault("added", []).append(
        {"what": "in-situ blocking-collective latency per (group size, ranks running), straggler "
                 "factor per ranks running, optimizer step per tensor; re-measured "
                 "(samples.insitu_latency_by_world_s, samples.straggler_kappa, samples.straggler_sigma, "
                 "samples.comm_interference, kernels.optimizer_step)",
         "latency_s": m["latency_s"], "latency_by_kind_s": m["by_kind"], "straggler_kappa": {w: st.kappa for w, st in m["straggler"].items()},
         "straggler_sigma": {w: st.sigma for w, st in m["straggler"].items()},
         "comm_interference": m["comm_interference"],
         "optimizer_step": {k: m["optimizer"][k] for k in ("fixed_s", "t0_s", "s_per_byte") if k in m["optimizer"]},
         "iters": iters,
         "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
         "loadavg": [round(x, 2) for x in __import__("os").getloadavg()],
         "by": "autopar.calibrate.insitu.remeasure"})
    save_profile(prof, profile_path)
    progress(f"in-situ latency re-measured in {time.perf_counter() - t0:.1f} s: {describe_step_costs(m)}")
    from pathlib import Path

    if default_report_dir(profile_path).is_dir():     # keep the profile's report in step with it
        progress(f"report rewritten: {write_report(prof, default_report_dir(profile_path), Path(profile_path).name)}")


def measure_step_costs(prof, world: int, iters: int, launch=None, worlds=None) -> dict:
    """Measure into ``prof`` what a step meets beyond its kernels, for 2..``world`` ranks (or
    the ``worlds`` given: a quick calibration measures 2 and ``world``, and pricing takes the
    nearest measured count for the others): the straggler wait, the in-situ latency of
    blocking all-reduces and of the other kinds, and the optimizer step, on one rank started by
    ``launch(fn, world, args)`` (the calibration's backend; default gloo) (``calibrate.run``
    and ``remeasure`` alike). Returns what was measured."""
    launch = launch or (lambda fn, w, args: rank_launch.run_ranks(fn, w, args))
    raw: dict = {}
    straggle, lat, by_kind, phi = measure_in_situ(worlds or range(2, world + 1), iters=iters, raw=raw)
    prof.samples["insitu_raw"] = raw
    prof.samples["insitu_stat"] = STORED_STAT
    apply_straggler(prof, straggle)
    apply_insitu(prof, lat)
    apply_insitu_by_kind(prof, by_kind)
    apply_comm_interference(prof, phi)
    opt = launch(_optimizer_rank, 1, ())[0]
    add_optimizer_step(prof, opt)
    return {"straggler": straggle, "latency_s": lat, "by_kind": by_kind, "comm_interference": phi,
            "optimizer": opt}


def describe_step_costs(m: dict) -> str:
    """One line for progress output of ``measure_step_costs``'s result."""
    def table(t):
        return ", ".join(f"p={p} of {w} {s * 1e3:.2f} ms" for w, row in t.items() for p, s in row.items())
    return (f"allreduce: {table(m['latency_s'])}; " +
            "; ".join(f"{kind}: {table(t)}" for kind, t in m["by_kind"].items()) +
            "; straggler " + ", ".join(f"{w} ranks kappa {st.kappa:.3f} sigma {st.sigma:.4f} s^0.5"
                                       for w, st in m["straggler"].items()) +
            "; gradient all-reduce not hidden by compute " +
            ", ".join(f"{w} ranks {100 * v:.0f} %" for w, v in (m.get("comm_interference") or {}).items()) +
            f"; optimizer {m['optimizer'].get('fixed_s', 0.0) * 1e6:.0f} us a step + "
            f"{m['optimizer']['t0_s'] * 1e6:.1f} us per tensor + "
            f"{m['optimizer']['s_per_byte'] * 1e12:.1f} ps per byte")


def _optimizer_rank(rank, world):
    import torch.distributed as dist

    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return measure_optimizer_step(device="cuda" if nccl else "cpu")


if __name__ == "__main__":   # pragma: no cover - a maintenance command
    import argparse
    ap = argparse.ArgumentParser(prog="python -m autopar.calibrate.insitu")
    ap.add_argument("profile")
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    from ..errors import AutoparError
    try:
        remeasure(a.profile, a.iters)
    except AutoparError as e:   # one named line, as the CLI prints it
        print(f"error: {e}", file=__import__("sys").stderr)
        raise SystemExit(e.exit_code) from None
