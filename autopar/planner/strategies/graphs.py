"""Graph parallelism, ``graphs(P)`` (``cost.graphs``): whole graphs of a PyG batch per rank, the
user's module run natively, against the best other plan. Offered only for a batch of graphs,
when no layer is pinned and the kinds allow it; forced by ``--kinds graphs`` or ``--pin
'*=graphs'``. plan.json keeps both predictions, the choice and why under
``solver.graph_parallel``."""

from __future__ import annotations

from ...cost.graphs import graphs_alternative
from ...decomp.graph.split import largest_shares
from ...errors import AutoparError
from .registry import Candidate, best, register_strategy

NAME = "graphs"


def _applies(req) -> bool:
    kinds = req.options.kinds
    return not req.force and not req.layer_pins and (kinds is None or "graphs" in kinds or req.force_graphs)


def _example_shares(mf, batch_size: int, world: int):
    """The largest rank's node / edge fractions of the model file's example batch under the
    graph split (imports the model file and torch, only when a PyG batch is priced)."""
    def shares(roles):
        return largest_shares(roles, list(mf.example_inputs(batch_size)), world)
    return shares


@register_strategy
class GraphParallel:
    name = NAME
    priority = 2
    kinds = {NAME: "graphs(P), whole graphs of a PyG batch per rank (alone in --kinds: forced)"}

    def offer(self, base):
        req = base.req
        if not _applies(req):
            return ()
        shares = _example_shares(base.loaded.mf, base.loaded.batch_size, req.world)
        # the memory limit is the chooser's (``strategies.memory_fit``), not checked here
        alt = graphs_alternative(base.graph, base.table.ctx, base.table, None, shares)
        if alt.roles is None and not req.force_graphs:     # not a PyG batch: nothing to compare
            return ()
        label = f"graphs({alt.parts})"
        if req.force_graphs and alt.illegal is not None:
            raise AutoparError(f"{label} was asked for (--kinds graphs, or forced on every layer) "
                               f"but is illegal: {alt.illegal}",
                               "plan with other --kinds (a padded batch's graphs are sample(P))")
        return (Candidate(NAME, label, alt.prediction, alt.illegal, alt.table,
                          tuple([0] * len(alt.table.layers)) if alt.table is not None else (),
                          runtime="native", forced=req.force_graphs, priority=self.priority, detail=alt),)

    def record(self, base, choice) -> dict:
        me = next((c for c in choice.candidates if c.strategy == NAME), None)
        if me is None:
            return {}
        alt, other = me.detail, best(choice.others(NAME))
        t_other = other.step_time_s if other is not None else None
        rec = {"parts": alt.parts, "op_by_op_step_time_s": t_other,
               "graphs_step_time_s": me.step_time_s, "graphs_memory_per_rank_bytes": me.memory_per_rank_bytes,
               "illegal": me.illegal,
               "priced_shares": (dict(alt.shares, source="the largest rank of the model file's example batch")
                                 if alt.shares else {"source": "the mean share 1 / P"})}
        say = base.req.say
        if choice.chosen is me:
            rec["chosen"] = me.label
            rec["why"] = ("forced" if me.forced else f"{me.label} predicted {me.step_time_s * 1e3:.3f} ms < the "
                          f"best op-by-op plan's {t_other * 1e3:.3f} ms")
            say(f"graph parallelism: {rec['why']}: whole graphs per rank, run natively")
            return {"graph_parallel": rec, "note": f"plan-level alternative {me.label} chosen: " + rec["why"],
                    "runtime": {"expected": "native", "step_time_s": me.step_time_s, "reason": rec["why"]}}
        rec["chosen"] = "op-by-op"
        rec["why"] = (me.illegal if me.illegal is not None else
                      f"the op-by-op plan predicted {t_other * 1e3:.3f} ms <= {me.label}'s {me.step_time_s * 1e3:.3f} ms")
        say(f"graph parallelism not chosen: {rec['why']}")
        return {"graph_parallel": rec}
