"""The ILP that picks one decomposition per layer (PuLP; HiGHS by default, CBC as fallback).

Sets: layers l (in execution order), choices i of layer l, edges e = (u, v), parametric layers
k in backward order (reverse execution order).

Variables (``_add_variables``):
    x[l,i] in {0,1}     layer l uses choice i
    y[e,i,j] >= 0       edge e carries producer choice i and consumer choice j (continuous: the
                        flow constraints below make it 0/1 whenever x is)
    F[b] >= 0           finish time of gradient bucket b's allreduce
    step >= 0           the step time

Objective: minimise ``step + sum_{l,i} opt[l,i] x[l,i]`` (optimizer update after the step).

Constraints:
    one choice      sum_i x[l,i] = 1                                         (_add_assignment)
    flow            sum_j y[e,i,j] = x[u,i];  sum_i y[e,i,j] = x[v,j]        (_add_flow)
                    (the tight "flow" form: the usual y >= x_u + x_v - 1 linearisation did
                    not finish in 300 s where this form took 3.5 s)
    compute         step >= T_fwd + T_bwd                                    (_add_step)
                    T_fwd = sum x fwd + sum y efwd,  T_bwd = sum x bwd + sum y ebwd
    overlap chain   S_l = S_(l+1) + bwd(l) + bwd(edges into l)  (backward suffix sums)
                    F[b] >= F[b-1] + AR_b;  F[b] >= T_fwd + S_(first layer of b) + AR_b;
                    step >= F[last], over gradient buckets b as the runtime forms them
                    (``runtime.gradsync.layer_buckets``), AR_b = sum over the bucket's layers
                    of sum_i x[l,i] (sync[l,i] - lat[l,i]) + sum_g lat_g z[b,g] with
                    z[b,g] >= sum_(i uses group g) x[l,i] for each l in b (one latency per
                    group and bucket, the last bucket's blocking, as
                    ``cost.table.bucket_allreduce_s``): DDP-style bucket
                    allreduces, each starting when all its gradients exist, one at a time
                                                                             (_add_overlap)
    memory          sum_{l,i} mem[l,i] x[l,i] <= M per rank                   (_add_memory)
    tied            for a parameter used by layers l0, l1, ... (GPT-2's lm_head is wte) and
                    each way k of holding it: sum_(i in S[l0,k]) x[l0,i] = sum_(j in S[l,k])
                    x[l,j] for every other l, S[l,k] the choices of l that hold it so
                    (``cost.table.tied_choice_sets``): one shard serves every use (_add_tied)

Minimisation makes every max tight, so the optimum equals ``cost.table.evaluate`` of the
chosen plan (tests check this against brute-force enumeration).

Size reductions (``_edge_blocks``; exact, they change no optimum): an edge's price depends
only on the producer's output layout and the consumer's input layout, so producer choices with
equal rows of the edge's (fwd, bwd) matrices form one class a, consumer choices with equal
columns one class b, and y runs over class pairs with flow
``sum_b y[e,a,b] = sum_(i in a) x[u,i]`` (the same LP bound: a class solution splits back
over its members in proportion). An edge whose reduced matrices are all zero gets no
variable; one whose matrices are separable (``M[a,b] = r[a] + c[b]``) gets none either: its
price is ``sum_i r x[u,i] + sum_j c x[v,j]``. ResNet-50 at 1024 ranks: 25 k pairs -> ~2 k.

HiGHS first solves the LP relaxation (``_solve_relaxation``): when its optimum is integral in
x (the flow form makes it so on every CNN tried) it is the plan, proven optimal by its own
bound, with no branch and bound (10x faster on ResNet-50 at 1024 ranks). Otherwise the MIP
runs as follows. HiGHS gets the model as arrays (``_Model``: columns and sparse rows, no PuLP expression
objects) and the step time of a start plan as an objective bound (``_start_choices``: the
hint given, e.g. the best plan of another placement, or each layer's cheapest choice,
whichever ``evaluate`` finds faster and fits the memory limit): every branch that cannot beat
it is pruned from the start. CBC, the fallback, reads
the same arrays through PuLP.

Before any of this, ``solve`` (solver "highs", tables of more than ``ILP_MAX_PAIRS``
transition pairs) runs the dynamic program of ``solve.elimination``, which minimises the same
step time exactly over chains of blocks and proves its plan optimal with a lower bound
(96-layer GPT at 1024 ranks: under a second against 185-290 s of branch and bound here). A gap
left keeps the DP's plan with the gap in ``Solution.gap`` and its notes (a table that large
would keep the ILP busy for minutes). ``solver="ilp"`` runs this ILP
alone (the reference the tests hold the DP against).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cost.table import CostTable, evaluate, tied_choice_sets
from ..errors import InfeasiblePlan, SolverError
from .elimination import solve_by_elimination


@dataclass
class Solution:
    choice: list[int]
    status: str
    sol_status: int
    solver: str
    time_s: float
    gap: float | None
    objective_s: float
    num_variables: int
    num_constraints: int
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"solver": self.solver, "status": self.status, "sol_status": self.sol_status,
                "time_s": self.time_s, "gap": self.gap, "objective_s": self.objective_s,
                "variables": self.num_variables, "constraints": self.num_constraints,
                "notes": self.notes}


class _Model:
    """A MILP as arrays: columns (objective, bounds, integrality) and sparse rows."""

    def __init__(self) -> None:
        self.cost: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integer: list[int] = []
        self.names: list[str | None] = []
        self._blocks: list[tuple[int, int, int, str]] = []
        self.rows: list[tuple[np.ndarray, np.ndarray, float, float, str]] = []

    def var(self, name: str, cost: float = 0.0, lo: float = 0.0, hi: float = math.inf,
            integer: bool = False) -> int:
        self.cost.append(cost)
        self.lo.append(lo)
        self.hi.append(hi)
        self.names.append(name)
        if integer:
            self.integer.append(len(self.cost) - 1)
        return len(self.cost) - 1

    def block(self, prefix: str, na: int, nb: int, hi: float = math.inf) -> np.ndarray:
        """``na x nb`` continuous columns named ``{prefix}_{a}_{b}`` (named only when a
        solver asks, ``name``); their indices as an array of that shape."""
        start, n = len(self.cost), na * nb
        self.cost.extend([0.0] * n)
        self.lo.extend([0.0] * n)
        self.hi.extend([hi] * n)
        self.names.extend([None] * n)
        self._blocks.append((start, n, nb, prefix))
        return np.arange(start, start + n, dtype=np.int64).reshape(na, nb)

    def name(self, k: int) -> str:
        if self.names[k] is not None:
            return self.names[k]
        for start, n, nb, prefix in self._blocks:
            if start <= k < start + n:
                return f"{prefix}_{(k - start) // nb}_{(k - start) % nb}"
        raise IndexError(k)

    def row(self, terms: dict[int, float], lo: float, hi: float, name: str) -> None:
        """``lo <= sum coef * var <= hi``; ``terms`` maps column -> coefficient."""
        idx = np.fromiter(terms.keys(), dtype=np.int32, count=len(terms))
        val = np.fromiter(terms.values(), dtype=np.float64, count=len(terms))
        self.rows.append((idx, val, lo, hi, name))

    def row_arrays(self, cols: list, vals: list, lo: float, hi: float, name: str,
                   distinct: bool = False) -> None:
        """The same from pieces of (column, coefficient) arrays; repeated columns add up
        (``distinct``: the caller knows none repeats), zero coefficients are dropped."""
        idx = np.concatenate([np.asarray(c, dtype=np.int64) for c in cols]) if cols else np.zeros(0, np.int64)
        val = np.concatenate([np.asarray(v, dtype=np.float64) for v in vals]) if vals else np.zeros(0)
        if not distinct and len(idx) > 1:
            idx, inv = np.unique(idx, return_inverse=True)
            val = np.bincount(inv, weights=val, minlength=len(idx))
        keep = val != 0.0
        self.rows.append((idx[keep].astype(np.int32), val[keep], lo, hi, name))


def _add(terms: dict[int, float], col: int, coef: float) -> None:
    if coef:
        terms[col] = terms.get(col, 0.0) + coef


def _classes(keys: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Class of each row of ``keys`` (equal rows, one class) and a representative per class."""
    cls = np.empty(len(keys), dtype=np.int64)
    first: dict[bytes, int] = {}
    reps: list[int] = []
    for i, row in enumerate(keys):
        k = row.tobytes()
        c = first.get(k)
        if c is None:
            c = first[k] = len(reps)
            reps.append(i)
        cls[i] = c
    return cls, reps


