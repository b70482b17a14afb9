"""Local multi-process launcher: start ``world`` ranks, collect their results, never hang.

``run_ranks(fn, world, ...)`` forks (default) or spawns one process per rank, initialises a
process group (gloo on CPU, NCCL on GPU) on a free loopback port, calls ``fn(rank, world,
*args)`` and returns the list of its return values in rank order. The parent watches every
child: if one exits with an error, dies, or the whole run exceeds ``timeout_s``, every rank is
killed and :class:`~autopar.errors.RankFailure` names the rank(s) and their last error.

Fork is ~50x faster to start than spawn on small machines; it needs ``torch.set_num_threads``
in each child and no torch compute (no OpenMP pool) in the parent before forking, so the parent
only forks before it touches torch kernels. CUDA cannot be used in a forked child, so ranks are
spawned whenever CUDA is involved (``start_method_for``: the NCCL backend, or CUDA already
initialised in this process); ``AUTOPAR_START_METHOD=fork|spawn|forkserver`` overrides the
choice for gloo runs. Generated code run under ``torchrun`` does not use
this module: it reads RANK/WORLD_SIZE from the environment (see ``init_from_env``).

A rank's peers learn who failed from the parent: it records every rank it sees end badly (an
error reported, a death without a report, a hang) in an array shared with the children, and
``peer_failures()`` -- called by a surviving rank whose communication broke (the stage runtime's
step) -- reads it, waiting briefly for the parent to notice, so the survivor's own error can name
the dead rank (:class:`PeerFailure`) instead of a bare "connection closed".

Rank placement (``autopar.decomp.rankmap``) is applied by relabeling at process-group init:
the process in physical slot ``p`` (launcher slot ``p``, or torchrun's RANK) joins the group as
logical rank ``placement.logical(p)``, so every torch.distributed rank the runtime sees is the
plan's logical rank and nothing else changes. What stays physical: the slot (and so the node,
and the CUDA device ``slot % device_count``). Results, errors and ``fn``'s rank argument are
logical: ``run_ranks`` returns results in logical rank order, the order callers expect with
or without a placement (logical rank 0, which checks and reports, is slot 0 in every stride
placement: ``physical(0) == 0``).
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from ..decomp.rankmap import RankMap
from ..errors import PlacementError, RankFailure
from .memory import keep_freed_memory


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method_for(backend: str, requested: str | None = None) -> str:
    """How to start ranks: "spawn" whenever CUDA is involved (the NCCL backend, or CUDA
    initialised in this process: a forked child cannot use it, whatever was asked), else
    ``requested``, else ``$AUTOPAR_START_METHOD``, else "fork" (fast: module docstring)."""
    import sys
    cuda_here = False
    if "torch" in sys.modules:
        try:
            cuda_here = bool(sys.modules["torch"].cuda.is_initialized())
        except Exception:
            cuda_here = False
    if backend == "nccl" or cuda_here:
        return "spawn"
    method = requested or os.environ.get("AUTOPAR_START_METHOD") or "fork"
    if method not in ("fork", "spawn", "forkserver"):
        raise ValueError(f"unknown start method {method!r} (AUTOPAR_START_METHOD): fork, spawn or forkserver")
    return method


class PeerFailure(RankFailure):
    """This rank's communication broke because another rank failed; names that rank."""


#: in a child of run_ranks: (the parent's record of how each rank ended (``_END_*``), this
#: rank), else None
_ENDS = None
_END_RUNNING, _END_ERROR, _END_DIED, _END_HUNG, _END_VICTIM = 0, 1, 2, 3, 4
_END_WORDS = {_END_ERROR: "failed (it reported an error)", _END_DIED: "died without reporting",
              _END_HUNG: "hung", _END_VICTIM: "stopped on a communication error"}


def _mark_ends(ends, errors: dict[int, str]) -> None:
    """Publish to the children how each failed rank ended (the parent's verdicts in ``errors``)."""
    if ends is None:
        return
    for r, msg in errors.items():
        m = msg.lower()
        first = m.splitlines()[0] if m else ""
        ends[r] = (_END_DIED if m.startswith("died with exit code") else
                   _END_HUNG if m.startswith("hung") or "did not finish" in m else
                   _END_VICTIM if any(k in first for k in _COMM_ERROR) else _END_ERROR)


def is_comm_error(exc: BaseException) -> bool:
    """A communication failure (a peer gone, a time-out), by the words the backends use."""
    first = (str(exc).splitlines() or [""])[0].lower()
    return any(k in first for k in _COMM_ERROR)


