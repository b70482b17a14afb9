"""Pins (``autopar plan --pin``, ``PlanOptions(pins=...)``, ``autopar.pins``): parsing and
matching, pinned plans of the shipped examples through every solver path (the dynamic program,
the ILP alone, the placement search, the native-runtime choice, the sweep), plan.json's record,
the printed mark, and a named error for each bad pin. Plans only: no process starts."""

import json
from types import SimpleNamespace

import pytest

from autopar.artifacts import PlanHooks, PlanOptions, load_plan
from autopar.pins import Pin, PinError, near_names, parse_pins
from autopar.planner import make_plan

RESNET = "strategies/examples/resnet2d.py"
GPT = "strategies/examples/gpt.py"


def _plan(root, profile, model=RESNET, world=4, **kw):
    kw.setdefault("write", False)
    return make_plan(root / model, PlanOptions(world_size=world, **kw), PlanHooks(profile=profile))


def _unpinned(root, profile, **kw):
    return {d.layer: d.choice for d in _plan(root, profile, **kw).plan.layers}


# ---- parsing and matching (pure) ------------------------------------------------------------

def test_parse_kind_and_choice():
    p = Pin.parse("*=sample")
    assert (p.pattern, p.want, p.kind, p.is_kind) == ("*", "sample", "sample", True)
    q = Pin.parse(" h.0.attn = head(2, 2) ")
    assert (q.pattern, q.want, q.kind, q.is_kind) == ("h.0.attn", "head(2,2)", "head", False)
    assert str(q) == "h.0.attn=head(2,2)" and Pin.parse(str(q)) == q
    assert Pin.parse("layer1.*=spatial(2,2x1)").want == "spatial(2,2x1)"


@pytest.mark.parametrize("text", ["layer1.*", "=sample", "layer1.*=", "x=head(2", "x=head)(", "x=a b"])
def test_malformed_pin_is_a_named_error(text):
    with pytest.raises(PinError) as e:
        Pin.parse(text)
    assert e.value.hint.startswith(("write", "give"))


def test_coerce_forms_and_accepts():
    want = (Pin("*", "sample"), Pin("fc", "filter(1,4)"), Pin("a.*", "channel"))
    assert parse_pins(["*=sample", {"pattern": "fc", "want": "filter(1, 4)"}, ("a.*", "channel")]) == want
    assert parse_pins("*=sample") == (Pin("*", "sample"),)
    assert parse_pins(None) == ()
    with pytest.raises(PinError):
        parse_pins([{"pattern": "x"}])
    with pytest.raises(PinError):
        parse_pins([3])
    dec = type("D", (), {"kind": "head", "__str__": lambda self: "head(2,2)"})()
    assert Pin("*", "head").accepts(dec) and Pin("*", "head(2,2)").accepts(dec)
    assert not Pin("*", "head(4,1)").accepts(dec) and not Pin("*", "mlp").accepts(dec)


def test_match_module_or_layer_name():
    conv = SimpleNamespace(index=2, module="layer1.0.conv1", name="conv2d_1")
    pool = SimpleNamespace(index=22, module="", name="adaptive_avg_pool2d")
    assert Pin("layer1.*", "sample").matches(conv) and Pin("conv2d_?", "sample").matches(conv)
    assert Pin("*", "sample").matches(conv) and Pin("*", "sample").matches(pool)
    assert Pin("adaptive_*", "sample").matches(pool)
    assert not Pin("layer2.*", "sample").matches(conv) and not Pin("Layer1.*", "sample").matches(conv)
    assert not Pin("layer1", "sample").matches(conv)       # a glob, not a prefix
    assert near_names("layer9.*", [conv, pool])[0] == "layer1.0.conv1"


def test_options_round_trip_through_json():
    o = PlanOptions(world_size=4, pins=["*=sample", "layer1.*=spatial", {"pattern": "head", "want": "filter(1,4)"}])
    j = json.loads(json.dumps(o.to_json()))
    assert j["pins"] == [{"pattern": "*", "want": "sample"}, {"pattern": "layer1.*", "want": "spatial"},
                         {"pattern": "head", "want": "filter(1,4)"}]
    assert PlanOptions.from_json(j) == o and PlanOptions.from_json(j).pins == o.pins
    assert PlanOptions(world_size=2).pins == ()


# ---- pinned plans of shipped examples -------------------------------------------------------