def _separable(m: np.ndarray) -> bool:
    r = m - m[:, :1] - m[:1, :] + m[0, 0]
    return bool(np.all(np.abs(r) <= 1e-12 * max(1e-300, float(np.max(np.abs(m))))))


@dataclass
class _EdgeBlock:
    """One edge in the model: its price as ``sum coef * column`` in forward and backward
    (``*_cols`` / ``*_vals``: arrays; a column may repeat)."""
    fwd_cols: np.ndarray
    fwd_vals: np.ndarray
    bwd_cols: np.ndarray
    bwd_vals: np.ndarray
    pairs: int          # y variables (class pairs) it needed


_EMPTY_I = np.zeros(0, dtype=np.int64)
_EMPTY_F = np.zeros(0, dtype=np.float64)


def _edge_blocks(m: _Model, table: CostTable, x: dict) -> list[_EdgeBlock]:
    """The flow constraints (_add_flow), over classes of equal rows / columns (module doc)."""
    out = []
    for ei, e in enumerate(table.edges):
        f = np.asarray(e.fwd_s, dtype=np.float64)
        b = np.asarray(e.bwd_s, dtype=np.float64)
        if f.size == 0 or (not f.any() and not b.any()):
            out.append(_EdgeBlock(_EMPTY_I, _EMPTY_F, _EMPTY_I, _EMPTY_F, 0))
            continue
        xs = np.array([x[e.src, i] for i in range(f.shape[0])], dtype=np.int64)
        xd = np.array([x[e.dst, j] for j in range(f.shape[1])], dtype=np.int64)
        ra, rrep = _classes(np.concatenate([f, b], axis=1))
        cb, crep = _classes(np.concatenate([f, b], axis=0).T)
        fr, br = f[np.ix_(rrep, crep)], b[np.ix_(rrep, crep)]
        if _separable(fr) and _separable(br):
            # M[a, b] = r[a] + c[b]: sum_i r x[u,i] + sum_j c x[v,j]
            cols = np.concatenate([xs, xd])
            fv = np.concatenate([fr[:, 0][ra], (fr[0, :] - fr[0, 0])[cb]])
            bv = np.concatenate([br[:, 0][ra], (br[0, :] - br[0, 0])[cb]])
            out.append(_EdgeBlock(cols, fv, cols, bv, 0))
            continue
        na, nb = len(rrep), len(crep)
        y = m.block(f"y_{ei}", na, nb, hi=1.0)
        ones_b, ones_a = np.ones(nb), np.ones(na)
        for a in range(na):
            src = xs[ra == a]
            m.row_arrays([y[a], src], [ones_b, -np.ones(len(src))], 0.0, 0.0, f"flow_out_{ei}_{a}",
                         distinct=True)
        for c in range(nb):
            dst = xd[cb == c]
            m.row_arrays([y[:, c], dst], [ones_a, -np.ones(len(dst))], 0.0, 0.0, f"flow_in_{ei}_{c}",
                         distinct=True)
        yc = y.ravel()
        out.append(_EdgeBlock(yc, fr.ravel(), yc, br.ravel(), na * nb))
    return out


