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


def _child(fn, rank, world, args, backend, port, threads, timeout_s, q, slot=None):  # pragma: no cover - in child
    """Logical rank ``rank`` in physical slot ``slot`` (default: the same number)."""
    import torch
    import torch.distributed as dist

    slot = rank if slot is None else slot
    torch.set_num_threads(threads)
    from .memory import keep_freed_memory
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


_COMM_ERROR = ("connection closed", "connection reset", "gloo", "nccl", "timed out", "timeout",
               "broken pipe", "peer", "socket")


def _collect_more(procs, q, results, errors, grace_s: float) -> None:
    """After a first failure, wait briefly for the other ranks' reports or deaths, so that the
    root cause (often a rank that died silently) is not hidden by its peers' comm errors."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            rank, status, payload = q.get(timeout=0.1)
            (results if status == "ok" else errors)[rank] = payload
        except queue_mod.Empty:
            pass
        for r, p in enumerate(procs):
            if r not in results and r not in errors and p.exitcode not in (None, 0):
                errors[r] = f"died with exit code {p.exitcode} without reporting"
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
        if "without reporting" in msg:
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
    ``timeout_s``; all ranks are killed before it is raised.
    """
    import multiprocessing as mp

    if placement is None:
        placement = RankMap.identity(world)
    elif placement.world != world:
        raise PlacementError(f"placement for world size {placement.world} given for {world} ranks",
                             "pass the plan's placement with its world size")
    ctx = mp.get_context(start_method_for(backend, start_method))
    q = ctx.Queue()
    port = free_port()
    # procs[r] runs logical rank r (in slot placement.physical(r)): the bookkeeping below is
    # per logical rank; processes start in slot order
    procs = [ctx.Process(target=_child, args=(fn, r, world, args, backend, port, threads, timeout_s, q,
                                              placement.physical(r)),
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
            for r, p in enumerate(procs):
                if r not in results and p.exitcode not in (None, 0):
                    # Drain a late error message before declaring a silent death.
                    try:
                        while True:
                            rank, status, payload = q.get(timeout=0.5)
                            (results if status == "ok" else errors)[rank] = payload
                    except queue_mod.Empty:
                        pass
                    if r not in results and r not in errors:
                        errors[r] = f"died with exit code {p.exitcode} without reporting"
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in results]
                for r in missing:
                    errors.setdefault(r, f"did not finish within {timeout_s:.0f} s (hung or too slow)")
                break
        if errors:
            _collect_more(procs, q, results, errors, grace_s=2.0)
            first = _root_cause(errors)
            detail = errors[first].strip().splitlines()
            where = ("" if placement.is_identity else
                     f" (slot {placement.physical(first)}, placement {placement})")
            raise RankFailure(
                f"rank {first}{where} failed: {detail[0] if detail else '?'}; ranks that stopped: {sorted(errors)}",
                "all ranks were stopped; rerun with --debug for the traceback" if len(detail) > 1 else
                "all ranks were stopped")
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
        from .memory import keep_freed_memory
        keep_freed_memory()     # as in the ranks run_ranks starts (runtime.memory)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kw)
    return dist.get_rank(), dist.get_world_size()
