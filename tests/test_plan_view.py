"""The printed plan (``autopar.report.planview``): the fold rule on a hand-made plan, the
summary and the line count on the shipped Hugging Face GPT-2 plan, and the CLI's terse and
verbose output."""

from types import SimpleNamespace

import pytest

from autopar.artifacts import DecompositionRef, LayerDecision, LayerPrice, Prediction, TransitionDecision, load_plan
from autopar.report.planview import FOLD_SHARE, Fold, fold_rows, format_plan, summary_lines

STEP_MS = 100.0     # 1 % of the step: 1 ms


def _decision(i: int, ms: float, kinds=("squeeze",), choice="replicate", pinned=False, sync_ms=0.0):
    return LayerDecision(layer=i, name=f"op{i}", module=f"m{i}", kinds=tuple(kinds), out_shape=(8, 4),
                         decomposition_ref=DecompositionRef(choice), choice=choice, in_placements={}, out_placement=None,
                         predicted=LayerPrice(fwd_compute_s=0.4 * ms * 1e-3, bwd_compute_s=0.6 * ms * 1e-3,
                                              grad_sync_s=sync_ms * 1e-3),
                         source="fit", pinned=f"m{i}=replicate" if pinned else "")


def _hand_made():
    """13 layers of a 100 ms step: which fold is said beside each."""
    with_params = {0, 5}
    layers = [
        _decision(0, 5.0, ("linear",), sync_ms=1.0),     # parameters: a row whatever it costs
        _decision(1, 0.2), _decision(2, 0.3, ("view",)),  # 1-2 folded (0.5 % of step)
        _decision(3, 0.5),                                # 0.5 ms + a 0.6 ms transition into it: a row
        _decision(4, 0.9),                                # routine but alone: its own row
        _decision(5, 0.1, ("layer_norm",)),               # parameters: a row
        _decision(6, 0.1),                                # alone (7 is pinned)
        _decision(7, 0.1, pinned=True),                   # pinned: never folded, marked
        _decision(8, 0.1), _decision(9, 0.1, ("expand",), choice="sample(4)"),  # 8-9 folded
        _decision(10, 1.0),                               # exactly 1 %: not below it, a row
        _decision(11, 0.05), _decision(12, 0.05),         # 11-12 folded, at the end
    ]
    graph = {"layers": [{"index": d.layer, "ops": [{"params": {"weight": [4, 4]} if d.layer in with_params else {}}]}
                        for d in layers]}
    trans = (TransitionDecision(src=2, dst=3, value="v2", src_placement="R", dst_placement="N4", fwd_s=0.3e-3, bwd_s=0.3e-3),)
    return SimpleNamespace(layers=tuple(layers), transitions=trans, graph_json=graph,
                           predicted=Prediction(step_time_s=STEP_MS * 1e-3))


def test_fold_rule_on_a_hand_made_plan():
    assert FOLD_SHARE == 0.01
    rows = fold_rows(_hand_made())
    shape = [(r.first, r.last) if isinstance(r, Fold) else r.layer for r in rows]
    assert shape == [0, (1, 2), 3, 4, 5, 6, 7, (8, 9), 10, (11, 12)]
    f12, f89 = rows[1], rows[7]
    assert f12.layers == 2 and f12.kinds == ("squeeze", "view") and f12.choices == ("replicate",)
    assert f12.cost_s == pytest.approx(0.5e-3) and f12.share == pytest.approx(0.005)
    assert f89.choices == ("replicate", "sample(4)")
    # a folded run may sum to more than 1 %: the rule is per layer
    many = _hand_made()
    many.layers = tuple(_decision(i, 0.9) for i in range(4))
    many.graph_json = {"layers": [{"index": i, "ops": [{"params": {}}]} for i in range(4)]}
    many.transitions = ()
    (only,) = fold_rows(many)
    assert (only.first, only.last, only.layers) == (0, 3, 4) and only.share == pytest.approx(0.036)


