"""The move of the model's output into the loss layout is priced (``cost.table._price_loss_move``):
a head split by ``filter`` pays the redistribution of its logits that the runtime performs before
the loss (``decomp.sharding.loss_sharding_for``), ``vocab_head`` computes the loss in place and pays
none of it, and a head that splits only samples moves nothing."""

import dataclasses

import pytest

from autopar.decomp.sharding import loss_sharding_for
from autopar.decomp.transition import transition_s


@pytest.mark.parametrize("world", [2, 4])
def test_head_choices_pay_the_move_of_their_logits_into_the_loss_layout(root, profile, world):
    from autopar.cost import table as tab
    from autopar.decomp.base import CostContext
    from autopar.modelfile import load_model_file
    from autopar.planner import attention_units, vocab_loss_output
    from autopar.trace.tracer import trace_model
    mf = load_model_file(root / "strategies/examples/gpt.py")
    g = attention_units(trace_model(mf, 4))
    ctx = CostContext(profile=profile, world=world, ranks_per_node=world, batch_size=4, max_candidates=30,
                      loss_output=vocab_loss_output(mf, g, 4))
    priced = tab.build_cost_table(g, ctx)
    li = g.producer()[g.output]
    lay = g.layers[li]
    shape = tuple(int(n) for n in g.value_shape(g.output))
    # the same table without the move: the layer's own prices
    orig = tab._price_loss_move
    try:
        tab._price_loss_move = lambda graph, ctx, opts: opts
        bare = tab.build_cost_table(g, ctx)
    finally:
        tab._price_loss_move = orig
    kinds = set()
    for d, c, c0 in zip(priced.layers[li].choices, priced.layers[li].costs, bare.layers[li].costs):
        src = d.out_placement(lay, g.output)
        dst = loss_sharding_for(src, shape[0], world)
        if getattr(d, "loss_in_place", False) or src == dst:
            assert c == c0, d
            continue
        f, b = transition_s(src, dst, shape, lay.itemsize, ctx)
        assert f > 0
        assert c.fwd_comm_s == pytest.approx(c0.fwd_comm_s + f) and c.bwd_comm_s == pytest.approx(c0.bwd_comm_s + b)
        assert dataclasses.replace(c, fwd_comm_s=c0.fwd_comm_s, bwd_comm_s=c0.bwd_comm_s) == c0
        kinds.add(d.kind)
    assert "filter" in kinds, [str(d) for d in priced.layers[li].choices]
