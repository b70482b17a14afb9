"""The launcher of tournament runs: start every rank, keep the surviving trainers when one dies.

Unlike ``autopar.runtime.launch.run_ranks`` (any failure stops every rank), a rank that raises
or dies here stops only its own trainer: the launcher kills that trainer's other ranks (they
would wait on it in their mesh's collectives), writes the trainer's death marker on the board
if its rank could not (a silent death), and lets the others run to the end; the survivors
learn of it from the board (``autopar.tournament.runtime``), never through a collective. No
wait is unbounded: the whole run has ``timeout_s``, after which the trainers still running are
stopped and reported as hung. The time-out also bounds each trainer's progress: a trainer that
posts no round on the board for ``timeout_s`` (after its start or its last round) is stopped
as hung, so a hung trainer is not waited on past the time-out while the others go on. A child leaves without the world barrier of ``run_ranks`` (a dead
rank would never reach it) and without destroying its process group. Each child reports on a
pipe of its own, not on one shared queue: a rank killed while writing to a shared queue would
leave its lock held and silence every survivor.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from ..errors import RankFailure
from ..runtime.launch import free_port
from ..runtime.memory import keep_freed_memory


def _child(fn, rank, world, args, port, threads, timeout_s, conn):  # pragma: no cover - in child
    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    keep_freed_memory()     # as in the ranks runtime.launch.run_ranks starts
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        out = fn(rank, world, *args)
        conn.send(("ok", out))
    except BaseException as e:
        try:
            conn.send(("error", f"{e.__class__.__name__}: {e}\n{traceback.format_exc(limit=6)}"))
        finally:
            os._exit(1)
    conn.close()
    os._exit(0)


def run_trainers(fn: Callable[..., Any], world: int, ranks_per_trainer: int, args: tuple, board,
                 timeout_s: float, threads: int = 1, max_wall_s: float | None = None) -> tuple[dict[int, Any], dict[int, dict[str, Any]]]:
    """Run ``fn(rank, world, *args)`` on ``world`` forked ranks, trainer t = ranks
    ``[t*n, (t+1)*n)``. Returns (results by rank of the trainers that finished, {trainer:
    {rank, reason, after_s}} of those that stopped). ``timeout_s`` bounds each trainer's
    progress (the watchdog), ``max_wall_s`` (default 10 x ``timeout_s``) the whole run. Raises
    RankFailure only when every trainer stopped."""
    import multiprocessing as mp
    from multiprocessing.connection import wait as wait_conns
    ctx = mp.get_context("fork")
    port = free_port()
    n = ranks_per_trainer
    T = world // n
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=_child, args=(fn, r, world, args, port, threads, timeout_s, pipes[r][1]),
                         daemon=True) for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for _, w in pipes:
        w.close()              # the parent keeps only the read ends: EOF means the child is gone
    reader_rank = {id(pipes[r][0]): r for r in range(world)}
    open_readers = [pipes[r][0] for r in range(world)]
    results: dict[int, Any] = {}
    stopped: dict[int, dict[str, Any]] = {}

    def stop(t: int, rank: int, reason: str) -> None:
        if t in stopped:
            return
        stopped[t] = {"trainer": t, "rank": rank, "reason": reason, "after_s": time.monotonic() - t0}
        board.mark_dead(t, {"trainer": t, "rank": rank, "reason": reason.splitlines()[0][:300],
                            "seen_by": "the launcher", "time": time.time()})
        for r in range(t * n, (t + 1) * n):
            if procs[r].is_alive():
                procs[r].kill()

    def settled() -> bool:
        return all(r in results or (r // n) in stopped for r in range(world))

    wall0 = last_watch = time.time()
    deadline = t0 + (max_wall_s if max_wall_s is not None else 10 * timeout_s)
    try:
        while not settled():
            for conn in wait_conns(open_readers, timeout=0.1):
                r = reader_rank[id(conn)]
                try:
                    status, payload = conn.recv()
                except Exception:    # EOF, or half a message from a rank killed while sending
                    open_readers.remove(conn)
                    if r not in results:
                        procs[r].join(timeout=1.0)
                        stop(r // n, r, f"rank {r} died with exit code {procs[r].exitcode} without reporting")
                    continue
                if status == "ok":
                    results[r] = payload
                else:
                    stop(r // n, r, payload)
            for r, p in enumerate(procs):   # a death (siblings hold copies of the pipe: no EOF)
                if r not in results and (r // n) not in stopped and p.exitcode not in (None, 0):
                    conn = pipes[r][0]
                    if conn in open_readers and conn.poll(0.3):
                        try:
                            status, payload = conn.recv()
                            if status == "ok":
                                results[r] = payload
                                continue
                            stop(r // n, r, payload)
                            continue
                        except Exception:
                            pass
                    stop(r // n, r, f"rank {r} died with exit code {p.exitcode} without reporting")
            now = time.time()
            if now - last_watch >= 0.5:     # progress watchdog (module docstring)
                last_watch = now
                for t in range(T):
                    if t in stopped or all(r in results for r in range(t * n, (t + 1) * n)):
                        continue
                    last = board.last_progress(t) or wall0
                    if now - last > timeout_s:
                        stop(t, t * n, f"hung: no progress on the board for {now - last:.0f} s "
                                       f"(the run's time-out is {timeout_s:.0f} s)")
            if time.monotonic() > deadline:
                for r in range(world):
                    if r not in results and (r // n) not in stopped:
                        stop(r // n, r, f"did not finish within the run's wall limit ({deadline - t0:.0f} s): hung")
        for t in stopped:   # a stopped trainer's partial results are not results
            for r in range(t * n, (t + 1) * n):
                results.pop(r, None)
        if len(stopped) == T:
            first = min(stopped.values(), key=lambda s: s["after_s"])
            raise RankFailure(f"every trainer stopped; first: trainer {first['trainer']} (rank {first['rank']}): "
                              f"{first['reason'].splitlines()[0]}", "rerun with --debug for the traceback")
        return results, stopped
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        for r, _ in pipes:
            r.close()
