"""``autopar explain PLAN LAYER`` (``autopar.explain``): every shipped plan explains, a fresh
plan re-prices exactly as it was made and every layer's choice is the best swap the solver
could take, and bad input gets a named error. Re-pricing starts no process."""

import json
import math
import warnings
from pathlib import Path

import pytest

from autopar.artifacts import PlanMigrated, PlanOptions, load_plan
from autopar.errors import AutoparError, PlanFileError
from autopar.explain import explain, explain_layer, find_layer

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(ROOT.glob("strategies/plans/*/plan.json"))
SCHEMA1 = ROOT / "tests/data/cnn3d-w2-schema1-plan.json"


def _busiest(plan) -> int:
    """The layer with the most recorded candidates (the most to explain)."""
    return max(plan.layers, key=lambda d: (len(d.alternatives), -d.layer)).layer


@pytest.mark.parametrize("path", SHIPPED, ids=[p.parent.name for p in SHIPPED])
def test_explain_every_shipped_plan(path, monkeypatch):
    monkeypatch.chdir(ROOT)            # the plans record their profile relative to the repository
    plan = load_plan(path)
    li = _busiest(plan)
    ex = explain_layer(plan, path, li)
    (chosen,) = [c for c in ex.candidates if c.chosen]
    d = plan.layer(li)
    assert ex.layer == li and chosen.choice == d.choice == ex.chosen
    assert {c.choice for c in ex.candidates} >= {a.choice for a in d.alternatives}
    text = explain(path, str(li))
    assert text.splitlines()[0].startswith(f"layer {li} ") and f"* {d.choice[:20]}" in text and "\nwhy: " in text
    if chosen.step_s is None:          # a plan-level choice (graphs(P)): the recorded totals
        assert "plan-level" in text
        return
    others = [c.step_s for c in ex.candidates if not c.chosen and not c.blocked]
    # an optimal plan: no single swap the solver could take prices the step lower
    assert not others or chosen.step_s <= min(others) * (1 + 1e-9)
    if ex.plan_matches and plan.runtime is not None and plan.runtime.expected == "traced":
        # re-priced as made: the plan's step is the prediction it recorded
        assert chosen.step_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


#: under the synthetic profile GPT's data-parallel plan needs 0.49 MiB per rank
LIMIT = 0.4 * 2**20


def test_fresh_plan_reprices_exactly_and_every_choice_wins(tmp_path, root, profile):
    """GPT at world 4 under a memory limit that data parallelism does not meet: a mixed plan
    whose every layer re-prices as plan.json recorded it, whose recorded step is each chosen
    candidate's, where no swap the solver could take prices lower, and where the swaps it could
    not take are named with why (over the memory limit, or a tied weight held otherwise)."""
    from autopar.profile import save_profile
    from autopar.planner import make_plan
    prof = tmp_path / "prof.json"
    save_profile(profile, prof)
    from autopar.decomp import REGISTRY
    # every per-layer kind, not the plan-level "sharded" (FSDP, which would meet the limit)
    r = make_plan(root / "strategies/examples/gpt.py",
                  PlanOptions(world_size=4, calibration=str(prof), out_dir=str(tmp_path / "p"),
                              memory_limit_bytes=LIMIT, kinds=tuple(REGISTRY)))
    plan = load_plan(r.plan_path)
    assert (plan.runtime.expected == "traced" and len(plan.decompositions()) > 1), plan.decompositions()
    blocked_seen = 0
    for d in plan.layers:
        ex = explain_layer(plan, r.plan_path, d.layer)
        assert ex.plan_matches and not ex.notes, ex.notes
        assert "every candidate matches the plan's recorded total" in ex.source
        (chosen,) = [c for c in ex.candidates if c.chosen]
        assert chosen.step_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
        assert chosen.plan_memory_bytes <= LIMIT
        for c in ex.candidates:
            assert c.recorded_s == pytest.approx(c.own_s, rel=1e-9)
            if c.chosen:
                continue
            if c.blocked:
                blocked_seen += "over the 0.40 MiB limit" in c.blocked
                assert ("over the 0.40 MiB limit" in c.blocked and c.plan_memory_bytes > LIMIT) or "tied" in c.blocked
            else:
                assert c.step_s >= chosen.step_s * (1 - 1e-12), (d.layer, c.choice)
    assert blocked_seen >= 1          # the memory limit rules some swaps out, and they are named
    # the text says why, with the runner-up's difference split
    text = explain(r.plan_path, "blocks.0.attn")
    assert "why: " in text and ("runner-up" in text or "only legal candidate" in text)