def _add_assignment(m: _Model, table: CostTable) -> dict:
    """x[l,i] (objective: the optimizer step) and one choice per layer."""
    x = {}
    for l, o in enumerate(table.layers):
        for i, c in enumerate(o.costs):
            x[l, i] = m.var(f"x_{l}_{i}", cost=c.optim_step_s, lo=0.0, hi=1.0, integer=True)
        m.row({x[l, i]: 1.0 for i in range(len(o.choices))}, 1.0, 1.0, f"one_choice_{l}")
    return x


def _add_step(m: _Model, table: CostTable, x: dict, edges: list[_EdgeBlock], step: int) -> int:
    """T_fwd and T_bwd defined by one equality each; step >= T_fwd + T_bwd."""
    t_fwd, t_bwd = m.var("T_fwd"), m.var("T_bwd")
    xcols = np.array([x[l, i] for l, o in enumerate(table.layers) for i in range(len(o.costs))], dtype=np.int64)
    for t, which in ((t_fwd, "fwd"), (t_bwd, "bwd")):
        xv = np.array([-(c.fwd_s if which == "fwd" else c.bwd_s) for o in table.layers for c in o.costs])
        cols = [np.array([t]), xcols] + [eb.fwd_cols if which == "fwd" else eb.bwd_cols for eb in edges]
        vals = [np.ones(1), xv] + [-(eb.fwd_vals if which == "fwd" else eb.bwd_vals) for eb in edges]
        m.row_arrays(cols, vals, 0.0, 0.0, f"def_T_{which}")
    m.row({step: 1.0, t_fwd: -1.0, t_bwd: -1.0}, 0.0, math.inf, "step_covers_compute")
    return t_fwd