def peer_failures(wait_s: float = 10.0, poll_s: float = 0.02) -> dict[int, str]:
    """Inside a rank that ``run_ranks`` started: {rank: how it ended} for the other ranks the
    launcher has seen fail, waiting up to ``wait_s`` for a first one (the parent polls its
    children every 0.2 s). The causes only: ranks that died or hung, else those that raised
    something other than a communication error, else every failed rank (the launcher's
    ``_root_cause`` order). Empty outside ``run_ranks`` (torchrun: its agent names the rank) or
    if none is known within ``wait_s``."""
    if _ENDS is None:
        return {}
    ends, me = _ENDS
    deadline = time.monotonic() + wait_s
    while True:
        seen = {r: int(ends[r]) for r in range(len(ends)) if r != me and int(ends[r]) != _END_RUNNING}
        if seen:
            time.sleep(poll_s * 5)            # a death and its first victims land together: read once more
            seen = {r: int(ends[r]) for r in range(len(ends)) if r != me and int(ends[r]) != _END_RUNNING}
            cause = ({r: e for r, e in seen.items() if e in (_END_DIED, _END_HUNG)} or
                     {r: e for r, e in seen.items() if e == _END_ERROR} or seen)
            return {r: _END_WORDS[e] for r, e in sorted(cause.items())}
        if time.monotonic() > deadline:
            return {}
        time.sleep(poll_s)


def raise_peer_failure(exc: BaseException, where: str, wait_s: float = 10.0) -> None:
    """If ``exc`` is a communication error and the launcher knows which rank failed, raise
    :class:`PeerFailure` naming it (``where``: what this rank was doing), from ``exc``; else
    return (the caller re-raises ``exc``)."""
    if not is_comm_error(exc):
        return
    failed = peer_failures(wait_s)
    if not failed:
        return
    names = "; ".join(f"rank {r} {how}" for r, how in failed.items())
    first = (str(exc).splitlines() or [""])[0]
    raise PeerFailure(f"{names}: this rank stopped {where} ({type(exc).__name__}: {first[:200]})",
                      f"the failed rank's own error is the cause; {', '.join(f'rank {r}' for r in failed)} "
                      "is named in the launcher's report") from exc