def test_pin_everything_to_sample_is_the_data_parallel_plan(root, profile):
    r = _plan(root, profile, pins=("*=sample",), kinds=None)
    assert all(d.choice == "sample(4)" and d.pinned == "*=sample" for d in r.plan.layers)
    # sample(2) is also legal everywhere: the solver took the kind's cheapest for the plan
    assert all("sample(2)" in [a.choice for a in d.alternatives] for d in r.plan.layers)
    assert r.plan.runtime.expected == "native"     # the pins allow the native runtime
    assert r.plan.options.pins == (Pin("*", "sample"),)


def test_pin_a_kind_on_a_glob_leaves_the_rest_to_the_solver(root, profile):
    free = _unpinned(root, profile)
    assert not any(c.startswith("spatial") for c in free.values())      # so the pin changes something
    r = _plan(root, profile, pins=("layer1.*=spatial",))
    graph = r.plan.graph()
    hit = {lay.index for lay in graph.layers if lay.module.startswith("layer1.")}
    assert len(hit) == 6
    for d in r.plan.layers:
        if d.layer in hit:
            assert d.kind == "spatial" and d.pinned == "layer1.*=spatial", (d.layer, d.choice)
            assert all(a.choice.startswith("spatial") for a in d.alternatives)
        else:
            assert d.pinned == "", d.layer
            assert len(d.alternatives) > 1          # a solver's choice, not a pin
    assert r.plan.layer(24).choice == free[24]


def test_pin_an_exact_choice_that_the_pruner_drops(root, profile):
    """spatial(1,4x1) on a convolution is legal but pruned for price (at most 8 kept): a pin
    still takes it, priced as the unpruned table prices it."""
    free = _plan(root, profile)
    conv = free.plan.layer(2)
    assert conv.module == "layer1.0.conv1" and "spatial(1,4x1)" not in [a.choice for a in conv.alternatives]
    r = _plan(root, profile, pins=("layer1.0.conv1=spatial(1,4x1)", "head=filter(1,4)"))
    assert r.plan.layer(2).choice == "spatial(1,4x1)" and r.plan.layer(2).pinned == "layer1.0.conv1=spatial(1,4x1)"
    assert r.plan.layer(24).choice == "filter(1,4)" and r.plan.layer(24).pinned == "head=filter(1,4)"
    assert [d.layer for d in r.plan.layers if d.pinned] == [2, 24]
    assert r.plan.predicted.step_time_s > free.plan.predicted.step_time_s     # the pins cost time


def test_the_last_pin_taking_a_layer_wins(root, profile):
    r = _plan(root, profile, pins=("*=sample", "head=filter(1,4)"))
    assert r.plan.layer(24).choice == "filter(1,4)" and r.plan.layer(24).pinned == "head=filter(1,4)"
    assert all(d.kind == "sample" and d.pinned == "*=sample" for d in r.plan.layers if d.layer != 24)


@pytest.mark.parametrize("solver", ["highs", "ilp", "cbc"])
def test_pins_hold_in_every_solver(root, profile, solver):
    pins = ("layer2.*=channel", "head=filter(1,4)")
    r = _plan(root, profile, pins=pins, solver=solver, memory_limit_bytes=64 * 2**20)
    pinned = {d.layer: d.choice for d in r.plan.layers if d.pinned}
    assert pinned[24] == "filter(1,4)"
    assert {d.layer for d in r.plan.layers if d.module.startswith("layer2.") and "conv" in d.module} <= set(pinned)
    assert all(pinned[l].startswith("channel") for l in pinned if l != 24)


def test_pins_hold_under_the_placement_search(root, profile):
    r = _plan(root, profile, pins=("layer3.*=channel",), ranks_per_node=2, nodes=2)
    tried = r.plan.placement_search.tried
    assert len(tried) > 1 and sum(t.solved for t in tried) >= 1
    pinned = [d for d in r.plan.layers if d.pinned]
    assert pinned and all(d.kind == "channel" for d in pinned)
    assert {d.layer for d in pinned} == {d.layer for d in r.plan.layers
                                        if d.module.startswith("layer3.") and "conv" in d.kinds}