def _add_overlap(m: _Model, table: CostTable, x: dict, edges: list[_EdgeBlock], step: int,
                 t_fwd: int) -> None:
    """Suffix sums S_l of backward time as a chain of variables (each row holds one layer's
    terms), then the allreduce chain F_b over gradient buckets (``table.bucket_of``)."""
    edges_into: dict[int, list[int]] = {}
    for ei, e in enumerate(table.edges):
        edges_into.setdefault(e.dst, []).append(ei)
    bucket = table.bucket_of()
    prev_s = None
    last_s: dict[int, int] = {}            # bucket -> S of its lowest layer
    ar_terms: dict[int, dict[int, float]] = {}
    lat_users: dict[tuple[int, str], dict[int, list[int]]] = {}   # (bucket, group) -> layer -> choices
    lat_s: dict[tuple[int, str], tuple[float, float]] = {}   # (behind backward, last bucket)
    for l in reversed(table.topo):
        o = table.layers[l]
        s_l = m.var(f"S_{l}")
        cols = [np.array([s_l] + ([prev_s] if prev_s is not None else [])),
                np.array([x[l, i] for i in range(len(o.costs))])]
        vals = [np.array([1.0] + ([-1.0] if prev_s is not None else [])),
                np.array([-c.bwd_s for c in o.costs])]
        for ei in edges_into.get(l, []):
            cols.append(edges[ei].bwd_cols)
            vals.append(-edges[ei].bwd_vals)
        m.row_arrays(cols, vals, 0.0, 0.0, f"suffix_{l}")
        prev_s = s_l
        if l in bucket and any(c.grad_sync_s > 0 for c in o.costs):
            b = bucket[l]
            last_s[b] = s_l
            ar = ar_terms.setdefault(b, {})
            for i, c in enumerate(o.costs):
                if c.grad_sync_s:
                    _add(ar, x[l, i], c.grad_sync_s - sum(t for _, t, _ in c.grad_sync_latency))
            for i, c in enumerate(o.costs):
                for sig in {sig for sig, _, _ in c.grad_sync_latency}:
                    lat_users.setdefault((b, sig), {}).setdefault(l, []).append(i)
                    t = max(t for s_, t, _ in c.grad_sync_latency if s_ == sig)
                    tf = max(tf for s_, _, tf in c.grad_sync_latency if s_ == sig)
                    old = lat_s.get((b, sig), (0.0, 0.0))
                    lat_s[(b, sig)] = (max(old[0], t), max(old[1], tf))
    # each group's latency once per bucket: z[b,g] >= (layer l uses group g) for every l in b
    last = max(ar_terms, default=None)
    for k, (key, users) in enumerate(sorted(lat_users.items(), key=lambda kv: (kv[0][0], kv[0][1]))):
        b, _ = key
        z = m.var(f"Zlat_{k}")
        for l, idx in users.items():
            t = {z: 1.0}
            for i in idx:
                t[x[l, i]] = -1.0
            m.row(t, 0.0, math.inf, f"lat_{k}_{l}")
        _add(ar_terms[b], z, lat_s[key][1 if b == last else 0])
    prev_f = None
    for b in sorted(ar_terms):
        f = m.var(f"F_{b}")
        neg_ar = {col: -v for col, v in ar_terms[b].items()}
        t = dict(neg_ar)
        t[f] = 1.0
        _add(t, t_fwd, -1.0)
        _add(t, last_s[b], -1.0)
        m.row(t, 0.0, math.inf, f"ready_{b}")
        if prev_f is not None:
            t = dict(neg_ar)
            t[f] = 1.0
            _add(t, prev_f, -1.0)
            m.row(t, 0.0, math.inf, f"serial_{b}")
        prev_f = f
    if prev_f is not None:
        m.row({step: 1.0, prev_f: -1.0}, 0.0, math.inf, "step_covers_allreduce")


def _add_memory(m: _Model, table: CostTable, x: dict, memory_limit_bytes) -> None:
    if memory_limit_bytes is None:
        return
    t: dict[int, float] = {}
    for l, o in enumerate(table.layers):
        for i, c in enumerate(o.costs):
            _add(t, x[l, i], c.memory_bytes)
    m.row(t, -math.inf, float(memory_limit_bytes), "memory_per_rank")


def build_model(table: CostTable, memory_limit_bytes: float | None = None):
    """The ILP of the module docstring as a ``_Model``; returns (model, x, pairs kept)."""
    m = _Model()
    step = m.var("step", cost=1.0)
    x = _add_assignment(m, table)
    edges = _edge_blocks(m, table, x)
    t_fwd = _add_step(m, table, x, edges, step)
    _add_overlap(m, table, x, edges, step, t_fwd)
    _add_memory(m, table, x, memory_limit_bytes)
    _add_tied(m, x, tied_choice_sets(table))
    return m, x, sum(e.pairs for e in edges)


