"""Sharded data parallelism (FSDP / ZeRO) as a decision per planning unit: its value type, its
legality, and its memory and time formulas (pure: no torch, no process; the run-time half is
``autopar.runtime.fsdp``, which applies torch's FSDP2 ``fully_shard`` and DTensor's
``parallelize_module``).

Legend (each formula below uses these names):

    N      ranks on the unit's data axis (its shard group); T ranks on its tensor axis (1: none)
    b      bytes per element of the unit's parameters
    k      optimizer state copies per parameter element (AdamW 2, SGD with momentum 1)
    d0_p   dim 0 of parameter p as one tensor-parallel rank holds it (the whole dim when T = 1)
    rest_p the product of p's other dims on that rank
    c_p    = ceil(d0_p / N): the rows of p's shard on rank 0 (FSDP2 cuts dim 0 as torch.chunk)
    F      = b sum_p d0_p rest_p: the unit's parameters whole on one tensor-parallel rank
    S      = b sum_p c_p rest_p: the unit's padded shard (what every rank allocates)
    G      = b sum_p N c_p rest_p: the padded whole (all-gather output, reduce-scatter input)

Uneven shards, exactly. torch.chunk gives rank r ``max(0, min(c_p, d0_p - r c_p))`` rows of p
(``shard_rows``); FSDP2 allocates ``c_p`` rows on every rank (padding), so storage is S on every
rank and the all-gather moves G bytes; optimizer state is created on the valid rows only, largest
on rank 0 with ``c_p`` rows: k S. Per-rank figures below are rank 0's (the largest).

Levels. A unit's decision is ``Sharded(level, reshard_after_forward, dp, tp)``; what people call
ZeRO-1/2/3 are its levels:

* level 3 (ZeRO-3): parameters, gradients and optimizer state sharded at rest. The unit's
  parameters are all-gathered before its forward and, with ``reshard_after_forward``, freed after
  it and all-gathered again before its backward (2 all-gathers a step, parameters whole only
  while in use); without it they stay whole from forward to backward (1 all-gather, held across
  the activation peak). FSDP2: ``fully_shard(unit, reshard_after_forward=...)``.
* level 2 (ZeRO-2): gradients and optimizer state sharded, parameters whole through the step.
  On FSDP2 it runs as ``reshard_after_forward=False``: parameters are gathered once a step (in
  forward, not after the optimizer step as DeepSpeed does) and held until the unit's backward
  ends, so the step's peak (the forward/backward turn) and its traffic (one all-gather, one
  reduce-scatter of G) are ZeRO-2's. Level 3 without reshard is therefore the same execution
  and is refused (``check``: "use level 2"): one name per execution.
* level 1 (ZeRO-1): only the optimizer state sharded; the gradient stays whole across the
  micro-batches of an accumulation (FSDP2: ``set_requires_gradient_sync(False)`` on all but the
  last micro-batch keeps the unsharded gradient, F bytes, and reduce-scatters once). With one
  micro-batch a step it is level 2 with more memory and is refused (``check``).
* level 1 on torch's ZeRO-1 engine (``engine="ddp_zero"``): parameters and gradients whole on
  every rank, gradients all-reduced by DDP (``torch.distributed._composable.replicate``, names
  kept), the optimizer a ``torch.distributed.optim.ZeroRedundancyOptimizer``: each rank keeps the
  state of and updates only its partition of the parameter tensors, then every updated tensor is
  broadcast from its owner. Plan-wide: DDP wraps the whole module and one optimizer partitions
  every parameter, so either every unit and the root take it or none does (``check_plan``); no
  tensor axis (DDP over DTensor parameters is not run here).

ZeRO-1's partition (``zero1_partition``), as ZeroRedundancyOptimizer makes it: whole tensors, never
cut; the tensors sorted by element count (largest first, ties in model order), each given to the
rank holding the fewest elements so far (the lowest such rank). ``P_r``: the bytes of rank r's
tensors; ``n_r``: how many. Not an even split: the largest rank's ``max_r P_r`` is at least the
largest tensor (an embedding table of a small model can exceed F / N).

Memory per rank of a unit (``unit_memory``), resident through the step::

    params_bytes    = S                      + F   at levels 1, 2 (held forward -> backward)
    grads_bytes     = S                      (level 1: F, the accumulated whole gradient)
    optim_bytes     = k S
    transient_bytes = 2 F + F_next  (level 3 with reshard: the gathered unit, its whole gradient
                                    before the reduce-scatter, the next unit prefetched)
                    = F + F_next    (levels 1, 2: the whole gradient before the reduce-scatter and
                                    the next unit's prefetch)

ZeRO-1 (``zero1_memory_bytes``, plan-wide): params F, grads F (DDP with
``gradient_as_bucket_view``: the buckets are the gradients, no copy), optimizer k max_r P_r over
the whole model, no transient (no gather: the broadcast writes into the parameters in place).

Across a plan, resident bytes add up and transient bytes do not (one unit runs at a time):
``plan_memory_bytes`` = sum of resident + activations + max over units of transient. Against
data parallelism (F + F + k F per unit) level 3 stores (2 + k) S ~ (2 + k) F / N.

Time (``unit_comm``): from the profile's fitted collectives (``Profile.collective_time_s``) on
the data axis' link (intra or inter node: the caller asks ``CostContext.level`` of the group)::

    AG = T_allgather(N, G, link)           per gather; 2 a step at level 3 with reshard, else 1
    RS = T_reduce_scatter(N, G, link)      once a step per micro-batch (level 1: once a step)
    opt_s = optimizer_step_s(n_tensors, k-independent shard bytes S)   the step on the shard

ZeRO-1's time (``unit_comm`` and ``zero1_step_s``): each unit's gradient all-reduced as data
parallelism (AR = T_allreduce(N, F), overlapped with backward as DDP's buckets are), then after
backward, not overlapped::

    opt_s   = max_r optimizer_step_s(n_r, P_r)     the ranks update their partitions at once
    bcast_s = sum_p T_broadcast(N, b_p)            one broadcast per tensor from its owner
                                                   (ZeroRedundancyOptimizer._sync_params)

Against data parallelism (AR + optimizer_step_s(all)) it trades the optimizer on (N-1)/N of the
tensors for the broadcasts: it saves memory (k F (N-1)/N at best), time only where the optimizer
is slow beside the links.

Activation checkpointing (``Sharded.ac``, torchtitan's "full AC" per transformer block): the
unit's forward runs without keeping what autograd would save; only the unit's inputs are kept
(the checkpoint holds them), and its backward first runs its forward again to rebuild the saved
activations, then back-propagates through them. A choice of sharded units other than the root
(FSDP2 engine); at run time ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` wraps
the unit's forward after tensor parallelism and before ``fully_shard`` (torchtitan's order), so
FSDP2's hooks stay outside the checkpoint and the recompute runs on the parameters backward has
gathered already. Per stretch i of an AC unit (``ac_segments``, ``step_peak_bytes``)::

    A_i   the activation bytes the stretch saves without AC (the layer table's)
    I_i   the bytes of the values it reads that layers outside it produce (its inputs, per rank)
    saved_i     = min(I_i, A_i)       kept from forward to backward instead of A_i
    recompute_i = A_i - saved_i       rebuilt during the stretch's own backward, freed by its end
                                      (transient: one unit's recompute at a time); the inputs are
                                      not rebuilt: the recompute's first ops (a norm, a linear
                                      layer) save the kept input tensors themselves, no copy
    bwd_s      += fwd_s               the stretch's forward once more in backward (compute only;
                                      its own layers' exposed communication included, as fwd_s)

The walk of ``step_peak_bytes`` keeps saved_i on the forward side and adds recompute_i while
backward is in stretch i, so the memory saved is A_i - I_i everywhere except in the unit's own
backward (where it holds A_i again, as without AC: checkpointing the last unit saves nothing).
Gathers: none added. Under ZeRO-3 with reshard the unit's backward gathers its parameters anyway (``unit_comm``'s second gather, issued before the unit's backward starts), and
the recompute runs inside that backward, after the gather; levels 1 and 2 hold the parameters
whole from forward to backward. So AC changes compute time and activation bytes, never the
collectives. Not counted: the working set inside one op (as without AC), and inputs that come
from outside every layer (the batch itself, held by the caller); a value read by several AC
units (rotary tables) counts in each, an upper bound.

Choosing (``planner.strategies.sharded``): AC only adds time, so it is taken only where the plan
would not fit the memory limit: units ordered by bytes saved per second added
(``ac_order``: (A - I) / fwd_s, largest first, ties in execution order), and the shortest prefix
of that order whose plan fits is taken (the peak is non-increasing in the prefix, so found by
bisection). Greedy rather than inside the assignment search: AC multiplies the grid by 2^units,
and per unit the trade is one ratio, so ordering by it is the exchange argument of a knapsack
relaxation (exact when the units are alike, as a transformer's blocks are).

Overlap (``schedule``): compute and communication are two streams. Forward: the all-gather of
unit u+1 is issued when unit u's forward starts (FSDP2's prefetch of one unit), so only what
outlasts the compute shows. Backward (reverse order): the gather of unit u-1 is issued when
unit u's backward starts, unit u's reduce-scatter when its backward ends; the communication
stream serves them in issue order. The step ends when both streams are done, plus the optimizer
on the shards. A unit not sharded (data parallel) contributes its all-reduce to the same stream.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

from ..errors import AutoparError

LEVELS = (1, 2, 3)
#: the engines a decision runs on: FSDP2 ``fully_shard`` (every level), or DDP with torch's
#: ZeroRedundancyOptimizer (level 1 only, plan-wide)
FSDP2, DDP_ZERO = "fsdp2", "ddp_zero"
ENGINES = (FSDP2, DDP_ZERO)
_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


class TiedUnitsError(AutoparError):
    """A parameter shared by two planning units (tied weights) that the plan would shard: FSDP2
    manages a parameter in the one unit that registers it, and the other would use it unmanaged.
    Raised by the run-time check (``runtime.fsdp.check_tied``); the planner's sharded strategy
    gives the same words as the reason its candidate is not offered."""

    @classmethod
    def naming(cls, q0: str, u0: str, q: str, u: str) -> "TiedUnitsError":
        return cls(f"parameter {q0} (unit {u0 or '<root>'}) is tied to {q} (unit {u or '<root>'}): "
                   f"two units cannot each shard one tensor",
                   "make both one unit, or leave the shared parameter to the root (plan them unsharded)")


def unit_of(module: str) -> str:
    """The planning unit (block) a module path belongs to: the path up to the first element of a
    ``ModuleList`` / ``Sequential`` (``transformer.h.3.attn`` -> ``transformer.h.3``); "" (the
    root) for a path outside every block."""
    m = _BLOCK.match(module or "")
    return m.group(1) if m else ""


def shard_rows(d0: int, n: int, r: int) -> int:
    """Rows of a dim of ``d0`` that rank ``r`` of ``n`` holds when cut as ``torch.chunk`` cuts
    (FSDP2): chunks of ``ceil(d0 / n)``, the last ones shorter or empty."""
    if n < 1 or not 0 <= r < n:
        raise ValueError(f"rank {r} of {n}")
    c = -(-int(d0) // n)
    return max(0, min(c, int(d0) - r * c))


@dataclass(frozen=True)
class UnitParams:
    """The parameters of one planning unit (a block) as one tensor-parallel rank holds them:
    their shapes (``shapes``, dim 0 first), ``itemsize`` bytes per element and a name."""
    name: str
    shapes: tuple[tuple[int, ...], ...]
    itemsize: int = 4

    @property
    def n_tensors(self) -> int:
        return len(self.shapes)

    def whole_bytes(self) -> float:
        """F: the unit whole on one rank."""
        return float(self.itemsize * sum(math.prod(s) for s in self.shapes))

    def shard_bytes(self, n: int, rank: int | None = None) -> float:
        """S (``rank`` None: the padded shard every rank allocates) or the valid bytes ``rank``
        holds (torch.chunk rows)."""
        tot = 0
        for s in self.shapes:
            if not s:                       # a scalar parameter: not cut, every rank holds it
                tot += 1
                continue
            rest = math.prod(s[1:])
            rows = -(-s[0] // n) if rank is None else shard_rows(s[0], n, rank)
            tot += rows * rest
        return float(self.itemsize * tot)

    def gathered_bytes(self, n: int) -> float:
        """G: the padded whole an all-gather produces (N times the padded shard)."""
        return n * self.shard_bytes(n)


@dataclass(frozen=True)
class Sharded:
    """One unit's sharded-data-parallel decision (module docstring): ``level`` 1, 2 or 3,
    ``reshard_after_forward`` (level 3 only), the data axis (``data_axis`` of ``dp`` ranks) its
    state is sharded over, and the tensor axis (``tensor_axis`` of ``tp`` ranks, 1 = none) its
    layers are tensor-parallel on (DTensor's colwise/rowwise styles, applied first), and the
    ``engine`` (``FSDP2``, or ``DDP_ZERO``: torch's ZeRO-1, level 1 only, plan-wide), and ``ac``:
    activation checkpointing of the unit (module docstring; FSDP2 units only)."""

    kind: ClassVar[str] = "sharded"
    level: int = 3
    reshard_after_forward: bool = True
    dp: int = 1
    tp: int = 1
    data_axis: str = "dp"
    tensor_axis: str = "tp"
    engine: str = FSDP2
    ac: bool = False

    def __str__(self) -> str:
        raf = "" if self.level != 3 else (",reshard" if self.reshard_after_forward else ",keep")
        tp = f",tp{self.tp}" if self.tp > 1 else ""
        eng = ",ddp+zero" if self.engine == DDP_ZERO else ""
        ac = ",ac" if self.ac else ""
        return f"zero{self.level}(dp{self.dp}{tp}{raf}{eng}{ac})"

    def check(self, microbatches: int = 1) -> str | None:
        """None when legal, else why not (module docstring)."""
        if self.level not in LEVELS:
            return f"level {self.level} is not one of {LEVELS}"
        if self.dp < 1 or self.tp < 1:
            return f"axis sizes dp={self.dp}, tp={self.tp} must be >= 1"
        if self.dp == 1:
            return "a data axis of 1 rank shards nothing"
        if self.engine not in ENGINES:
            return f"engine {self.engine!r} is not one of {ENGINES}"
        if self.engine == DDP_ZERO:
            if self.ac:
                return "activation checkpointing is priced and run on FSDP2 units only: use level 2 or 3"
            if self.level != 1 or self.reshard_after_forward:
                return "torch's ZeroRedundancyOptimizer shards the optimizer state only: level 1, no reshard"
            if self.tp > 1:
                return "ZeRO-1 on DDP runs without a tensor axis here: use FSDP2 levels 2 or 3 with tensor parallelism"
            return None
        if self.level != 3 and self.reshard_after_forward:
            return f"level {self.level} keeps parameters whole: reshard_after_forward applies to level 3 only"
        if self.level == 3 and not self.reshard_after_forward:
            return "level 3 without reshard after forward runs as level 2: use level 2"
        if self.level == 1 and microbatches <= 1:
            return "level 1 differs from level 2 only under gradient accumulation (microbatches > 1)"
        return None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "level": self.level, "reshard_after_forward": self.reshard_after_forward,
                "dp": self.dp, "tp": self.tp, "data_axis": self.data_axis, "tensor_axis": self.tensor_axis,
                "engine": self.engine, "ac": self.ac}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Sharded":
        if d.get("kind", cls.kind) != cls.kind:
            raise AutoparError(f"not a sharded decision: kind {d.get('kind')!r}", "a plan written by autopar")
        return cls(int(d["level"]), bool(d["reshard_after_forward"]), int(d["dp"]), int(d.get("tp", 1)),
                   str(d.get("data_axis", "dp")), str(d.get("tensor_axis", "tp")), str(d.get("engine", FSDP2)),
                   bool(d.get("ac", False)))


def check_plan(decisions: Sequence["Sharded | None"]) -> str | None:
    """None when the decisions of a plan's units (the root's included) can run together, else
    why not: ZeRO-1 on DDP is plan-wide (module docstring), every unit or none."""
    z = [s is not None and s.engine == DDP_ZERO for s in decisions]
    if any(z) and not all(z):
        return ("ZeRO-1 on DDP + ZeroRedundancyOptimizer is plan-wide (DDP wraps the whole module, one "
                "optimizer partitions every parameter): every unit and the root take it, or none")
    return None


def candidates(dp: int, tp: int = 1, microbatches: int = 1) -> list[Sharded]:
    """Every legal decision on a (dp, tp) mesh: the levels fall out as choices (ZeRO-1 on DDP
    first, plan-wide: ``check_plan``)."""
    out = [Sharded(1, False, dp, tp, engine=DDP_ZERO)]
    out += [Sharded(level, raf, dp, tp) for level in LEVELS for raf in (True, False)]
    return [s for s in out if s.check(microbatches) is None]


@dataclass(frozen=True)
class UnitMemory:
    """Per-rank bytes of one unit under one decision (module docstring's table)."""
    params_bytes: float
    grads_bytes: float
    optim_bytes: float
    transient_bytes: float

    @property
    def resident_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optim_bytes


def unit_memory(u: UnitParams, s: Sharded | None, optim_copies: float,
                next_whole_bytes: float = 0.0) -> UnitMemory:
    """Memory of unit ``u`` under ``s`` (None: data parallel, everything whole); the formulas of
    the module docstring, with ``next_whole_bytes`` the next unit's F (its prefetch)."""
    F = u.whole_bytes()
    if s is None:
        return UnitMemory(F, F, optim_copies * F, 0.0)
    if s.engine == DDP_ZERO:      # the optimizer state is the plan's partition: zero1_memory_bytes
        return UnitMemory(F, F, 0.0, 0.0)
    S = u.shard_bytes(s.dp)
    if s.level == 3 and s.reshard_after_forward:
        return UnitMemory(S, S, optim_copies * S, 2 * F + next_whole_bytes)
    grads = F if s.level == 1 else S
    return UnitMemory(S + F, grads, optim_copies * S, F + next_whole_bytes)


@dataclass(frozen=True)
class Partition:
    """One rank's share of ZeRO-1's partition: ``n_tensors`` whole tensors of ``param_bytes``."""
    n_tensors: int
    param_bytes: float


def zero1_partition(units: Sequence[UnitParams], n: int) -> tuple[Partition, ...]:
    """ZeroRedundancyOptimizer's partition of the units' tensors over ``n`` ranks (module
    docstring), per rank: largest first (a stable sort: ties in the order given), each to the
    first rank of fewest elements so far."""
    if n < 1:
        raise ValueError(f"{n} ranks")
    tensors = [(math.prod(s), u.itemsize) for u in units for s in u.shapes]
    elems, count, nbytes = [0] * n, [0] * n, [0.0] * n
    for numel, itemsize in sorted(tensors, key=lambda t: -t[0]):
        r = min(range(n), key=elems.__getitem__)
        elems[r] += numel
        count[r] += 1
        nbytes[r] += float(numel * itemsize)
    return tuple(Partition(c, b) for c, b in zip(count, nbytes))


def zero1_memory_bytes(units: Sequence[UnitParams], n: int, optim_copies: float) -> float:
    """ZeRO-1's optimizer state on the rank holding the most: k max_r P_r (module docstring)."""
    return optim_copies * max(p.param_bytes for p in zero1_partition(units, n))


def zero1_step_s(units: Sequence[UnitParams], n: int, collective_s: Callable[[str, int, float], float],
                 optim_step_s: Callable[[int, float], float]) -> float:
    """ZeRO-1's step after backward (module docstring): the slowest rank's optimizer on its
    partition, then one broadcast per tensor from its owner."""
    opt = max(optim_step_s(p.n_tensors, p.param_bytes) for p in zero1_partition(units, n))
    bcast = sum(collective_s("broadcast", n, float(u.itemsize * math.prod(s))) for u in units for s in u.shapes)
    return opt + bcast


def _zero1_optim(params: Sequence[UnitParams], decisions: Sequence["Sharded | None"], optim_copies: float) -> float:
    z = [(u, s) for u, s in zip(params, decisions) if s is not None and s.engine == DDP_ZERO]
    return zero1_memory_bytes([u for u, _ in z], z[0][1].dp, optim_copies) if z else 0.0


@dataclass(frozen=True)
class UnitComm:
    """Seconds of one unit's collectives a step: ``allgather_s`` per gather, how many gathers,
    the reduce-scatter (or, data parallel, the all-reduce) and the optimizer step on the shard."""
    allgather_s: float
    gathers: int
    reduce_s: float
    optim_s: float


def unit_comm(u: UnitParams, s: Sharded | None, collective_s: Callable[[str, int, float], float],
              optim_step_s: Callable[[int, float], float], microbatches: int = 1, world_dp: int = 1) -> UnitComm:
    """The collectives of unit ``u`` under ``s`` (module docstring). ``collective_s(kind, p,
    nbytes)`` is the profile's fit on the data axis' link (the caller binds the link level);
    ``optim_step_s(n_tensors, bytes)`` the optimizer's fit; ``world_dp``: the data axis of a data
    parallel unit (``s`` None), whose gradient is all-reduced whole."""
    F = u.whole_bytes()
    if s is None:
        ar = collective_s("allreduce", world_dp, F) * microbatches if world_dp > 1 else 0.0
        return UnitComm(0.0, 0, ar, optim_step_s(u.n_tensors, F))
    if s.engine == DDP_ZERO:      # DDP's all-reduce; the step and broadcasts: zero1_step_s
        return UnitComm(0.0, 0, collective_s("allreduce", s.dp, F) * microbatches, 0.0)
    G = u.gathered_bytes(s.dp)
    ag = collective_s("allgather", s.dp, G)
    per_step = 1 if s.level == 1 else microbatches
    gathers = (2 if (s.level == 3 and s.reshard_after_forward) else 1) * (microbatches if s.level == 3 else 1)
    rs = collective_s("reduce_scatter", s.dp, G) * per_step
    return UnitComm(ag, gathers, rs, optim_step_s(u.n_tensors, u.shard_bytes(s.dp)))


@dataclass(frozen=True)
class UnitTime:
    """One unit's compute in execution order: forward and backward seconds (exposed
    communication of its own layers, e.g. tensor-parallel all-reduces, included)."""
    fwd_s: float
    bwd_s: float


@dataclass(frozen=True)
class Schedule:
    """``schedule``'s answer: the step and its parts."""
    step_time_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    optimizer_s: float


def schedule(times: Sequence[UnitTime], comms: Sequence[UnitComm], fixed_s: float = 0.0) -> Schedule:
    """Step time of units in execution order on two streams (module docstring, "Overlap")::

        forward, u = 0..n-1:  the gather of u is issued when u-1's forward starts (u = 0: at 0);
                              ag_done_u = max(comm_free, issue_u) + AG_u
                              fwd_start_u = max(fwd_end_(u-1), ag_done_u)
        backward, u = n-1..0: a unit gathered twice is gathered again, issued when u+1's
                              backward starts (u = n-1: when the forward ends);
                              bwd_start_u = max(bwd_end_(u+1), that gather's end)
                              then its reduce-scatter (all-reduce) is issued at bwd_end_u
        step = max(compute end, comm end) + sum_u opt_u + fixed_s

    The communication stream serves collectives in issue order (one process group)."""
    n = len(times)
    comm_free = 0.0
    t = 0.0
    fwd_start = [0.0] * n
    issue = 0.0
    for u in range(n):
        c = comms[u]
        if c.gathers:
            comm_free = max(comm_free, issue) + c.allgather_s
            ready = comm_free
        else:
            ready = 0.0
        fwd_start[u] = max(t, ready)
        issue = fwd_start[u]
        t = fwd_start[u] + times[u].fwd_s
    # backward: unit u's second gather is issued when u+1's backward starts (the last unit's when
    # the forward ends), i.e. before u+1's reduce-scatter, which is issued when u+1's ends
    def regather(u: int, at: float) -> float:
        nonlocal comm_free
        c = comms[u]
        if c.gathers < 2:
            return 0.0
        comm_free = max(comm_free, at) + c.allgather_s * (c.gathers - 1)
        return comm_free

    ready = regather(n - 1, t) if n else 0.0
    for u in reversed(range(n)):
        start = max(t, ready)
        ready = regather(u - 1, start) if u > 0 else 0.0
        t = start + times[u].bwd_s
        if comms[u].reduce_s > 0:
            comm_free = max(comm_free, t) + comms[u].reduce_s
    compute = sum(x.fwd_s + x.bwd_s for x in times)
    comm = sum(c.allgather_s * c.gathers + c.reduce_s for c in comms)
    end = max(t, comm_free)
    opt = sum(c.optim_s for c in comms)
    return Schedule(end + opt + fixed_s, compute, comm, max(0.0, end - compute), opt)


@dataclass(frozen=True)
class PlanMemory:
    resident_bytes: float
    transient_bytes: float
    activation_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.resident_bytes + self.transient_bytes + self.activation_bytes


def plan_memory_bytes(units: Sequence[UnitParams], decisions: Sequence[Sharded | None], optim_copies: float,
                      activation_bytes: float) -> PlanMemory:
    """Per-rank memory of a plan whose units (execution order) take ``decisions``: resident
    bytes add up, the largest transient (a unit in use, the next one prefetched) is added once,
    activations as the layer table prices them (module docstring)."""
    res, trans = 0.0, 0.0
    for i, (u, s) in enumerate(zip(units, decisions)):
        nxt = units[i + 1].whole_bytes() if i + 1 < len(units) and decisions[i + 1] is not None else 0.0
        m = unit_memory(u, s, optim_copies, nxt)
        res += m.resident_bytes
        trans = max(trans, m.transient_bytes)
    res += _zero1_optim(units, decisions, optim_copies)
    return PlanMemory(res, trans, float(activation_bytes))


def is_ac(s: "Sharded | None") -> bool:
    """Whether a unit's decision checkpoints its activations (module docstring)."""
    return s is not None and s.ac


def ac_segments(decisions: Sequence["Sharded | None"], segments: Sequence[int], segment_acts: Sequence[float],
                segment_inputs: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per stretch, (saved_i, recompute_i) of the module docstring's "Activation checkpointing":
    ``min(I_i, A_i)`` and ``A_i - min(I_i, A_i)`` for a stretch of an AC unit, ``A_i`` and 0
    otherwise."""
    saved, again = [], []
    for i, u in enumerate(segments):
        a = float(segment_acts[i])
        if is_ac(decisions[u]):
            keep = min(float(segment_inputs[i]), a)
            saved.append(keep)
            again.append(a - keep)
        else:
            saved.append(a)
            again.append(0.0)
    return saved, again


def recompute_times(times: Sequence["UnitTime"], decisions: Sequence["Sharded | None"],
                    segments: Sequence[int]) -> list["UnitTime"]:
    """The stretches' times with AC's recompute (module docstring): an AC unit's stretch runs its
    forward again in backward, ``bwd_s + fwd_s``."""
    return [UnitTime(t.fwd_s, t.bwd_s + t.fwd_s) if is_ac(decisions[u]) else t for t, u in zip(times, segments)]


def ac_order(units: Sequence[int], segments: Sequence[int], segment_acts: Sequence[float],
             segment_inputs: Sequence[float], times: Sequence["UnitTime"]) -> list[int]:
    """``units`` (the ones that may take AC) ordered by bytes saved per second added, largest
    first, ties in the order given (module docstring): (sum_i A_i - min(I_i, A_i)) / sum_i fwd_s_i
    over each unit's stretches; a unit that saves nothing is left out."""
    saved = {u: 0.0 for u in units}
    cost = {u: 0.0 for u in units}
    for i, u in enumerate(segments):
        if u in saved:
            saved[u] += float(segment_acts[i]) - min(float(segment_inputs[i]), float(segment_acts[i]))
            cost[u] += times[i].fwd_s
    keep = [u for u in units if saved[u] > 0]
    return sorted(keep, key=lambda u: -saved[u] / max(cost[u], 1e-30))


def step_peak_bytes(params: Sequence[UnitParams], decisions: Sequence[Sharded | None], optim_copies: float,
                    segments: Sequence[int], segment_acts: Sequence[float], root: int = 0,
                    segment_inputs: Sequence[float] | None = None) -> PlanMemory:
    """The peak of one step, walked in execution order (the refinement of ``plan_memory_bytes``
    that ``planner.strategies.sharded`` prices with). ``segments``: the unit of each stretch of
    consecutive layers in execution order (the root twice when its head follows the blocks),
    ``segment_acts``: the activation bytes each stretch saves for backward::

        resident  = sum_u resident_u        (unit_memory; levels 1, 2 hold F from forward on: counted
                                             throughout, an upper bound before their forward)
                    + zero1_memory_bytes    (the ZeRO-1 units' optimizer partition)
        gathered_u = F_u at level 3 with reshard (in use), else 0 (held already, or whole)
        grad_u     = F_u for a unit sharded on FSDP2 (its whole gradient before the reduce-scatter),
                     else 0 (ZeRO-1 and data parallel: the gradient is resident already)
        forward, end of stretch i (unit u, next unit n):
            resident + acts(0..i) + F_root (level 3: gathered for the whole forward) + gathered_u
                     + gathered_n (prefetched)
        backward, stretch i (unit u, previous unit q):
            resident + acts(0..i) + gathered_u + grad_u + gathered_q (prefetched)
        peak = the largest of these

    Activations are freed in backward as it passes each stretch; the whole gradient of a unit
    exists only during its backward, while the activations of the later stretches are gone.
    With activation checkpointing (``Sharded.ac``; ``segment_inputs``: I_i per stretch, needed
    then), acts(0..i) sums saved_j (``ac_segments``) and backward in stretch i adds recompute_i."""
    res = sum(unit_memory(u, s, optim_copies).resident_bytes for u, s in zip(params, decisions))
    res += _zero1_optim(params, decisions, optim_copies)

    def gathered(u: int) -> float:
        s = decisions[u]
        return params[u].whole_bytes() if s is not None and s.level == 3 and s.reshard_after_forward else 0.0

    def grad(u: int) -> float:       # a sharded unit's whole gradient before its reduce-scatter
        s = decisions[u]
        return params[u].whole_bytes() if s is not None and s.engine != DDP_ZERO else 0.0
    root_fwd = gathered(root)
    n = len(segments)
    if any(is_ac(s) for s in decisions):
        if segment_inputs is None:
            raise ValueError("activation checkpointing priced without the stretches' input bytes")
        saved, again = ac_segments(decisions, segments, segment_acts, segment_inputs)
    else:
        saved, again = [float(a) for a in segment_acts], [0.0] * n
    acts, peak = 0.0, res
    for i, u in enumerate(segments):
        acts += saved[i]
        nxt = segments[i + 1] if i + 1 < n else None
        held = res + acts + root_fwd + (gathered(u) if u != root else 0.0)
        if nxt is not None and nxt not in (u, root):
            held += gathered(nxt)
        peak = max(peak, held)
    for i in reversed(range(n)):
        u = segments[i]
        prev = segments[i - 1] if i > 0 else None
        held = res + acts + again[i] + gathered(u) + grad(u)
        if prev is not None and prev != u:
            held += gathered(prev)
        peak = max(peak, held)
        acts -= saved[i]
    total_acts = float(sum(saved))
    return PlanMemory(res, max(0.0, peak - res - total_acts), total_acts)
