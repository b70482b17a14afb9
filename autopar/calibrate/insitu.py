"""Collective latency *in situ*: what a blocking collective costs between kernels of a step.

Collective benchmarks time back-to-back operations after a barrier, with every rank idle and
aligned. Inside a training step a blocking collective (batch-norm statistics, halo exchange,
a transition) is reached by the ranks at slightly different times, right after a kernel, on
cores shared with the communication threads: it costs more. This measures it the way the
runtime meets it: a convolution followed by a synchronised batch norm, forward and backward (two
collectives), against the same with a local batch norm, for each group size p:

    latency_insitu(p) = (t_sync - t_local) / 2

stored in the profile (``apply_insitu``). The cost model prices a blocking collective as
``max(isolated fit, latency_insitu(p) + its bandwidth term)`` (``cost.primitives.blocking_s``);
the asynchronous gradient allreduce keeps the isolated fit.
"""

from __future__ import annotations

import statistics
import time


def _rank(rank, world, iters, p=None):
    import torch

    from ..runtime.comm import Comm
    from ..runtime.ops import sync_batch_norm
    comm = Comm.from_env()
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32, 32)
    w = torch.randn(16, 16, 3, 3, requires_grad=True)
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


def _time_variants(body, can_sync: bool, iters: int) -> dict[str, float]:
    """Median time of ``body(sync)`` for the variants local, sync, local2, sync2 (interleaved,
    so that a slow phase of the machine does not fall on one variant), after a barrier."""
    import torch.distributed as dist
    out = {}
    for name, sync in (("local", False), ("sync", True), ("local2", False), ("sync2", True)):
        sync = sync and can_sync
        for _ in range(3):
            body(sync)
        dist.barrier()
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            body(sync)
            ts.append(time.perf_counter() - t)
        out[name] = statistics.median(ts)
    return out


def _kind_rank(rank, world, iters, p, kind):
    """Like ``_rank`` for another kind of blocking collective: a convolution (forward and
    backward) then two small ``kind`` operations among the rank's group of p (an all-to-all as
    a layout transition does, or a neighbour exchange as a halo does), against the
    convolution alone."""
    import torch
    import torch.distributed as dist

    from ..runtime.comm import Comm
    comm = Comm.from_env()
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32, 32)
    w = torch.randn(16, 16, 3, 3, requires_grad=True)
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


def measure_insitu_by_kind(world_sizes, iters: int = 30, timeout_s: float = 300.0,
                           kappa: dict[str, float] | None = None,
                           kinds=("all_to_all", "p2p")) -> dict[str, dict[str, dict[str, float]]]:
    """{kind: {str(w): {str(p): s}}}: ``measure_insitu_latency_s`` for the other blocking
    collectives the runtime issues (layout transitions: all-to-all; halos: neighbour p2p, p = 2).
    On the 2-core machine they wait less than a batch-norm all-reduce (fewer dependent steps
    for a descheduled peer to hold up), and pricing them with the all-reduce's latency
    over-priced transitions at 4 ranks about 2x."""
    return {kind: _latency_table(_kind_rank, world_sizes,
                                 (lambda w: range(2, w + 1)) if kind != "p2p" else (lambda w: [2]),
                                 iters, timeout_s, kappa, kind)
            for kind in kinds}