def _add_tied(m: _Model, x: dict, sets) -> None:
    """"These option sets must be chosen together": for each tied parameter and each way k of
    holding it, every layer using it picks a choice of its set k or none does (module
    docstring). A set that one layer lacks forces the others' set k to 0."""
    for q, per_shard in sets:
        for k, by_layer in enumerate(per_shard):
            layers = list(by_layer)
            l0 = layers[0]
            for l in layers[1:]:
                t: dict[int, float] = {}
                for i in by_layer[l0]:
                    _add(t, x[l0, i], 1.0)
                for j in by_layer[l]:
                    _add(t, x[l, j], -1.0)
                if t:
                    m.row(t, 0.0, 0.0, f"tied_{q}_{k}_{l0}_{l}")


def tied_ok(table: CostTable, choice: list[int], sets=None) -> bool:
    """Whether ``choice`` holds every tied parameter the same way in all its layers."""
    for _, per_shard in (tied_choice_sets(table) if sets is None else sets):
        picked = {next((k for k, by in enumerate(per_shard) if choice[l] in by[l]), None)
                  for l in per_shard[0]}
        if len(picked) != 1:
            return False
    return True


def _repair_tied(table: CostTable, choice: list[int], sets) -> list[int] | None:
    """``choice`` with the layers of each tied parameter it holds inconsistently moved to the
    cheapest way of holding it that every one of them can take (None when there is none)."""
    def t(c):
        return c.fwd_s + c.bwd_s + c.grad_sync_s + c.optim_step_s
    out = list(choice)
    for _, per_shard in sets:
        layers = list(per_shard[0])
        ks = {next((k for k, by in enumerate(per_shard) if out[l] in by[l]), None) for l in layers}
        if len(ks) == 1:
            continue
        best, best_t = None, math.inf
        for by in per_shard:
            if not all(by[l] for l in layers):
                continue
            pick = {l: min(by[l], key=lambda i: t(table.layers[l].costs[i])) for l in layers}
            tt = sum(t(table.layers[l].costs[i]) for l, i in pick.items())
            if tt < best_t:
                best, best_t = pick, tt
        if best is None:
            return None
        for l, i in best.items():
            out[l] = i
    return out


def check_memory(table: CostTable, memory_limit_bytes: float | None) -> None:
    """Raise InfeasiblePlan naming the layers that cannot fit and the smallest memory that would."""
    if memory_limit_bytes is None:
        return
    mins = [min(c.memory_bytes for c in o.costs) for o in table.layers]
    need = sum(mins)
    if need <= memory_limit_bytes:
        return
    worst = sorted(range(len(mins)), key=lambda l: -mins[l])[:5]
    names = ", ".join(f"{table.layers[l].layer.module or table.layers[l].layer.name} "
                      f"({mins[l] / 2**20:.1f} MiB at best)" for l in worst)
    raise InfeasiblePlan(
        f"no plan fits {memory_limit_bytes / 2**20:.1f} MiB per rank: the smallest possible is "
        f"{need / 2**20:.1f} MiB; the largest layers are {names}",
        f"raise --memory-limit to at least {math.ceil(need / 2**20)}MiB, add ranks, "
        f"or lower the batch size")


def check_tied(table: CostTable, sets=None) -> None:
    """Raise InfeasiblePlan when a layer using a tied parameter can only hold it in ways that
    another layer using it cannot (a pinned choice, say), naming the parameter and the layers."""
    for q, per_shard in (tied_choice_sets(table) if sets is None else sets):
        layers = list(per_shard[0])
        common = [by for by in per_shard if all(by[l] for l in layers)]
        stuck = [l for l in layers if not any(by[l] for by in common)]
        if not stuck:
            continue
        l = min(stuck, key=lambda k: len(table.layers[k].choices))    # a pinned layer first

        def name(k):
            return table.layers[k].layer.module or table.layers[k].layer.name
        others = "; ".join(f"{name(k)}: {[str(d) for d in table.layers[k].choices]}" for k in layers if k != l)
        raise InfeasiblePlan(
            f"parameter {q} is tied: {name(l)} would hold it as {[str(d) for d in table.layers[l].choices]} "
            f"do, which no choice of the other layers using it matches ({others})",
            "pin the layers sharing it to matching splits (vocab(s,p) with vocab_head(s,p)) or keep it whole")


class _quiet:
    """Silence a solver's banner on file descriptor 1 (HiGHS prints one even with msg=False)."""

    def __init__(self, active: bool) -> None:
        self.active = active

    def __enter__(self):
        if self.active:
            import os
            import sys
            sys.stdout.flush()
            self.saved = os.dup(1)
            self.null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(self.null, 1)
        return self

    def __exit__(self, *exc):
        if self.active:
            import os
            os.dup2(self.saved, 1)
            os.close(self.saved)
            os.close(self.null)
        return False