def test_folded_rows_print_as_one_line_and_the_pin_stays_visible(root):
    from autopar.report import planview
    plan = _hand_made()
    rows = [planview._fold_row(r) if isinstance(r, Fold) else planview._layer_row(r) for r in fold_rows(plan)]
    assert rows[1].split() == ["1-2", "(2", "layers:", "squeeze,", "view;", "replicate)", "0.5", "%", "of", "step"]
    assert rows[6].split()[0] == "7" and rows[6].endswith("fit, pinned")
    assert sum("pinned" in r for r in rows) == 1


def test_summary_names_the_pins(root):
    from dataclasses import replace
    plan = load_plan(root / "strategies/plans/wide_resnet-w4/plan.json")
    plan = replace(plan, layers=tuple(replace(d, pinned="blocks.0.*=sample") if d.module.startswith("blocks.0.") else d
                                      for d in plan.layers))
    marked = [d.layer for d in plan.layers if d.pinned]
    head = summary_lines(plan)
    assert marked and f"  pinned: {len(marked)} layers ({', '.join(map(str, marked))}) by --pin blocks.0.*=sample" in head
    rows = format_plan(plan).splitlines()
    assert all(any(r.split()[:1] == [str(l)] and r.endswith(", pinned") for r in rows) for l in marked)


def test_shipped_hf_gpt2_w4_plan_fits_45_lines(root):
    """`autopar plan strategies/examples/hf_gpt2.py --world-size 4` prints the view plus at most
    three lines (traced, an on-demand shape measurement, plan written): <= 45 in all."""
    plan = load_plan(root / "strategies/plans/hf_gpt2-w4/plan.json")
    text = format_plan(plan)
    assert len(text.splitlines()) + 3 <= 45, text
    # the summary comes first: decompositions used, prediction beside data parallelism, memory,
    # the runtime priced, the placement, the solver
    head = "\n".join(summary_lines(plan))
    assert text.startswith(head)
    assert "sample(4) on" in head and "replicate on" in head
    assert f"predicted step time {plan.predicted.step_time_s * 1e3:.3f} ms" in head
    assert "data parallelism" in head and "MiB per rank" in head
    assert "runtime: native" in head and "placement: block" in head and "solver: highs" in head
    # the 32 mask / squeeze / constant layers before the first attention block fold into a few rows
    folds = [r for r in fold_rows(plan) if isinstance(r, Fold)]
    assert sum(f.layers for f in folds) >= 25 and len(folds) <= 4
    first_attn = next(d.layer for d in plan.layers if "attn" in d.module and "matmul" in d.kinds)
    assert sum(1 for r in fold_rows(plan) if (r.first if isinstance(r, Fold) else r.layer) < first_attn) <= 8
    # --verbose: every layer has its row
    verbose = format_plan(plan, verbose=True).splitlines()
    assert sum(1 for line in verbose if line[:7].strip().isdigit()) == len(plan.layers)


def test_cli_prints_terse_progress_and_every_line_under_verbose(tmp_path, root, profile, capsys):
    from autopar.profile import save_profile
    from autopar.cli import main
    prof = tmp_path / "prof.json"
    save_profile(profile, prof)
    args = ["plan", str(root / "strategies/examples/resnet2d.py"), "--world-size", "4",
            "--calibration", str(prof)]
    assert main(args + ["-o", str(tmp_path / "a")]) == 0
    terse = capsys.readouterr().out
    assert main(args + ["-o", str(tmp_path / "b"), "--verbose"]) == 0
    verbose = capsys.readouterr().out
    plan = load_plan(tmp_path / "b" / "plan.json")
    for routine in ("priced ", "solved with "):
        assert routine not in terse and routine in verbose
    assert terse.startswith("traced ") and "predicted step time" in terse and "timings:" not in terse
    assert "timings:" in verbose
    assert sum(1 for line in verbose.splitlines() if line[:7].strip().isdigit()) == len(plan.layers)
