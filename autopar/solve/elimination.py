"""The plan by dynamic programming over the layer order, with a proven bound: the ILP's optimum
in well under a second on chains of blocks (a 96-layer GPT at 1024 ranks: 678 layers of up to
17 choices; its ILP has 222 k columns, no integral LP optimum, and takes HiGHS 185-290 s).

The step time that ``cost.table.evaluate`` computes (and the ILP minimises) is a maximum of
functions that are sums over layers and edges. Unrolling its all-reduce recurrence
(``F_b = max(F_(b-1), ready_b) + AR_b``)::

    step = max_k f_k,   f_0 = X,   f_b = X + sum_(b' >= b) AR_b' - sum_(l below e_b) B_l
    X    = sum_l (fwd + bwd + opt)(l) + sum_e (fwd + bwd)(e)

over gradient buckets ``b`` (``cost.table.bucket_allreduce_s``: bandwidth parts add up, each
group's latency is paid once per bucket, the last bucket pays the blocking latencies),
``e_b`` the bucket's lowest layer that synchronises under the plan, ``B_l`` the backward time
of layer l and of the edges into it. ``_Structure`` writes the f_k as factors; where a layer
synchronises under some of its choices only (``e_b`` then moves with the plan), where the
last bucket is not the same for every plan, or where a bucket's latency factor would span too
many layers, it writes a lower estimate instead (``checkpoint_values``: never above evaluate's
maximum), so every bound below stays a bound, and every plan is priced by ``evaluate``.

1. ``_eliminate``: ``min_plan f_0`` (or any ``sum_k lambda_k f_k``, lambda >= 0 summing to 1:
   a lower bound of the optimum) by variable elimination in reverse execution order, over
   tensors of the pending layers (two or three on a GPT).
2. ``_exact_top(base)``: the exact ``min_plan max_(k at or above base's bucket) f_k``: below
   that bucket every such f_k weighs the layers alike (a sum of factors, eliminated in
   execution order), above it the f_k differ by a walk whose maximum prefix composes from the
   top, ``c = max(0, a + c_rest)``, so a DP in reverse order keeps per state (the pending
   layers' choices) the Pareto set of (X, c) of the decided suffix (inside an open bucket
   also its bandwidth time so far and the walk from its lowest synchronising layer so far).
   Its value is a lower bound; when the plan it returns has its maximum among those f_k, the
   plan is optimal. Otherwise the region moves down to that plan's maximum, and at last to
   the whole model (``base`` 0), each within the limits on states, points and time.
3. Only when step 2 meets its limits: Kelley's cutting planes on the weights lambda over the
   checkpoints that were some plan's maximum (``_dual_weights``, a small LP), for a better
   bound and more plans.

``gap`` is (best plan - best bound) / best plan; ``solve.ilp.solve`` calls the plan optimal
when the gap is within HiGHS's own tolerance, and otherwise runs the ILP where it is small
(or keeps this plan with the gap printed). The memory limit is not part of the DP: under one,
the plan is kept only when it fits (the unconstrained optimum that fits is the constrained
one), else None.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from ..cost.table import CostTable, evaluate



@dataclass
class EliminationResult:
    choice: list[int]
    objective_s: float          # evaluate(table, choice).step_time_s: the upper bound
    lower_bound_s: float        # no plan is faster than this
    rounds: int
    time_s: float

    @property
    def gap(self) -> float:
        return max(0.0, (self.objective_s - self.lower_bound_s) / max(self.objective_s, 1e-300))


class _Structure:
    """The step-time model of a table as arrays (the module docstring's f_k), built once."""

    def __init__(self, table: CostTable):
        table.ensure_edges()
        self.table = table
        n = self.n = len(table.layers)
        self.topo = list(table.topo)
        self.pos = {l: k for k, l in enumerate(self.topo)}
        self.ok = sorted(self.topo) == list(range(n))
        self.k = [len(o.costs) for o in table.layers]
        self.fwd_opt = [np.array([c.fwd_s + c.optim_step_s for c in o.costs]) for o in table.layers]
        self.bwd = [np.array([c.bwd_s for c in o.costs]) for o in table.layers]
        # a choice that does not synchronise has no bucket terms (evaluate leaves it out)
        self.synced = [[c.grad_sync_s > 0 for c in o.costs] for o in table.layers]
        self.gsbw = [np.array([c.grad_sync_s - sum(t for _, t, _ in c.grad_sync_latency) if c.grad_sync_s > 0
                               else 0.0 for c in o.costs]) for o in table.layers]
        # edges summed per (producer, consumer): fwd and bwd matrices [i_u, i_v]
        pair: dict[tuple[int, int], list[np.ndarray]] = {}
        for e in table.edges:
            if not e.fwd_s or not e.fwd_s[0]:
                continue
            f, b = np.asarray(e.fwd_s, dtype=np.float64), np.asarray(e.bwd_s, dtype=np.float64)
            if not f.any() and not b.any():
                continue
            if e.src == e.dst or (self.ok and self.pos[e.src] >= self.pos[e.dst]):
                self.ok = False
            if (e.src, e.dst) in pair:
                pair[e.src, e.dst][0] = pair[e.src, e.dst][0] + f
                pair[e.src, e.dst][1] = pair[e.src, e.dst][1] + b
            else:
                pair[e.src, e.dst] = [f, b]
        self.pairs = pair
        # buckets: their layers that synchronise under some choice. A bucket's all-reduce
        # starts at its lowest layer that synchronises under the plan; ``event_pos`` is the
        # lowest that does under every choice (its highest layer when none does): the
        # f_b below then never exceed evaluate's (a lower bound stays a lower bound; ``sure``)
        members: dict[int, list[int]] = {}
        for l, b in table.bucket_of().items():
            if any(self.synced[l]):
                members.setdefault(b, []).append(l)
        self.members = {b: sorted(ls, key=lambda l: self.pos[l]) for b, ls in members.items()}
        self.bucket_ids = sorted(self.members)          # checkpoint k = 1 + index here
        self.lo = {b: self.pos[ls[0]] for b, ls in self.members.items()}
        self.event_pos = []
        for b in self.bucket_ids:
            sure = [l for l in self.members[b] if all(self.synced[l])]
            self.event_pos.append(self.pos[sure[0]] if sure else self.pos[self.members[b][-1]])
        # the last bucket pays the blocking latencies; which one is last depends on the plan
        # unless the highest-numbered bucket syncs under every plan: otherwise none is priced
        # final here (lower, so still a bound; evaluate prices the plans found)
        top = self.bucket_ids[-1] if self.bucket_ids else None
        self.last = top if top is not None and any(all(self.synced[l]) for l in self.members[top]) else None
        self.bucket_of_layer = {l: b for b, ls in self.members.items() for l in ls}
        # latency factors: per bucket, the layers with latency terms and per group the arrays
        self.lat: dict[int, tuple[list[int], list[list[np.ndarray]]]] = {}
        self.lat_unary: dict[int, list[tuple[int, np.ndarray]]] = {}
        for b, ls in self.members.items():
            final = b == self.last
            sigs = sorted({s for l in ls for c in table.layers[l].costs for s, _, _ in c.grad_sync_latency})
            users = [l for l in ls if any(c.grad_sync_latency for c in table.layers[l].costs)]
            if not users:
                continue
            per_sig = []
            for s in sigs:
                arrs = []
                for l in users:
                    arrs.append(np.array([max([tf if final else t for s_, t, tf in c.grad_sync_latency if s_ == s],
                                              default=0.0) if c.grad_sync_s > 0 else 0.0
                                          for c in table.layers[l].costs]))
                per_sig.append(arrs)
            span = self.pos[users[-1]] - self.pos[users[0]] if len(users) > 1 else 0
            if len(users) > 3 or span > 8 or math.prod(self.k[l] for l in users) > 50_000:
                # too wide a factor: each group's latency at one layer only (the one that can
                # pay the most), a lower estimate (the exact DP of _exact_top prices it whole)
                per_sig = [[a if d == int(np.argmax([x.max() for x in arrs])) else np.zeros_like(a)
                            for d, a in enumerate(arrs)] for arrs in per_sig]
                self.lat_unary[b] = [(users[int(np.argmax([x.max() for x in arrs]))],
                                      arrs[int(np.argmax([x.max() for x in arrs]))]) for arrs in per_sig]
            self.lat[b] = (users, per_sig)

    # --- the functions f_k of one plan --------------------------------------------------------
    def checkpoint_values(self, choice: list[int]) -> np.ndarray:
        """[f_0, f_1, ...] of the module docstring for one plan (f_k: bucket bucket_ids[k-1]);
        their maximum is evaluate's step time when every bucket layer syncs under all of its
        choices or none, and at most that otherwise."""
        t = self.table
        cs = [t.layers[l].costs[choice[l]] for l in range(self.n)]
        b_l = np.array([c.bwd_s for c in cs])
        x = sum(c.fwd_s + c.bwd_s + c.optim_step_s for c in cs)
        for (u, v), (f, b) in self.pairs.items():
            x += f[choice[u], choice[v]] + b[choice[u], choice[v]]
            b_l[v] += b[choice[u], choice[v]]
        ar = []
        for b in self.bucket_ids:
            a = sum(self.gsbw[l][choice[l]] for l in self.members[b])
            if b in self.lat:       # the latency factor's own value (module docstring)
                users, per_sig = self.lat[b]
                a += sum(max(arr[choice[l]] for l, arr in zip(users, arrs)) for arrs in per_sig)
            ar.append(a)
        b_pos = np.zeros(self.n)
        for l in range(self.n):
            b_pos[self.pos[l]] = b_l[l]
        below = np.concatenate([[0.0], np.cumsum(b_pos)])     # below[p]: B of positions < p
        suffix_ar = np.cumsum(ar[::-1])[::-1] if ar else np.zeros(0)   # sum over ids >= this
        f = [x] + [x + suffix_ar[k] - below[self.event_pos[k]] for k in range(len(ar))]
        return np.array(f)

    # --- min over plans of sum_k lambda_k f_k ---------------------------------------------------
    def _factors(self, lam: np.ndarray) -> list[tuple[tuple[int, ...], np.ndarray]]:
        nb = len(self.bucket_ids)
        lam_b = lam[1:]
        # v_b = sum of lambda_k over checkpoints k whose sum of AR includes b (ids <= b)
        v = np.cumsum(lam_b) if nb else np.zeros(0)
        # w_l = sum of lambda_k over checkpoints whose event lies above layer l
        w_pos = np.zeros(self.n + 1)
        for k in range(nb):
            w_pos[self.event_pos[k]] += lam_b[k]   # counts for positions < event_pos
        w_at = np.cumsum(w_pos[::-1])[::-1]        # w_at[p] = sum over events at positions >= p
        v_of = {b: v[k] for k, b in enumerate(self.bucket_ids)}
        factors = []
        for l in range(self.n):
            wl = w_at[self.pos[l] + 1]
            cost = self.fwd_opt[l] + (1.0 - wl) * self.bwd[l]
            b = self.bucket_of_layer.get(l)
            if b is not None:
                cost = cost + v_of[b] * self.gsbw[l]
            factors.append(((l,), cost))
        for (u, vv), (f, b) in self.pairs.items():
            wl = w_at[self.pos[vv] + 1]
            factors.append(((u, vv), f + (1.0 - wl) * b))
        for b, (users, per_sig) in self.lat.items():
            if v_of[b] == 0.0:
                continue
            if b in self.lat_unary:
                factors.extend(((l,), v_of[b] * a) for l, a in self.lat_unary[b])
                continue
            shape = [self.k[l] for l in users]
            total = np.zeros(shape)
            for arrs in per_sig:
                m = np.zeros(shape)
                for d, a in enumerate(arrs):
                    s = [1] * len(users)
                    s[d] = len(a)
                    m = np.maximum(m, a.reshape(s))
                total = total + m
            factors.append((tuple(users), v_of[b] * total))
        return factors

    def eliminate(self, lam: np.ndarray) -> tuple[list[int], float]:
        """The plan minimising sum_k lam_k f_k, and that minimum: variable elimination in
        reverse execution order, then assignment in execution order."""
        const, _, trail = _eliminate(self._factors(lam), list(reversed(self.topo)), self.k)
        choice = [0] * self.n
        _assign(trail, choice)
        return choice, const


def _eliminate(factors: list, order: list[int], k: list[int]):
    """Min-sum variable elimination of ``factors`` ((scope, array) pairs) over the variables
    of ``order``, in that order. Returns (constant, factors left over the other variables,
    trail for ``_assign``). The trail keeps, per variable, only its best value for each value of
    the rest of its scope (``argmin`` over its axis, in the smallest integer type), and a factor
    is let go once summed: the sums themselves (k^|scope| floats, 7^9 x 8 bytes = 323 MB for a
    Llama-8B block at 64 ranks, hundreds of them) would not fit in memory together."""
    by_var: dict[int, list[int]] = {}
    factors = list(factors)
    alive = [True] * len(factors)
    for fi, (scope, _) in enumerate(factors):
        for var in scope:
            by_var.setdefault(var, []).append(fi)
    trail = []
    const = 0.0
    for var in elimination_order([s for s, _ in factors], order, k, WIDE_TABLE_ENTRIES):
        ids = [fi for fi in by_var.get(var, []) if alive[fi]]
        scope: list[int] = [var]
        for fi in ids:
            for u in factors[fi][0]:
                if u not in scope:
                    scope.append(u)
        total = np.zeros([k[u] for u in scope])
        for fi in ids:
            alive[fi] = False
            s, arr = factors[fi]
            factors[fi] = None
            axes = [scope.index(u) for u in s]
            arr = np.transpose(arr, np.argsort(axes))        # axes now in scope order
            rs = [1] * len(scope)
            for u in s:
                rs[scope.index(u)] = k[u]
            total = total + arr.reshape(rs)
        reduced = total.min(axis=0)
        best = total.argmin(axis=0)
        trail.append((var, scope, best.astype(np.min_scalar_type(max(k[var] - 1, 0)))))
        del total
        if len(scope) == 1:
            const += float(reduced)
            continue
        fi = len(factors)
        factors.append((tuple(scope[1:]), reduced))
        alive.append(True)
        for u in scope[1:]:
            by_var.setdefault(u, []).append(fi)
    left = [f for f, a in zip(factors, alive) if a]
    return const, left, trail


WIDE_TABLE_ENTRIES = 1 << 16


def elimination_order(scopes: list, order: list[int], k: list[int], wide: int) -> list[int]:
    """The order ``_eliminate`` takes the variables of ``order`` in: ``order`` itself (reverse
    execution order: the pending layers of a chain, two or three on a GPT) unless one of the
    tables it would build exceeds ``wide`` entries; then the greedy min-size order (the variable
    whose table, the product of ``k`` over its scope with every factor it touches merged, is
    smallest next; ties by position in ``order``), recomputed for the neighbours of each one taken.

    Why: min-sum elimination of a set of variables leaves the same function over the others in any
    order (only the tables built on the way differ), and ``_assign`` takes the trail backwards in
    whatever order it was made. The execution order fails on values read by every block (the
    rotary tables of a Hugging Face Llama): they stay pending down the whole model, so every
    block's table spans them: 4^7 entries at 8 ranks, 7^9 at 64 (40 M floats, an argmin over each,
    1 minute a solve), against 64 entries at 8 ranks in the greedy order."""
    scopes = [set(s) for s in scopes]
    by_var: dict[int, set[int]] = {}
    for fi, s in enumerate(scopes):
        for v in s:
            by_var.setdefault(v, set()).add(fi)
    alive = [True] * len(scopes)

    def merged(v) -> set[int]:
        out = {v}
        for fi in by_var.get(v, ()):
            out |= scopes[fi]
        return out

    def take(v) -> set[int]:          # eliminate v symbolically; returns its table's scope
        sc = merged(v)
        for fi in by_var.pop(v, set()):
            alive[fi] = False
            for u in scopes[fi]:
                if u != v:
                    by_var[u].discard(fi)
        rest = sc - {v}
        if rest:
            scopes.append(rest)
            alive.append(True)
            for u in rest:
                by_var.setdefault(u, set()).add(len(scopes) - 1)
        return sc

    saved = ([set(s) for s in scopes], {v: set(f) for v, f in by_var.items()}, list(alive))
    if max((math.prod(k[u] for u in take(v)) for v in order), default=0) <= wide:
        return list(order)
    scopes, by_var, alive = saved
    pos = {v: i for i, v in enumerate(order)}
    cost = {v: math.prod(k[u] for u in merged(v)) for v in order}
    heap = [(c, pos[v], v) for v, c in cost.items()]
    heapq.heapify(heap)
    out: list[int] = []
    done: set[int] = set()
    while heap:
        c, _, v = heapq.heappop(heap)
        if v in done or c != cost[v]:
            continue
        done.add(v)
        out.append(v)
        for u in take(v) - {v}:
            if u in cost and u not in done:
                cost[u] = math.prod(k[w] for w in merged(u))
                heapq.heappush(heap, (cost[u], pos[u], u))
    return out


def _assign(trail: list, choice: list[int]) -> None:
    """Back through an elimination trail: each variable's best value given the variables
    eliminated after it (already in ``choice``)."""
    for var, scope, best in reversed(trail):
        choice[var] = int(best[tuple(choice[u] for u in scope[1:])])


def _prune(points: list[tuple]) -> list[tuple]:
    """The points (X, c, G, AR, back) that no other point dominates (smaller is better in
    each of the first four)."""
    if len(points) <= 1:
        return points
    points.sort(key=lambda p: (p[0], p[1], p[2], p[3]))
    out: list[tuple] = []
    if all(p[2] == -math.inf and p[3] == 0.0 for p in points):     # no bucket open: (X, c)
        best_c = math.inf
        for p in points:
            if p[1] < best_c:
                out.append(p)
                best_c = p[1]
        return out
    for p in points:
        if not any(q[1] <= p[1] and q[2] <= p[2] and q[3] <= p[3] for q in out):   # q[0] <= p[0]
            out.append(p)
    return out


def _exact_top(st: _Structure, base: int, deadline: float, upper_s: float = math.inf,
               max_states: int = 4096, max_points: int = 400_000) -> tuple[list[int] | None, float] | None:
    """``min over plans of max over the checkpoints at or above checkpoint ``base``'s event`` (a
    lower bound of the optimum, and the optimum when the plan's maximum is one of them), exactly:

    * below the event (positions < p0), f_base is a sum of factors: eliminated in execution
      order down to the layers the region above reads (``_eliminate``), leaving M(pending);
    * above it, ``f_k - f_base = sum_(k <= b < base) AR_b - sum_(p0 <= pos(l) < e_k) B_l`` is a
      walk from p0 upwards whose maximum prefix ``c`` composes from the top,
      ``c = max(0, a + c_rest)``: a DP in reverse order over the choices of the pending layers
      with, per state, the Pareto set of (X, c) (within an open bucket also its bandwidth time
      AR so far, the walk G from its lowest member so far, and its group latencies in the key);
    * the answer is the least X + c + M(pending) over the states at p0;
    * ``upper_s`` (a plan's step time) prunes: a point whose X + min M + the least its c can
      fall to is no less cannot beat that plan. The value returned is then min(answer,
      upper_s), still a lower bound, with no plan (None) when nothing beat ``upper_s``.
    None when the buckets above are not intervals numbered downwards, or a limit is reached."""
    t = st.table
    p0 = 0 if base == 0 else st.lo[st.bucket_ids[base - 1]]    # base 0: the whole model
    region = [b for b in st.bucket_ids if st.lo[b] >= p0]
    for b in st.bucket_ids:
        if st.lo[b] < p0 <= st.pos[st.members[b][-1]]:
            return None                  # a bucket across the boundary
    for b1, b2 in zip(region, region[1:]):   # the walk's order is the buckets' numbering
        if st.pos[st.members[b2][-1]] >= st.lo[b1]:
            return None
    lo = st.lo
    lat_of = {l: [tuple(c.grad_sync_latency) for c in t.layers[l].costs] for l in range(st.n)}
    into: dict[int, list[int]] = {}
    for (u, v) in st.pairs:
        into.setdefault(v, []).append(u)
    # below p0 (first, for the pruning bound): f_base's factors, eliminated down to the layers
    # the region reads; below p0 every checkpoint above weighs the same (B cancels, AR counts)
    final_pending = tuple(sorted({u for (u, v) in st.pairs if st.pos[v] >= p0 > st.pos[u]},
                                 key=lambda u: st.pos[u]))
    lam = np.zeros(1 + len(st.bucket_ids))
    lam[base] = 1.0
    below = [f for f in st._factors(lam) if all(st.pos[u] < p0 for u in f[0])] if p0 > 0 else []
    order = [l for l in st.topo if st.pos[l] < p0 and l not in set(final_pending)]
    const, left, trail = _eliminate(below, order, st.k)
    m_min = const + _eliminate(left, list(final_pending), st.k)[0]
    # the most backward time the region's layers below position p can still subtract
    rest_b = [0.0] * (st.n + 1)
    for q in range(p0, st.n):
        lq = st.topo[q]
        bq = max(st.bwd[lq][i] + sum(float(st.pairs[u, lq][1][:, i].max()) for u in into.get(lq, []))
                 for i in range(st.k[lq]))
        rest_b[q + 1] = rest_b[q] + bq
    pending: tuple[int, ...] = ()
    states: dict[tuple, list[tuple]] = {((), ()): [(0.0, 0.0, -math.inf, 0.0, None)]}
    for p in range(st.n - 1, p0 - 1, -1):
        if time.perf_counter() > deadline:
            return None
        l = st.topo[p]
        prods = sorted(into.get(l, []), key=lambda u: st.pos[u])
        new_prods = [u for u in prods if u not in pending]
        new_pending = tuple(sorted((set(pending) - {l}) | set(prods), key=lambda u: st.pos[u]))
        where = {u: k for k, u in enumerate(pending)}
        b = st.bucket_of_layer.get(l)
        closes = b is not None and lo[b] == p
        final = b == st.last
        combos = list(itertools.product(*[range(st.k[u]) for u in new_prods]))
        out: dict[tuple, list[tuple]] = {}
        made = 0
        for (key, lkey), pts in states.items():
            choices_l = [key[where[l]]] if l in where else range(st.k[l])
            for i in choices_l:
                syn = b is not None and st.synced[l][i]
                if syn:
                    lk = {s_: (a_, f_) for s_, a_, f_ in lkey}
                    for s_, a_, f_ in lat_of[l][i]:
                        o_ = lk.get(s_)
                        lk[s_] = (a_, f_) if o_ is None else (max(o_[0], a_), max(o_[1], f_))
                    lkey2 = tuple(sorted((s_, a_, f_) for s_, (a_, f_) in lk.items()))
                else:
                    lkey2 = lkey
                lat_s = sum(f_ if final else a_ for _, a_, f_ in lkey2) if closes else 0.0
                lkey_out = () if closes else lkey2
                x_l = st.fwd_opt[l][i] + st.bwd[l][i]
                b_l = st.bwd[l][i]
                gs = st.gsbw[l][i] if syn else 0.0
                for combo in combos:
                    asg = {u: key[where[u]] for u in prods if u in where}
                    asg.update(zip(new_prods, combo))
                    dx, db = x_l, b_l
                    for u in prods:
                        f, bb = st.pairs[u, l]
                        dx += f[asg[u], i] + bb[asg[u], i]
                        db += bb[asg[u], i]
                    nkey = tuple(asg[u] if u in asg else key[where[u]] for u in new_pending)
                    dest = out.setdefault((nkey, lkey_out), [])
                    made += len(pts)
                    if made > max_points:
                        return None
                    if not closes:       # the common cases as comprehensions (-inf - db = -inf)
                        if syn:
                            dest.extend([(x + dx, c2, c2, a + gs, (back, l, i)) for x, c, g, a, back in pts
                                         for c2 in ((c - db) if c > db else 0.0,)])
                        else:
                            dest.extend([(x + dx, (c - db) if c > db else 0.0, g - db, a, (back, l, i))
                                         for x, c, g, a, back in pts])
                        continue
                    for x, c, g, a, back in pts:
                        c2 = c - db
                        if c2 < 0.0:
                            c2 = 0.0
                        if syn:
                            a2, g2 = a + gs, c2
                        else:
                            a2, g2 = a, (g - db if g != -math.inf else g)
                        if closes:
                            if g2 != -math.inf and a2 + lat_s + g2 > c2:
                                c2 = a2 + lat_s + g2
                            g2, a2 = -math.inf, 0.0
                        dest.append((x + dx, c2, g2, a2, (back, l, i)))
        if time.perf_counter() > deadline:
            return None
        if upper_s < math.inf:
            rb, cut = rest_b[p], upper_s - m_min
            out = {k_: [q for q in v_ if q[0] + max(0.0, q[1] - rb) < cut] for k_, v_ in out.items()}
            out = {k_: v_ for k_, v_ in out.items() if v_}
            if not out:
                return None, upper_s     # no plan beats upper_s: it is the optimum
        states = {k_: _prune(v_) for k_, v_ in out.items()}
        pending = new_pending
        if len(states) > max_states or max(len(v_) for v_ in states.values()) > 300:
            return None
    if pending != final_pending:
        return None
    best, best_v = None, math.inf
    for (key, _), pts in states.items():
        m = const + sum(float(arr[tuple(key[pending.index(u)] for u in scope)]) for scope, arr in left)
        for x, c, _, _, back in pts:
            if x + c + m < best_v:
                best, best_v = (key, back), x + c + m
    if best is None:
        return None
    if best_v >= upper_s:
        return None, upper_s
    choice = [0] * st.n
    key, back = best
    for u, i in zip(pending, key):
        choice[u] = i
    while back is not None:
        back, l, i = back
        choice[l] = i
    _assign(trail, choice)
    return choice, best_v


def _dual_weights(rows: list[np.ndarray], active: list[int]) -> tuple[np.ndarray, float]:
    """Kelley's master LP: max t s.t. t <= sum_(k in active) lam_k f_k(p) for each plan p found,
    sum lam = 1, lam >= 0. Returns (lam over active, t)."""
    from scipy.optimize import linprog
    na = len(active)
    c = np.zeros(na + 1)
    c[-1] = -1.0
    scale = max(1e-300, max(float(np.max(np.abs(r[active]))) for r in rows))
    a_ub = np.array([np.concatenate([-r[active] / scale, [1.0]]) for r in rows])
    res = linprog(c, A_ub=a_ub, b_ub=np.zeros(len(rows)),
                  A_eq=np.concatenate([np.ones(na), [0.0]])[None, :], b_eq=[1.0],
                  bounds=[(0, None)] * na + [(None, None)], method="highs")
    if res.status != 0:
        return np.full(na, 1.0 / na), -math.inf
    return np.clip(res.x[:na], 0.0, None), float(res.x[-1]) * scale


def solve_by_elimination(table: CostTable, memory_limit_bytes: float | None = None,
                         max_rounds: int = 40, time_limit_s: float = 20.0,
                         rel_tol: float = 1e-9) -> EliminationResult | None:
    """The best plan found and a lower bound of every plan (module docstring), or None when
    the model falls outside its assumptions (the caller then solves the ILP)."""
    t0 = time.perf_counter()
    st = _Structure(table)
    if not st.ok:
        return None
    nk = 1 + len(st.bucket_ids)
    lam = np.zeros(nk)
    lam[0] = 1.0
    active = [0]
    rows: list[np.ndarray] = []
    best, best_s, lb = None, math.inf, -math.inf
    rounds = 0

    def offer(choice):
        nonlocal best, best_s
        step = evaluate(table, choice).step_time_s
        if step < best_s:
            best, best_s = choice, step

    def region_of(k):
        return st.lo[st.bucket_ids[k - 1]] if k else -1

    def exact_from(base, tried):
        """_exact_top from ``base`` down: a plan whose maximum lies below the region moves
        the region down, to the whole model (base 0) at the end."""
        nonlocal lb
        while best_s - lb > rel_tol * best_s and base not in tried and time.perf_counter() - t0 < time_limit_s:
            tried.add(base)
            r = _exact_top(st, base, t0 + time_limit_s, best_s)
            if r is None:
                if base == 0:
                    return
                base = 0
                continue
            choice, v = r
            lb = max(lb, v)
            if choice is None:       # nothing beats the best plan: it is optimal
                return
            offer(choice)
            m = int(np.argmax(st.checkpoint_values(choice)))
            base = m if region_of(m) < region_of(base) else 0

    # 1. the plan of least X (f_0), then the exact stage from the checkpoint that is its maximum
    tried: set[int] = set()
    choice, low = st.eliminate(lam)
    rounds = 1
    lb = low
    fv = st.checkpoint_values(choice)
    rows.append(fv)
    offer(choice)
    exact_from(int(np.argmax(fv)), tried)
    # 2. a gap left (the exact stage met its limits): Kelley's cutting planes over the weights
    while best_s - lb > rel_tol * best_s and rounds < max_rounds and time.perf_counter() - t0 < time_limit_s:
        m = int(np.argmax(rows[-1]))
        if m not in active:
            active.append(m)
        w, t_up = _dual_weights(rows, active)
        if t_up - lb <= rel_tol * best_s and all(int(np.argmax(r)) in active for r in rows):
            break            # the bound cannot rise over these checkpoints: a duality gap
        lam = np.zeros(nk)
        lam[active] = w
        rounds += 1
        choice, low = st.eliminate(lam)
        lb = max(lb, low)
        rows.append(st.checkpoint_values(choice))
        offer(choice)
    pred = evaluate(table, best)
    if memory_limit_bytes is not None and pred.memory_per_rank_bytes > memory_limit_bytes:
        return None
    return EliminationResult(best, pred.step_time_s, float(min(lb, pred.step_time_s)), rounds,
                             time.perf_counter() - t0)


def limited_lower_bound_s(table: CostTable, memory_limit_bytes: float, at_least: float = math.inf,
                          max_calls: int = 48) -> float | None:
    """A lower bound of every plan that fits ``memory_limit_bytes`` (None where ``_Structure``
    does not apply): Lagrangian relaxation of the memory row over the exact sum ``X = f_0``::

        step(plan) >= X(plan)                       (evaluate: step = max(T_fwd + T_bwd, F) + opt)
        L(mu) = min_plan X(plan) + mu (mem(plan) - limit)  <=  min over fitting plans of X

    for every mu >= 0 (a fitting plan's penalty is <= 0); ``mem`` is the sum of the layers'
    memory, as the ILP's memory row. Each L(mu) is one variable elimination (``_eliminate``,
    tens of ms on a 96-layer GPT); mu is doubled until the minimiser fits, then bisected, and the
    search stops as soon as a value reaches ``at_least`` (the caller's question: can any fitting
    plan beat ``at_least``?). On the 96-layer GPT at 1024 ranks under 400 MiB it gives 353.17 s
    against HiGHS's LP relaxation's 353.26 s."""
    st = _Structure(table)
    if not st.ok:
        return None
    lam = np.zeros(1 + len(st.bucket_ids))
    lam[0] = 1.0
    base = st._factors(lam)
    mem = [np.array([c.memory_bytes for c in o.costs], dtype=np.float64) for o in table.layers]
    order = list(reversed(st.topo))
    calls = 0

    def lagrangian(mu: float) -> tuple[float, float]:
        nonlocal calls
        calls += 1
        const, _, trail = _eliminate(list(base) + [((l,), mu * mem[l]) for l in range(st.n)], order, st.k)
        choice = [0] * st.n
        _assign(trail, choice)
        return const - mu * memory_limit_bytes, float(sum(mem[l][choice[l]] for l in range(st.n)))

    best, used = lagrangian(0.0)
    if used <= memory_limit_bytes or best >= at_least:
        return best
    scale = max(float(np.max(np.abs(f))) for _, f in base) or 1.0
    lo, hi = 0.0, scale / max(memory_limit_bytes, 1.0)
    while calls < max_calls:                  # double mu until the minimiser fits
        v, used = lagrangian(hi)
        best = max(best, v)
        if best >= at_least or used <= memory_limit_bytes:
            break
        lo, hi = hi, 2 * hi
    while calls < max_calls and best < at_least and hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        v, used = lagrangian(mid)
        best = max(best, v)
        lo, hi = (mid, hi) if used > memory_limit_bytes else (lo, mid)
    return best
