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

Minimisation makes every max tight, so the optimum equals ``cost.table.evaluate`` of the
chosen plan (tests check this against brute-force enumeration).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import pulp

from ..cost.table import CostTable, evaluate
from ..errors import InfeasiblePlan, SolverError


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


def _new_var(prob, name: str, cat: str = "Continuous", low: float | None = 0):
    """A variable attached to ``prob`` (PuLP >= 3.3 wants ``add_variable``; older has none)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lowBound=low, cat=cat)
    return pulp.LpVariable(name, lowBound=low, cat=cat)


def _add_variables(prob, table: CostTable):
    x = {(l, i): _new_var(prob, f"x_{l}_{i}", cat="Binary", low=None)
         for l, o in enumerate(table.layers) for i in range(len(o.choices))}
    y = {}
    for ei, e in enumerate(table.edges):
        for i in range(len(table.layers[e.src].choices)):
            for j in range(len(table.layers[e.dst].choices)):
                y[ei, i, j] = _new_var(prob, f"y_{ei}_{i}_{j}")
    step = _new_var(prob, "step")
    return x, y, step


def _add_assignment(prob, table, x):
    for l, o in enumerate(table.layers):
        prob += pulp.lpSum(x[l, i] for i in range(len(o.choices))) == 1, f"one_choice_{l}"


def _add_flow(prob, table, x, y):
    for ei, e in enumerate(table.edges):
        nu, nv = len(table.layers[e.src].choices), len(table.layers[e.dst].choices)
        for i in range(nu):
            prob += pulp.lpSum(y[ei, i, j] for j in range(nv)) == x[e.src, i], f"flow_out_{ei}_{i}"
        for j in range(nv):
            prob += pulp.lpSum(y[ei, i, j] for i in range(nu)) == x[e.dst, j], f"flow_in_{ei}_{j}"


def _edge_terms(e, ei, y, which):
    m = e.fwd_s if which == "fwd" else e.bwd_s
    return [m[i][j] * y[ei, i, j] for i in range(len(m)) for j in range(len(m[0])) if m[i][j]]


def _add_step(prob, table, x, y, step):
    """T_fwd and T_bwd as variables defined by one equality each (sparse rows)."""
    t_fwd = _new_var(prob, "T_fwd")
    t_bwd = _new_var(prob, "T_bwd")
    prob += t_fwd == pulp.lpSum(c.fwd_s * x[l, i] for l, o in enumerate(table.layers)
                                for i, c in enumerate(o.costs) if c.fwd_s) + \
        pulp.lpSum(t for ei, e in enumerate(table.edges) for t in _edge_terms(e, ei, y, "fwd")), "def_T_fwd"
    prob += t_bwd == pulp.lpSum(c.bwd_s * x[l, i] for l, o in enumerate(table.layers)
                                for i, c in enumerate(o.costs) if c.bwd_s) + \
        pulp.lpSum(t for ei, e in enumerate(table.edges) for t in _edge_terms(e, ei, y, "bwd")), "def_T_bwd"
    prob += step >= t_fwd + t_bwd, "step_covers_compute"
    return t_fwd


def _add_overlap(prob, table, x, y, step, t_fwd):
    """Suffix sums S_l of backward time as a chain of variables (each row holds one layer's
    terms), then the allreduce chain F_b over gradient buckets (``table.bucket_of``)."""
    edges_into: dict[int, list[int]] = {}
    for ei, e in enumerate(table.edges):
        edges_into.setdefault(e.dst, []).append(ei)
    bucket = table.bucket_of()
    prev_s = None
    last_s: dict[int, object] = {}            # bucket -> S of its lowest layer
    ar_terms: dict[int, list] = {}
    lat_users: dict[tuple[int, str], dict[int, list[int]]] = {}   # (bucket, group) -> layer -> choices
    lat_s: dict[tuple[int, str], tuple[float, float]] = {}   # (behind backward, last bucket)
    for l in reversed(table.topo):
        o = table.layers[l]
        terms = [c.bwd_s * x[l, i] for i, c in enumerate(o.costs) if c.bwd_s]
        for ei in edges_into.get(l, []):
            terms.extend(_edge_terms(table.edges[ei], ei, y, "bwd"))
        s_l = _new_var(prob, f"S_{l}")
        prob += s_l == (prev_s if prev_s is not None else 0) + pulp.lpSum(terms), f"suffix_{l}"
        prev_s = s_l
        if l in bucket and any(c.grad_sync_s > 0 for c in o.costs):
            b = bucket[l]
            last_s[b] = s_l
            ar_terms.setdefault(b, []).extend(
                (c.grad_sync_s - sum(t for _, t, _ in c.grad_sync_latency)) * x[l, i]
                for i, c in enumerate(o.costs) if c.grad_sync_s)
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
        z = _new_var(prob, f"Zlat_{k}")
        for l, idx in users.items():
            prob += z >= pulp.lpSum(x[l, i] for i in idx), f"lat_{k}_{l}"
        ar_terms[b].append(lat_s[key][1 if b == last else 0] * z)
    prev_f = None
    for b in sorted(ar_terms):
        ar = pulp.lpSum(ar_terms[b])
        f = _new_var(prob, f"F_{b}")
        prob += f >= t_fwd + last_s[b] + ar, f"ready_{b}"
        if prev_f is not None:
            prob += f >= prev_f + ar, f"serial_{b}"
        prev_f = f
    if prev_f is not None:
        prob += step >= prev_f, "step_covers_allreduce"


def _add_memory(prob, table, x, memory_limit_bytes):
    if memory_limit_bytes is None:
        return
    prob += pulp.lpSum(c.memory_bytes * x[l, i] for l, o in enumerate(table.layers)
                       for i, c in enumerate(o.costs)) <= memory_limit_bytes, "memory_per_rank"


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


def solve(table: CostTable, memory_limit_bytes: float | None = None, time_limit_s: float = 60.0,
          solver: str = "highs", msg: bool = False) -> Solution:
    check_memory(table, memory_limit_bytes)
    t0 = time.perf_counter()
    prob = pulp.LpProblem("autopar_plan", pulp.LpMinimize)
    x, y, step = _add_variables(prob, table)
    opt = pulp.lpSum(c.optim_step_s * x[l, i] for l, o in enumerate(table.layers)
                     for i, c in enumerate(o.costs) if c.optim_step_s)
    prob += step + opt
    _add_assignment(prob, table, x)
    _add_flow(prob, table, x, y)
    t_fwd = _add_step(prob, table, x, y, step)
    _add_overlap(prob, table, x, y, step, t_fwd)
    _add_memory(prob, table, x, memory_limit_bytes)
    notes: list[str] = []
    order = ["highs", "cbc"] if solver == "highs" else ["cbc"]
    used = None
    gap = None
    for name in order:
        try:
            if name == "highs":
                s = pulp.HiGHS(msg=msg, timeLimit=time_limit_s, gapRel=1e-6)
                if not s.available():
                    notes.append("HiGHS (highspy) not available; fell back to CBC")
                    continue
            else:
                s = pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit_s, gapRel=1e-6)
            with _quiet(not msg):
                prob.solve(s)
            used = name
            if name == "highs":
                try:
                    gap = float(prob.solverModel.getInfo().mip_gap)
                except Exception:
                    gap = None
            break
        except Exception as e:  # solver crashed: try the next one
            notes.append(f"{name} failed: {e.__class__.__name__}: {e}")
    elapsed = time.perf_counter() - t0
    if used is None:
        raise SolverError("no ILP solver could run: " + "; ".join(notes), "pip install highspy, or check PuLP's CBC")
    status = pulp.LpStatus[prob.status]
    sol_status = int(prob.sol_status)
    if status == "Infeasible":
        raise InfeasiblePlan("the ILP is infeasible under the memory limit",
                             "raise --memory-limit or add ranks")
    if sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise SolverError(f"the solver found no plan within {time_limit_s:.0f} s (status {status})",
                          "raise --time-limit")
    if sol_status == pulp.LpSolutionIntegerFeasible:
        notes.append("time limit reached: the plan is feasible, not proven optimal")
    elif gap is None:
        gap = 0.0
    choice = []
    for l, o in enumerate(table.layers):
        vals = [x[l, i].value() or 0.0 for i in range(len(o.choices))]
        choice.append(max(range(len(vals)), key=lambda i: vals[i]))
    obj = evaluate(table, choice).step_time_s
    return Solution(choice=choice, status=status, sol_status=sol_status, solver=used,
                    time_s=elapsed, gap=gap, objective_s=obj,
                    num_variables=prob.numVariables(), num_constraints=prob.numConstraints(),
                    notes=notes)