def _latency_table(rank_fn, world_sizes, group_sizes, iters, timeout_s, kappa, *extra) -> dict[str, dict[str, float]]:
    """{str(w): {str(p): s}} from ``rank_fn(rank, w, iters, p, *extra)`` (``_time_variants``
    results) for each world w >= 2 and group size p in ``group_sizes(w)``::

        latency(p, w) = (t_sync - t_local - kappa_w * t_local) / 2

    over the ranks that synchronised (the straggler share is priced with the compute)."""
    from ..runtime.launch import run_ranks
    res: dict[str, dict[str, float]] = {}
    for w in world_sizes:
        if w < 2:
            continue
        res[str(w)] = {}
        for p in group_sizes(w):
            per_rank = run_ranks(rank_fn, w, args=(iters, p, *extra), timeout_s=timeout_s)
            in_groups = per_rank[: (w // p) * p]
            sync = statistics.median([min(r["sync"], r["sync2"]) for r in in_groups])
            local = statistics.median([min(r["local"], r["local2"]) for r in in_groups])
            k = (kappa or {}).get(str(w), 0.0)
            res[str(w)][str(p)] = max(0.0, (sync - local - k * local) / 2.0)
    return res


def apply_insitu_by_kind(profile, latency_s: dict) -> None:
    profile.samples["insitu_latency_by_kind_s"] = {
        kind: {str(w): {str(p): float(t) for p, t in row.items()} for w, row in table.items()}
        for kind, table in latency_s.items()}


def _straggle_rank(rank, world, iters, lengths):
    """Per length L: the median time of L convolutions (forward and backward) alone, and of the
    same followed by a one-float all-reduce over the world, interleaved twice."""
    import torch
    import torch.distributed as dist
    torch.manual_seed(0)
    x = torch.randn(8, 16, 32, 32)
    w = torch.randn(16, 16, 3, 3, requires_grad=True)
    one = torch.ones(1)
    out = {}
    for L in lengths:
        for name, sync in (("local", False), ("sync", True), ("local2", False), ("sync2", True)):
            def body():
                for _ in range(L):
                    torch.nn.functional.conv2d(x, w, padding=1).sum().backward()
                if sync:
                    dist.all_reduce(one)
            body()
            dist.barrier()
            ts = []
            for _ in range(max(5, iters // L)):
                t = time.perf_counter()
                body()
                ts.append(time.perf_counter() - t)
            out[f"{name}_{L}"] = statistics.median(ts)
    return out


def measure_straggler(world_sizes, iters: int = 30, lengths=(1, 8), timeout_s: float = 300.0) -> dict[str, float]:
    """{str(w): kappa}: with w ranks computing between synchronisations, a synchronisation waits
    for the slowest, and the wait grows with the compute since the last one::

        t_sync(L) - t_local(L) = latency + kappa * t_local(L)

    fitted from two segment lengths L (convolutions between one-float all-reduces). On
    dedicated devices kappa is about 0; on a CPU whose cores the ranks (and gloo's threads)
    share it is the step's straggler tax. The cost model multiplies multi-rank compute by
    ``1 + kappa`` (``cost.primitives.straggler``)."""
    from ..runtime.launch import run_ranks
    lo, hi = lengths
    res = {}
    for w in world_sizes:
        if w < 2:
            continue
        per_rank = run_ranks(_straggle_rank, w, args=(iters, tuple(lengths)), timeout_s=timeout_s)

        def med(key, L):
            return statistics.median([min(r[f"{key}_{L}"], r[f"{key}2_{L}"]) for r in per_rank])
        d_lo, d_hi = med("sync", lo) - med("local", lo), med("sync", hi) - med("local", hi)
        span = med("local", hi) - med("local", lo)
        res[str(w)] = float(min(2.0, max(0.0, (d_hi - d_lo) / span))) if span > 0 else 0.0
    return res


def apply_straggler(profile, kappa: dict[str, float]) -> None:
    profile.samples["straggler_kappa"] = {str(k): float(v) for k, v in kappa.items()}


def measure_insitu_latency_s(world_sizes, iters: int = 30, timeout_s: float = 300.0,
                             kappa: dict[str, float] | None = None) -> dict[str, dict[str, float]]:
    """{str(w): {str(p): seconds per blocking collective among p ranks inside a step, with w
    ranks running}} for each world w in ``world_sizes`` (>= 2) and group size 2 <= p <= w."""
    return _latency_table(_rank, world_sizes, lambda w: range(2, w + 1), iters, timeout_s, kappa)


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

    from .profile import load_profile, require_measured_here, save_profile
    prof = load_profile(profile_path, check_machine=False)
    require_measured_here(prof, profile_path, "in-situ latencies")
    world = int(prof.provenance.get("world_size") or prof.topology.get("ranks_per_node", 2))
    t0 = time.perf_counter()
    m = measure_step_costs(prof, world, iters)
    prof.provenance.setdefault("added", []).append(
        {"what": "in-situ blocking-collective latency per (group size, ranks running), straggler "
                 "factor per ranks running, optimizer step per tensor; re-measured "
                 "(samples.insitu_latency_by_world_s, samples.straggler_kappa, kernels.optimizer_step)",
         "latency_s": m["latency_s"], "latency_by_kind_s": m["by_kind"], "straggler_kappa": m["kappa"],
         "optimizer_step": {k: m["optimizer"][k] for k in ("t0_s", "s_per_byte")},
         "iters": iters,
         "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
         "loadavg": [round(x, 2) for x in __import__("os").getloadavg()],
         "by": "autopar.calibrate.insitu.remeasure"})
    save_profile(prof, profile_path)
    progress(f"in-situ latency re-measured in {time.perf_counter() - t0:.1f} s: {describe_step_costs(m)}")


def measure_step_costs(prof, world: int, iters: int, launch=None) -> dict:
    """Measure into ``prof`` what a step meets beyond its kernels, for 2..``world`` ranks: the
    straggler factor, the in-situ latency of blocking all-reduces and of the other kinds, and
    the optimizer step, on one rank started by ``launch(fn, world, args)`` (the calibration's
    backend; default gloo) (``calibrate.run`` and ``remeasure`` alike). Returns what was
    measured."""
    from ..runtime.launch import run_ranks
    from .optimizer import add_optimizer_step
    launch = launch or (lambda fn, w, args: run_ranks(fn, w, args))
    worlds = range(2, world + 1)
    kappa = measure_straggler(worlds, iters=iters)
    apply_straggler(prof, kappa)
    lat = measure_insitu_latency_s(worlds, iters=iters, kappa=kappa)
    apply_insitu(prof, lat)
    by_kind = measure_insitu_by_kind(worlds, iters=iters, kappa=kappa)
    apply_insitu_by_kind(prof, by_kind)
    opt = launch(_optimizer_rank, 1, ())[0]
    add_optimizer_step(prof, opt)
    return {"kappa": kappa, "latency_s": lat, "by_kind": by_kind, "optimizer": opt}


def describe_step_costs(m: dict) -> str:
    """One line for progress output of ``measure_step_costs``'s result."""
    def table(t):
        return ", ".join(f"p={p} of {w} {s * 1e3:.2f} ms" for w, row in t.items() for p, s in row.items())
    return (f"allreduce: {table(m['latency_s'])}; " +
            "; ".join(f"{kind}: {table(t)}" for kind, t in m["by_kind"].items()) +
            "; straggler kappa " + ", ".join(f"{w} ranks {k:.3f}" for w, k in m["kappa"].items()) +
            f"; optimizer {m['optimizer']['t0_s'] * 1e6:.1f} us per tensor, "
            f"{m['optimizer']['s_per_byte'] * 1e12:.1f} ps per byte")


def _optimizer_rank(rank, world):
    import torch.distributed as dist

    from .optimizer import measure_optimizer_step
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