def _child(fn, rank, world, args, backend, port, threads, timeout_s, q, slot=None, ends=None):  # pragma: no cover
    """Logical rank ``rank`` in physical slot ``slot`` (default: the same number); ``ends``: the
    parent's shared record of failed ranks (``peer_failures``)."""
    import torch
    import torch.distributed as dist

    global _ENDS
    _ENDS = None if ends is None else (ends, rank)
    slot = rank if slot is None else slot
    torch.set_num_threads(threads)
    keep_freed_memory()     # a step's freed tensors stay mapped for the next (runtime.memory)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    try:
        if backend == "nccl":   # before init: NCCL binds the communicator to the current device
            torch.cuda.set_device(slot % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        out = fn(rank, world, *args)
        q.put((rank, "ok", out))
        # Leave the group together so that no rank tears down sockets a peer still uses.
        try:
            dist.barrier()
        except Exception:
            pass
        dist.destroy_process_group()
    except BaseException as e:  # report, then die: the parent kills the others
        q.put((rank, "error", f"{e.__class__.__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        q.close()
        q.join_thread()  # flush the message before dying
        os._exit(1)
    q.close()
    q.join_thread()
    os._exit(0)


#: after a first failure, how long the others get to report (survivors name the dead rank:
#: ``peer_failures``, after the parent's 0.2 s poll and 0.5 s drain) before all are killed
_GRACE_S = 5.0

_COMM_ERROR = ("connection closed", "connection reset", "gloo", "nccl", "timed out", "timeout",
               "broken pipe", "peer", "socket")


def _note_deaths(procs, q, results, errors) -> None:
    """Ranks that exited with an error code and no report: drain a late report first (a rank
    puts its error on the queue just before it exits), then declare the rest silent deaths."""
    for r, p in enumerate(procs):
        if r not in results and r not in errors and p.exitcode not in (None, 0):
            try:
                while True:
                    rank, status, payload = q.get(timeout=0.5)
                    (results if status == "ok" else errors)[rank] = payload
            except queue_mod.Empty:
                pass
            if r not in results and r not in errors:
                errors[r] = f"died with exit code {p.exitcode} without reporting"


def _collect_more(procs, q, results, errors, grace_s: float, ends=None) -> None:
    """After a first failure, wait briefly for the other ranks' reports or deaths, so that the
    root cause (often a rank that died silently) is not hidden by its peers' comm errors."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            rank, status, payload = q.get(timeout=0.1)
            (results if status == "ok" else errors)[rank] = payload
        except queue_mod.Empty:
            pass
        _note_deaths(procs, q, results, errors)
        _mark_ends(ends, errors)
        if all(r in results or r in errors for r in range(len(procs))):
            break
    for r, p in enumerate(procs):
        if r not in results and r not in errors and p.is_alive():
            errors[r] = "hung: still running (no report) when its peers failed waiting for it"


def _root_cause(errors: dict[int, str]) -> int:
    """The failed rank most likely to be the cause: one that died silently, else one still
    running when its peers failed (a death leaves its peers blocked in a collective: those are
    victims), else one that raised something other than a communication error; else the lowest."""
    def score(r: int) -> tuple[int, int]:
        msg = errors[r].lower()
        if msg.startswith("died with exit code"):     # the launcher's own verdict (a peer's may quote it)
            return (0, r)
        if msg.startswith("hung"):
            return (1, r)
        if "did not finish" in msg:
            return (2, r)
        first = msg.splitlines()[0] if msg else ""
        return (3 if any(k in first for k in _COMM_ERROR) else 2, r)
    return min(errors, key=score)


def run_ranks(fn: Callable[..., Any], world: int, args: tuple = (), backend: str = "gloo",
              timeout_s: float = 300.0, start_method: str | None = None, threads: int = 1,
              placement: RankMap | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes; return results in rank order.

    ``placement`` (default: the identity) says which physical slot runs each logical rank;
    ``rank``, the results' order and the ranks named in errors are logical (module docstring).
    ``start_method``: see ``start_method_for`` (spawn whenever CUDA is involved; with spawn,
    ``fn`` and ``args`` must pickle). Raises RankFailure (naming the ranks) if any rank fails, dies, or the run outlasts
    ``timeout_s``; all ranks are killed before it is raised. Its ``rank_errors`` holds every
    failed rank's own report ({rank: text}).
    """
    import multiprocessing as mp

    if placement is None:
        placement = RankMap.identity(world)
    elif placement.world != world:
        raise PlacementError(f"placement for world size {placement.world} given for {world} ranks",
                             "pass the plan's placement with its world size")
    ctx = mp.get_context(start_method_for(backend, start_method))
    q = ctx.Queue()
    ends = ctx.Array("i", world)        # how each rank ended, as seen here; read by peer_failures
    port = free_port()
    # procs[r] runs logical rank r (in slot placement.physical(r)): the bookkeeping below is
    # per logical rank; processes start in slot order
    procs = [ctx.Process(target=_child, args=(fn, r, world, args, backend, port, threads, timeout_s, q,
                                              placement.physical(r), ends),
                         daemon=True) for r in range(world)]
    for slot in range(world):
        procs[placement.logical(slot)].start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world and not errors:
            try:
                rank, status, payload = q.get(timeout=0.2)
                if status == "ok":
                    results[rank] = payload
                else:
                    errors[rank] = payload
                continue
            except queue_mod.Empty:
                pass
            _note_deaths(procs, q, results, errors)
            _mark_ends(ends, errors)
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in results]
                for r in missing:
                    errors.setdefault(r, f"did not finish within {timeout_s:.0f} s (hung or too slow)")
                break
        if errors:
            _mark_ends(ends, errors)
            _collect_more(procs, q, results, errors, grace_s=_GRACE_S, ends=ends)
            first = _root_cause(errors)
            detail = errors[first].strip().splitlines()
            where = ("" if placement.is_identity else
                     f" (slot {placement.physical(first)}, placement {placement})")
            failure = RankFailure(
                f"rank {first}{where} failed: {detail[0] if detail else '?'}; ranks that stopped: {sorted(errors)}",
                "all ranks were stopped; rerun with --debug for the traceback" if len(detail) > 1 else
                "all ranks were stopped")
            failure.rank_errors = dict(errors)     # every failed rank's own report, by rank
            raise failure
        return [results[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=2.0 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        q.close()


def init_from_env(backend: str | None = None, timeout_s: float = 300.0,
                  placement: RankMap | None = None) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; return the logical
    (rank, world). Under ``placement`` (None: the identity) the process torchrun calls RANK p
    joins as logical rank ``placement.logical(p)``; its CUDA device stays LOCAL_RANK (physical)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        kw = {}
        if placement is not None:
            world = int(os.environ["WORLD_SIZE"])
            if placement.world != world:
                raise PlacementError(f"the plan's placement is for world size {placement.world}, "
                                     f"torchrun started {world} processes",
                                     f"run with {placement.world} processes in all, or re-plan")
            if not placement.is_identity:
                kw = {"rank": placement.logical(int(os.environ["RANK"])), "world_size": world}
        if backend == "nccl" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        keep_freed_memory()     # as in the ranks run_ranks starts (runtime.memory)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kw)
    return dist.get_rank(), dist.get_world_size()