def test_pins_on_a_transformer_exact_head_choice(root, profile):
    free = _plan(root, profile, model=GPT)
    att = [d for d in free.plan.layers if "head" in {a.choice.split("(")[0] for a in d.alternatives}]
    assert att, "no attention unit offers head parallelism"
    choice = next(a.choice for a in att[0].alternatives if a.choice.startswith("head("))
    mod = att[0].module
    r = _plan(root, profile, model=GPT, pins=(f"{mod}={choice}",))
    got = [d for d in r.plan.layers if d.pinned]
    assert [(d.module, d.choice) for d in got] == [(mod, choice)]


def test_sweep_plans_every_point_with_the_pins(root, profile, tmp_path, monkeypatch):
    from autopar import sweep as sw
    from autopar.profile import save_profile
    prof = tmp_path / "prof.json"
    save_profile(profile, prof)
    res = sw.sweep(root / RESNET, [2, 4], None, str(prof), pins=("head=filter",),
                   families={"hybrid": (None, None), "sample-only": (["sample", "replicate"], None)})
    assert res["pins"] == ["head=filter"]
    assert [p["world"] for p in res["series"]["hybrid"]] == [2, 4]
    assert all(any(c.startswith("filter(") for c in p["decompositions"]) for p in res["series"]["hybrid"])
    skipped = [s for s in res["skipped"] if s["series"] == "sample-only"]
    assert len(skipped) == 2 and all("PinError" in s["reason"] or "not among the kinds" in s["reason"] for s in skipped)


# ---- bad pins: named errors -----------------------------------------------------------------

def test_unknown_kind_lists_the_first_matched_layers_legal_kinds(root, profile):
    with pytest.raises(PinError) as e:
        _plan(root, profile, pins=("head=fliter",))
    msg = str(e.value)
    assert "unknown decomposition kind 'fliter'" in msg and "layer 24 (head)" in msg
    assert "kinds channel, filter" in msg and "filter(1,4)" in msg and "sample(4)" in msg


def test_pattern_matching_no_layer_names_the_nearest(root, profile):
    with pytest.raises(PinError) as e:
        _plan(root, profile, pins=("layer1.0.conv9=sample",))
    msg = str(e.value)
    assert "matches no module or layer name" in msg and "layer1.0.conv1" in msg


def test_choice_illegal_on_every_matched_layer_lists_the_legal_ones(root, profile):
    with pytest.raises(PinError) as e:
        _plan(root, profile, pins=("head=spatial",))
    msg = str(e.value)
    assert "spatial is legal on none of the 1 layer(s) 'head' matches" in msg
    assert "layer 24 (head)" in msg and "kinds channel, filter" in msg and "row_parallel(1,4)" in msg
    with pytest.raises(PinError) as e:
        _plan(root, profile, pins=("*=head(2,2)",))
    assert "head(2,2) is legal on none of the 25 layer(s)" in str(e.value) and "layer 0 (stem.0)" in str(e.value)
    with pytest.raises(PinError) as e:         # a legal kind, an extent the layer does not have
        _plan(root, profile, pins=("head=filter(1,3)",))
    assert "filter(1,3) is legal on none" in str(e.value) and "filter(1,4)" in str(e.value)


def test_pinned_kind_outside_kinds_and_partial_graphs_are_named_errors(root, profile):
    with pytest.raises(PinError) as e:
        _plan(root, profile, pins=("layer1.*=spatial",), kinds=("sample", "replicate"))
    assert "add spatial to --kinds" in str(e.value)
    with pytest.raises(PinError) as e:
        _plan(root, profile, pins=("layer1.*=graphs",))
    assert "plan-level" in str(e.value)


# ---- plan.json and the CLI ------------------------------------------------------------------

@pytest.fixture
def prof_file(tmp_path, profile):
    from autopar.profile import save_profile
    p = tmp_path / "prof.json"
    save_profile(profile, p)
    return p