def test_transitions_are_charged_against_the_neighbours_choices(root, monkeypatch):
    """HF GPT-2 w4 (data parallel): moving one attention block off sample(4) costs the
    transitions into and out of it, and the explanation says so."""
    monkeypatch.chdir(ROOT)
    path = ROOT / "strategies/plans/hf_gpt2-w4/plan.json"
    plan = load_plan(path)
    li = find_layer(plan, "29")
    ex = explain_layer(plan, path, li)
    (chosen,) = [c for c in ex.candidates if c.chosen]
    assert chosen.choice == "sample(4)" and chosen.transitions_s == 0.0
    other = [c for c in ex.candidates if not c.chosen and not c.blocked]
    assert other and all(c.transitions_s > 0 for c in other)
    assert any(n.startswith("in  <- 28 ") for n in ex.neighbours) and any(n.startswith("out -> 30 ") for n in ex.neighbours)
    assert "transitions with the neighbours' choices +" in ex.why
    # the tied embedding: lm_head's tensor-parallel splits hold wte's weight otherwise than layer 5
    ex42 = explain_layer(plan, path, "lm_head")
    assert any("tied parameter transformer.wte.weight" in c.blocked for c in ex42.candidates)


def test_layer_names_indices_and_modules(root):
    plan = load_plan(ROOT / "strategies/plans/hf_gpt2-w4/plan.json")
    assert find_layer(plan, "5") == 5 == find_layer(plan, "transformer.wte") == find_layer(plan, "embedding")
    with pytest.raises(AutoparError, match=r"no layer or module named 'transformer.h.0.atn'.*nearest: transformer\.h\.0\.attn"):
        find_layer(plan, "transformer.h.0.atn")
    with pytest.raises(AutoparError, match=r"layer 99 is not in the plan \(its layers are 0\.\.42\)"):
        find_layer(plan, "99")
    with pytest.raises(AutoparError, match=r"module 'transformer.h.0.attn' has 3 layers: 0 \("):
        find_layer(plan, "transformer.h.0.attn")


def test_cli_bad_layer_lists_the_nearest_names(capsys, monkeypatch):
    from autopar.cli import main
    monkeypatch.chdir(ROOT)
    assert main(["explain", "strategies/plans/wide_resnet-w4/plan.json", "blocks.0.shortcutt"]) == 2
    err = capsys.readouterr().err
    assert "AutoparError" in err and "nearest: blocks.0.shortcut" in err and "Traceback" not in err
    assert main(["explain", "strategies/plans/wide_resnet-w4/plan.json", "blocks.0.shortcut"]) == 0
    assert "why: " in capsys.readouterr().out


def test_older_schema_is_migrated_and_an_unknown_one_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    obj = json.loads(SCHEMA1.read_text())
    assert obj["schema"] == "autopar.plan/1"
    old = tmp_path / "old" / "plan.json"
    old.parent.mkdir()
    old.write_text(json.dumps(obj))
    with pytest.warns(PlanMigrated, match="migrated"):
        text = explain(old, "0")
    assert text.startswith("layer 0 ") and "why: " in text
    obj["schema"] = "autopar.plan/0"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(obj))
    with pytest.raises(PlanFileError, match=r"has schema 'autopar.plan/0'; this autopar reads 'autopar.plan/3'"):
        explain(bad, "0")


def test_missing_profile_falls_back_to_the_recorded_totals(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    obj = json.loads((ROOT / "strategies/plans/wide_resnet-w4/plan.json").read_text())
    obj["calibration"]["path"] = "calibration/nowhere.json"
    f = tmp_path / "p" / "plan.json"
    f.parent.mkdir()
    f.write_text(json.dumps(obj))
    ex = explain_layer(load_plan(f), f, "3")
    assert "is not here" in ex.source and not ex.plan_matches
    assert all(c.step_s is None and math.isnan(c.fwd_compute_s) and c.recorded_s > 0 for c in ex.candidates)
    assert "lowest recorded cost" in ex.why or "whole plan" in ex.why


def test_a_pinned_layer_is_explained_by_its_pin(tmp_path, root, profile):
    """A pin the solver would not choose: the cheaper swap is shown and the pin named as why;
    a pinned choice pruned for price is still among the re-priced candidates."""
    from autopar.profile import save_profile
    from autopar.planner import make_plan
    prof = tmp_path / "prof.json"
    save_profile(profile, prof)
    r = make_plan(root / "strategies/examples/resnet2d.py",
                  PlanOptions(world_size=4, calibration=str(prof), out_dir=str(tmp_path / "p"),
                              pins=("head=filter(1,4)",)))
    ex = explain_layer(load_plan(r.plan_path), r.plan_path, "head")
    (chosen,) = [c for c in ex.candidates if c.chosen]
    assert chosen.choice == "filter(1,4)" and ex.plan_matches
    cheaper = [c for c in ex.candidates if not c.chosen and c.step_s < chosen.step_s]
    assert cheaper and "kept because this layer was pinned (--pin head=filter(1,4))" in ex.why
