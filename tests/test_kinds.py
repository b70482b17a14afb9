"""``--kinds`` is read from the two registries: a name is a decomposition kind (``decomp.REGISTRY``:
the cost table prices it per layer) or a plan-level strategy's kind (each strategy's ``kinds``,
``planner.strategies.strategy_kinds``); one named error lists both sets for anything else."""

import pytest

from autopar.artifacts import PlanHooks, PlanOptions
from autopar.cli import main
from autopar.decomp import REGISTRY
from autopar.planner.load import request
from autopar.planner.strategies import STRATEGIES, UnknownKindError, check_kinds, register_strategy, strategy_kinds


def test_the_strategies_declare_their_kinds():
    sk = strategy_kinds()
    assert sk["graphs"][0] == "graphs" and sk["sharded"][0] == "sharded" and sk["zero1"][0] == "sharded"
    assert all(meaning for _, meaning in sk.values())


def test_an_unknown_kind_is_named_with_both_sets():
    with pytest.raises(UnknownKindError) as e:
        check_kinds(["sample", "fliter", "zero2"])
    msg = str(e.value)
    assert "['fliter', 'zero2']" in msg and "drop --kinds" in msg
    layer, strat = msg.split("plan-level strategy kinds:")
    for k in REGISTRY:
        if k not in strategy_kinds():
            assert k in layer, k
    for k, (s, meaning) in strategy_kinds().items():
        assert f"{k} ({s} strategy: {meaning})" in strat
    check_kinds(["sample", "head", "graphs", "sharded", "zero1"])    # every kind of either registry


def test_the_cli_refuses_an_unknown_kind_before_reading_the_model(tmp_path, capsys):
    rc = main(["plan", str(tmp_path / "absent.py"), "--world-size", "2", "--kinds", "sample,shardd"])
    err = capsys.readouterr().err
    assert rc != 0 and "UnknownKindError" in err and "['shardd']" in err and "sharded (sharded strategy" in err


@pytest.fixture
def toy_kind():
    """A strategy registered for this test only, declaring one ``--kinds`` name."""
    @register_strategy
    class ToyKind:
        name = "toy_kind_strategy"
        priority = 9
        kinds = {"toykind": "the toy strategy, for this test"}

        def offer(self, base):
            return ()
    yield "toykind"
    STRATEGIES.pop("toy_kind_strategy")


def test_a_new_strategys_kind_is_accepted_and_kept_out_of_the_table(toy_kind):
    """No list by hand: a strategy's declared kind passes the check and is not a kind the cost
    table prices (``planner.make`` passes the strategies' kinds to ``request``); listed with
    decomposition kinds, only those reach the table."""
    check_kinds([toy_kind])
    sk = tuple(strategy_kinds())
    req = request(PlanOptions(world_size=2, kinds=("sample", toy_kind, "sharded")), PlanHooks(), sk)
    assert req.table_kinds == ("sample",) and not req.force_graphs
    alone = request(PlanOptions(world_size=2, kinds=(toy_kind,)), PlanHooks(), sk)
    assert alone.table_kinds is None and not alone.force_graphs
    graphs = request(PlanOptions(world_size=2, kinds=("graphs",)), PlanHooks(), sk)
    assert graphs.table_kinds is None and graphs.force_graphs
    with pytest.raises(UnknownKindError, match="toykind \\(toy_kind_strategy strategy: the toy strategy"):
        check_kinds(["nope"])


def test_make_plan_refuses_an_unknown_kind(tmp_path):
    from autopar.planner import make_plan
    with pytest.raises(UnknownKindError, match="'nope'"):
        make_plan(tmp_path / "absent.py", PlanOptions(world_size=2, kinds=("sample", "nope")))