def test_cli_pin_writes_the_pins_and_marks_the_layers(root, tmp_path, prof_file, capsys):
    from autopar.cli import main
    out = tmp_path / "plan"
    rc = main(["plan", str(root / RESNET), "--world-size", "4", "--calibration", str(prof_file), "-o", str(out),
               "--pin", "layer1.*=spatial", "--pin", "head=filter(1, 4)", "--verbose"])
    text = capsys.readouterr().out
    assert rc == 0
    raw = json.loads((out / "plan.json").read_text())
    assert raw["options"]["pins"] == [{"pattern": "layer1.*", "want": "spatial"},
                                      {"pattern": "head", "want": "filter(1,4)"}]
    assert PlanOptions.from_json(raw["options"]).pins == (Pin("layer1.*", "spatial"), Pin("head", "filter(1,4)"))
    plan = load_plan(out / "plan.json")
    assert plan.options.pins == (Pin("layer1.*", "spatial"), Pin("head", "filter(1,4)"))
    pinned = {d.layer: (d.choice, d.pinned) for d in plan.layers if d.pinned}
    assert set(pinned) == {2, 3, 4, 5, 6, 7, 24} and pinned[24] == ("filter(1,4)", "head=filter(1,4)")
    assert all(raw["layers"][l]["pinned"] for l in pinned)
    assert not any("pinned" in d for d in raw["layers"] if d["layer"] not in pinned)
    # the printed table marks exactly the pinned rows
    rows = {int(line.split()[0]): line for line in text.splitlines()
            if line.strip() and line.split()[0].isdigit() and len(line.split()) > 5}
    assert {l for l, line in rows.items() if line.rstrip().endswith("pinned")} == set(pinned)


def test_cli_bad_pin_is_a_named_error(root, tmp_path, prof_file, capsys):
    from autopar.cli import main
    rc = main(["plan", str(root / RESNET), "--world-size", "4", "--calibration", str(prof_file),
               "-o", str(tmp_path / "p"), "--pin", "nope.*=sample"])
    err = capsys.readouterr().err
    assert rc == 2 and "PinError" in err and "nearest names" in err
    assert not (tmp_path / "p" / "plan.json").exists()


# ---- item 5: a test helper that forces a split fails when the split is not offered ----------

def test_gnn_forced_helper_fails_on_a_split_not_offered(root, profile):
    from gnn_helpers import forced, small_sizes, trace
    with small_sizes():
        g = trace(root, "gnn_pcqm4m")
    assert set(forced(g, profile, 4, "edges", "(2,2)").values()) == {"edges(2,2)"}
    with pytest.raises(pytest.fail.Exception, match=r"offers .*not edges\(3,3\)"):
        forced(g, profile, 4, "edges", "(3,3)")


def test_pin_graphs_on_every_layer_is_the_plan_level_choice(root, profile):
    from gnn_helpers import small_sizes
    model = root / "strategies/examples/pyg_nnconv.py"

    def plan(*pins):
        return make_plan(model, PlanOptions(world_size=2, batch_size=4, write=False, pins=pins),
                         PlanHooks(profile=profile))
    with small_sizes():
        free = plan()
        assert not free.plan.decompositions()[0].startswith("graphs")     # so the pin changes something
        r = plan("*=graphs")
        assert r.plan.decompositions() == ["graphs(2,4)"] and {d.pinned for d in r.plan.layers} == {"*=graphs"}
        assert r.plan.solver.extra["graph_parallel"]["why"] == "forced"
        assert plan("*=graphs(2,4)").plan.decompositions() == ["graphs(2,4)"]
        with pytest.raises(PinError, match="not graphs"):
            plan("*=graphs(2,2)")
        with pytest.raises(PinError, match="plan-level"):
            plan("*=graphs", "convs.*=edges")


@pytest.mark.dist
def test_a_pinned_plan_executes_equal_to_one_process(root, tmp_path, profile):
    """plan.json with its pins and marks runs as any plan does: every tensor against one
    process in float64."""
    from autopar.execute.runner import ExecuteOptions, execute
    r = make_plan(root / RESNET, PlanOptions(world_size=2, batch_size=4, out_dir=str(tmp_path / "plan"),
                                             pins=("layer1.*=spatial", "head=filter(1,2)")),
                  PlanHooks(profile=profile))
    assert r.plan.layer(24).choice == "filter(1,2)" and r.plan.layer(2).kind == "spatial"
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=240, ddp=False),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    v = run.validation
    assert v.passed and v.dtype == "float64", v.failures
    names = {c.tensor for c in v.checks}
    assert "loss" in names and "grad:head.weight" in names and "grad:layer1.0.conv1.weight" in names


def test_runtime_reason_names_the_pins_that_exclude_data_parallelism(root, profile):
    r = _plan(root, profile, pins=("layer1.0.*=channel",))
    rt = r.plan.runtime
    assert rt.expected == "traced" and rt.native_data_parallel_step_time_s is None
    assert "the pins (layer1.0.*=channel) leave some layer without sample" in rt.reason