def _start_choices(table: CostTable, memory_limit_bytes, hint) -> list[int] | None:
    """A feasible plan to start from: ``hint`` (a decomposition string per layer, e.g. another
    placement's optimum; layers whose choice is not kept fall back to their cheapest) or each
    layer's cheapest choice, whichever ``evaluate`` finds faster and fits the memory limit."""
    def t(c):
        return c.fwd_s + c.bwd_s + c.grad_sync_s + c.optim_step_s
    cheapest = [min(range(len(o.costs)), key=lambda i: t(o.costs[i])) for o in table.layers]
    starts = [cheapest]
    if hint is not None and len(hint) == len(table.layers):
        h = []
        for o, want, c0 in zip(table.layers, hint, cheapest):
            names = [str(d) for d in o.choices]
            h.append(names.index(want) if want in names else c0)
        starts.append(h)
    sets = tied_choice_sets(table)
    if sets:
        starts = [r for r in (_repair_tied(table, ch, sets) for ch in starts) if r is not None]
    best, best_t = None, math.inf
    for ch in starts:
        mem = sum(table.layers[l].costs[i].memory_bytes for l, i in enumerate(ch))
        if memory_limit_bytes is not None and mem > memory_limit_bytes:
            continue
        st = evaluate(table, ch).step_time_s
        if st < best_t:
            best, best_t = ch, st
    return best


def _solve_relaxation(m: _Model, x: dict, table: CostTable, memory_limit_bytes, time_limit_s: float,
                      msg: bool):
    """The LP relaxation (x continuous in [0, 1]); (choice, lower bound) when its optimum is
    integral, else None. The flow form is tight enough that it usually is (ResNet-50 at 1024
    ranks: 0.04 s against 0.4 s for HiGHS's MIP, whose root LP is the same); the LP optimum
    bounds every plan from below and the integral point is a plan, so it is optimal."""
    relaxed = _Model()
    relaxed.__dict__.update(m.__dict__)
    relaxed.integer = []
    status, _, col, _, lp_s = _solve_highs(relaxed, x, None, time_limit_s, msg)
    if status != "Optimal" or col is None or lp_s is None:
        return None
    choice = []
    for l, o in enumerate(table.layers):
        vals = [col[x[l, i]] for i in range(len(o.choices))]
        i = max(range(len(vals)), key=lambda k: vals[k])
        if vals[i] < 1.0 - 1e-6:
            return None                  # fractional: branch and bound decides
        choice.append(i)
    if memory_limit_bytes is not None and sum(
            table.layers[l].costs[i].memory_bytes for l, i in enumerate(choice)) > memory_limit_bytes:
        return None
    return choice, lp_s


def _solve_highs(m: _Model, x: dict, start_s, time_limit_s: float, msg: bool):
    import highspy
    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(msg))
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-6)
    # HiGHS's presolve took 1.8 s of 2.2 s on ResNet-50 at 1024 ranks (21 k columns) and
    # removed 79 rows; without it the same optimum takes 0.4 s (benchmarks/bench_planning.py)
    h.setOptionValue("presolve", "off")
    n = len(m.cost)
    inf = highspy.kHighsInf
    lo = np.array([v if v != -math.inf else -inf for v in m.lo], dtype=np.float64)
    hi = np.array([v if v != math.inf else inf for v in m.hi], dtype=np.float64)
    h.addCols(n, np.array(m.cost, dtype=np.float64), lo, hi, 0, np.zeros(0, np.int32),
              np.zeros(0, np.int32), np.zeros(0, np.float64))
    if m.integer:
        idx = np.array(m.integer, dtype=np.int32)
        h.changeColsIntegrality(len(idx), idx, np.full(len(idx), 1, dtype=np.uint8))
    starts = np.zeros(len(m.rows), dtype=np.int32)
    nnz = 0
    for k, r in enumerate(m.rows):
        starts[k] = nnz
        nnz += len(r[0])
    index = np.concatenate([r[0] for r in m.rows]).astype(np.int32) if m.rows else np.zeros(0, np.int32)
    value = np.concatenate([r[1] for r in m.rows]) if m.rows else np.zeros(0)
    rlo = np.array([r[2] if r[2] != -math.inf else -inf for r in m.rows], dtype=np.float64)
    rhi = np.array([r[3] if r[3] != math.inf else inf for r in m.rows], dtype=np.float64)
    h.addRows(len(m.rows), rlo, rhi, nnz, starts, index, value)
    if start_s is not None:
        # the start plan's step time bounds the optimum: HiGHS prunes every node above it.
        # (HiGHS 1.16's setSolution made it stop at the start plan with gap 0 on small
        # random tables, tests/test_solver.py; a bound cannot cut the optimum off)
        h.setOptionValue("objective_bound", float(start_s) * (1 + 1e-7) + 1e-12)
    h.run()
    ms = h.getModelStatus()
    info = h.getInfo()
    status_name = h.modelStatusToString(ms)
    has_sol = int(info.primal_solution_status) == 2
    col = list(h.getSolution().col_value) if has_sol else None
    gap = float(info.mip_gap) if has_sol and m.integer else None
    objective = float(info.objective_function_value) if has_sol else None
    if ms == highspy.HighsModelStatus.kOptimal:
        status, sol_status = "Optimal", 1
    elif ms == highspy.HighsModelStatus.kInfeasible:
        status, sol_status = "Infeasible", 0
    elif has_sol:
        status, sol_status = "Optimal", 2      # PuLP's convention: a time limit with a plan
    else:
        status, sol_status = status_name, 0
    return status, sol_status, col, gap, objective


def _solve_cbc(m: _Model, time_limit_s: float, msg: bool):
    import pulp
    prob = pulp.LpProblem("autopar_plan", pulp.LpMinimize)
    ints = set(m.integer)
    vs = [pulp.LpVariable(m.name(k), lowBound=None if lo == -math.inf else lo,
                          upBound=None if hi == math.inf else hi,
                          cat="Integer" if k in ints else "Continuous")
          for k, (lo, hi) in enumerate(zip(m.lo, m.hi))]
    prob += pulp.lpSum(c * vs[k] for k, c in enumerate(m.cost) if c)
    for idx, val, lo, hi, name in m.rows:
        e = pulp.LpAffineExpression([(vs[int(i)], float(v)) for i, v in zip(idx, val)])
        if lo == hi:
            prob += e == lo, name
        else:
            if lo != -math.inf:
                prob += e >= lo, name + "_lo"
            if hi != math.inf:
                prob += e <= hi, name + "_hi"
    with _quiet(not msg):
        prob.solve(pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit_s, gapRel=1e-6))
    status = pulp.LpStatus[prob.status]
    sol_status = int(prob.sol_status)
    col = [v.value() or 0.0 for v in vs] if sol_status in (1, 2) else None
    return status, sol_status, col, None


#: up to this many transition pairs the ILP runs alone: HiGHS's LP relaxation is integral on
#: the shipped CNNs (ResNet-50 at 1024 ranks: 25 k pairs, ~1 s; the DP took 1.4-3.4 s there);
#: above it the DP runs first, and when its bound leaves a gap its plan is kept with the gap
#: printed (a 96-layer GPT at 1024 ranks: 250 k pairs, 185-290 s of HiGHS, 0.5 s of DP)
ILP_MAX_PAIRS = 40_000
#: the DP's plan is called optimal when its bound is this close (HiGHS's own mip_rel_gap)
DP_REL_GAP = 1e-6


def _pairs(table: CostTable) -> int:
    return sum(len(e.fwd_s) * len(e.fwd_s[0]) for e in table.edges if e.fwd_s)


def solve(table: CostTable, memory_limit_bytes: float | None = None, time_limit_s: float = 60.0,
          solver: str = "highs", msg: bool = False, hint: list[str] | None = None) -> Solution:
    """The optimal plan of ``table`` (module docstring), or one within a printed gap.
    ``solver``: "highs" (default): the ILP below ``ILP_MAX_PAIRS`` transition pairs, above it the
    dynamic program of ``solve.elimination`` first, whose plan is kept proven optimal (gap <=
    ``DP_REL_GAP``) or with its gap in ``Solution.gap`` and the notes (the ILP would take
    minutes); where the DP does not apply, the ILP. "ilp": HiGHS's ILP only (the reference);
    "cbc": CBC's.
    ``hint``: a decomposition string per layer to start HiGHS from (e.g. the optimum under
    another placement)."""
    check_memory(table, memory_limit_bytes)
    check_tied(table)
    table.ensure_edges()
    t0 = time.perf_counter()
    dp_notes: list[str] = []
    if solver == "highs" and _pairs(table) > ILP_MAX_PAIRS:
        r = solve_by_elimination(table, memory_limit_bytes, time_limit_s=min(time_limit_s, 20.0))
        if r is None:
            dp_notes.append("dynamic program not applicable here (solve.elimination): ILP")
        elif not tied_ok(table, list(r.choice)):
            # the DP knows no tied parameters: its plan holds one two ways, the ILP decides
            dp_notes.append("dynamic program's plan holds a tied parameter two ways: ILP")
            hint = None
        else:
            pairs = _pairs(table)
            optimal = r.gap <= DP_REL_GAP
            if optimal or pairs > ILP_MAX_PAIRS:     # (always, unless ILP_MAX_PAIRS is changed)
                notes = [f"dynamic program over the layer order (solve.elimination, {r.rounds} rounds): "
                         + ("optimal, proven by its lower bound" if optimal else
                            f"within {100 * r.gap:.3g} % of the optimum (lower bound "
                            f"{r.lower_bound_s * 1e3:.6g} ms); the ILP ({pairs} transition pairs) "
                            f"was not run (--solver ilp runs it)")]
                return Solution(choice=list(r.choice), status="Optimal", sol_status=1 if optimal else 2,
                                solver="dp", time_s=time.perf_counter() - t0, gap=r.gap,
                                objective_s=r.objective_s, num_variables=sum(len(o.choices) for o in table.layers),
                                num_constraints=0, notes=notes)
            dp_notes.append(f"dynamic program: gap {100 * r.gap:.3g} % left, its plan starts the ILP")
            hint = [str(table.layers[l].choices[i]) for l, i in enumerate(r.choice)]
    elif solver == "ilp":
        solver = "highs"
    m, x, pairs = build_model(table, memory_limit_bytes)
    notes: list[str] = list(dp_notes)
    order = ["highs", "cbc"] if solver == "highs" else ["cbc"]
    used = None
    result = None
    start = None
    start_won = False
    for name in order:
        try:
            if name == "highs":
                try:
                    import highspy  # noqa: F401
                except ImportError:
                    notes.append("HiGHS (highspy) not available; fell back to CBC")
                    continue
                with _quiet(not msg):
                    relaxed = _solve_relaxation(m, x, table, memory_limit_bytes, time_limit_s, msg)
                if relaxed is not None:
                    lp_choice, lp_s = relaxed
                    lp_plan_s = evaluate(table, lp_choice).step_time_s
                    gap = max(0.0, (lp_plan_s - lp_s) / max(lp_plan_s, 1e-300))
                    if gap <= 1e-6:          # HiGHS's own mip_rel_gap below
                        result = ("Optimal", 1, None, gap)
                        start, start_won = lp_choice, True
                        notes.append("the LP relaxation's optimum is integral: optimal without branching")
                        used = name
                        break
                start = _start_choices(table, memory_limit_bytes, hint)
                start_s = evaluate(table, start).step_time_s if start is not None else None
                with _quiet(not msg):
                    result = _solve_highs(m, x, start_s, time_limit_s, msg)[:4]
            else:
                result = _solve_cbc(m, time_limit_s, msg)
            used = name
            break
        except Exception as e:  # solver crashed: try the next one
            notes.append(f"{name} failed: {e.__class__.__name__}: {e}")
    elapsed = time.perf_counter() - t0
    if used is None:
        raise SolverError("no ILP solver could run: " + "; ".join(notes), "pip install highspy, or check PuLP's CBC")
    status, sol_status, col, gap = result
    if used == "highs" and not start_won and start is not None and (col is None or status == "Infeasible"):
        if status == "Infeasible":
            # nothing beats the objective bound: the start plan (feasible, checked) is optimal
            status, sol_status, gap, start_won = "Optimal", 1, 0.0, True
        else:
            # HiGHS stopped without a plan for another reason (a time limit): the start plan
            # is feasible but NOT proven optimal; say so instead of calling it optimal
            notes.append(f"HiGHS stopped without a plan ({status}): the start plan is kept")
            status, sol_status, gap, start_won = "Optimal", 2, None, True
    if status == "Infeasible":
        raise InfeasiblePlan("the ILP is infeasible under the memory limit",
                             "raise --memory-limit or add ranks")
    if sol_status not in (1, 2) or (col is None and not start_won):
        raise SolverError(f"the solver found no plan within {time_limit_s:.0f} s (status {status})",
                          "raise --time-limit")
    if sol_status == 2:
        notes.append("time limit reached: the plan is feasible, not proven optimal"
                     + (f" (relative gap {gap:.2g})" if gap is not None else ""))
    elif gap is None:
        gap = 0.0
    choice = list(start) if start_won else []
    for l, o in enumerate(table.layers if not start_won else []):
        vals = [col[x[l, i]] for i in range(len(o.choices))]
        choice.append(max(range(len(vals)), key=lambda i: vals[i]))
    if not tied_ok(table, choice):
        raise SolverError("the plan found holds a tied parameter differently in the layers using it",
                          "report it with the model file; --kinds without vocab,vocab_head avoids it")
    obj = evaluate(table, choice).step_time_s
    return Solution(choice=choice, status=status, sol_status=sol_status, solver=used,
                    time_s=elapsed, gap=gap, objective_s=obj,
                    num_variables=len(m.cost), num_constraints=len(m.rows),
                    notes=notes)
