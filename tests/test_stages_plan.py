"""Planning pipeline stages through the plan-level strategy seam (``planner.strategies.stages``):
plan.json names the stages and every count priced; bad requests are named errors. No process."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from autopar.errors import PipelineError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpt8(monkeypatch):
    for k, v in {"AUTOPAR_GPT_LAYERS": "8", "AUTOPAR_GPT_EMBED": "32", "AUTOPAR_GPT_HEADS": "4",
                 "AUTOPAR_GPT_SEQ": "16", "AUTOPAR_GPT_VOCAB": "64"}.items():
        monkeypatch.setenv(k, v)
    return ROOT / "strategies/examples/gpt.py"


def _plan(model, **kw):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401  (registers the strategy)
    from autopar.profile import load_profile
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    return make_plan(model, PlanOptions(world_size=4, batch_size=8, write=False, placement="block",
                                        trace_cache=False, **kw), PlanHooks(profile=prof))


def test_pipeline_2_names_its_stages_and_prices_every_m(gpt8):
    plan = _plan(gpt8, pipeline=2).plan
    rt = plan.runtime.to_json() if hasattr(plan.runtime, "to_json") else dict(plan.runtime.extra)
    assert rt["expected"] == "stages"
    st = rt["stages"]["stages"]
    assert [s["layers"] for s in st] == [[0, 4], [4, 8]]
    assert [s["ranks"] for s in st] == [[0, 1], [2, 3]]
    assert rt["stages"]["schedule"]["name"] == "1f1b"
    priced = rt["stage_counts_priced"]
    assert {p["microbatches"] for p in priced if p["stages"] == 2} >= {2, 4}
    assert all(p["step_s"] > 0 for p in priced if "refused" not in p)
    chosen = [s for s in plan.strategies if s.chosen]
    assert [c.strategy for c in chosen] == ["stages"]
    assert plan.options.to_json()["pipeline"] == 2


def test_pipeline_auto_prices_every_feasible_count(gpt8):
    res = _plan(gpt8, pipeline="auto")
    stages = [s for s in res.plan.strategies if s.strategy == "stages"]
    assert sorted(s.label.split()[1] for s in stages) == ["2", "4"]
    assert all(s.step_time_s is not None or s.illegal for s in stages)


def test_a_v_shaped_zero_bubble_schedule_is_planned_with_two_chunks_per_rank(gpt8):
    rt = _plan(gpt8, pipeline=2, schedule="zbv", microbatches=4).plan.runtime.to_json()
    assert rt["stages"]["schedule"] == {"name": "zbv", "microbatches": 4, "virtual": 2,
                                        "torch_class": "ScheduleZBVZeroBubble"}


def test_infeasible_stage_counts_are_named(gpt8):
    with pytest.raises(PipelineError, match=r"feasible stage counts \[2, 4\]"):
        _plan(gpt8, pipeline=3)
    with pytest.raises(PipelineError, match="not one of torch's schedules"):
        _plan(gpt8, pipeline=2, schedule="zigzag")
    with pytest.raises(PipelineError, match="without memory"):
        _plan(gpt8, pipeline=2, memory_limit_bytes=64 * 1024)


def test_a_value_crossing_a_cut_backwards_is_refused_by_name():
    from autopar.planner.strategies.stages import crossing_values

    def lay(name, module, inputs):
        return SimpleNamespace(name=name, module=module, inputs=inputs,
                               ops=[SimpleNamespace(name=name, out_shape=[2, 4], dtype="float32")])
    ok = SimpleNamespace(layers=[lay("a", "blocks.0", []), lay("b", "blocks.1", ["a"]), lay("c", "blocks.2", ["a", "b"])])
    cross = crossing_values(ok, [0, 1, 2])
    assert [v for v, _ in cross[0]] == ["a"] and sorted(v for v, _ in cross[1]) == ["a", "b"]
    assert cross[1][0][1] == 32.0
    bad = SimpleNamespace(layers=[lay("a", "blocks.0", ["c"]), lay("b", "blocks.1", ["a"]), lay("c", "blocks.2", ["b"])])
    with pytest.raises(PipelineError, match="value c .*backwards"):
        crossing_values(bad, [0, 1, 2])


@pytest.mark.dist
def test_a_pipeline_plan_executes_and_validates_at_world_2(monkeypatch, tmp_path):
    """plan --pipeline 2 then execute: float64 validation against one process passes; the run
    records measured step and bubble beside the prediction, and torch DDP timed beside it."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    for k, v in {"AUTOPAR_GPT_LAYERS": "4", "AUTOPAR_GPT_EMBED": "16", "AUTOPAR_GPT_HEADS": "4",
                 "AUTOPAR_GPT_SEQ": "8", "AUTOPAR_GPT_VOCAB": "32"}.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    res = make_plan(ROOT / "strategies/examples/gpt.py",
                    PlanOptions(world_size=2, batch_size=8, out_dir=str(tmp_path / "plan"), placement="block",
                                trace_cache=False, pipeline=2, microbatches=4), PlanHooks(profile=prof))
    run, out = execute(res.plan_path, ExecuteOptions(steps=2, warmup=1, ddp=True, timeout_s=120),
                       out_dir=tmp_path / "run", progress=lambda *_: None)
    assert run.validation.passed and run.validation.checked > 10
    assert len(run.baseline.ddp_step_times_s) == 2 and run.baseline.equivalent
    assert run.ratio_to_ddp == pytest.approx(run.measured.step_time_s / run.baseline.ddp_step_time_s)
    st = run.extra["stages"]
    assert st["measured_step_s"] > 0 and st["predicted_step_s"] == pytest.approx(res.plan.predicted.step_time_s)
    assert 0.0 <= st["measured_bubble_fraction"] <= 1.0 and st["predicted_bubble_fraction"] > 0
    # like for like: the predicted idle share holds the bubble and the sends and sync tail beside it
    price = res.plan.runtime.to_json()["price"]
    assert st["predicted_idle_fraction"] == pytest.approx(1 - price["ideal_s"] / price["step_s"])
    assert st["predicted_idle_fraction"] > st["predicted_bubble_fraction"]
    assert st["cut_messages_checked"] == 4      # stage 0 sent its 4 microbatches as plan.json's cut steps say
    assert (out / "run.json").is_file() and (out / "report.md").is_file()


@pytest.mark.dist
def test_a_plan_with_tensor_parallelism_inside_its_stages_is_chosen_and_validates_at_world_4(monkeypatch, tmp_path):
    """Under a memory limit only stages of dp 1 x tp 2 fit (tp halves each block's weights): the
    search chooses them from the solver's Megatron-pinned sub-plans, plan.json records tp, the
    heads and the sub-plan's kinds, and autopar execute runs it and validates every tp slice of
    every gradient and parameter against one process in float64."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    for k, v in {"AUTOPAR_GPT_LAYERS": "4", "AUTOPAR_GPT_EMBED": "64", "AUTOPAR_GPT_HEADS": "4",
                 "AUTOPAR_GPT_SEQ": "8", "AUTOPAR_GPT_VOCAB": "32"}.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)

    def plan(limit, out=None):
        return make_plan(ROOT / "strategies/examples/gpt.py",
                         PlanOptions(world_size=4, batch_size=8, placement="block", trace_cache=False, pipeline=2,
                                     memory_limit_bytes=limit, write=out is not None, out_dir=out),
                         PlanHooks(profile=prof))
    free = plan(None).plan.runtime.to_json()
    assert free["stages"]["stages"][0]["tp"] == 1           # unlimited: data parallelism inside is faster here
    peak = {}
    for o in free["stage_counts_priced"]:
        if "refused" not in o:
            peak[o["tp"]] = min(peak.get(o["tp"], float("inf")), o["peak_bytes_max"])
    assert peak[2] < peak[1]
    res = plan((peak[1] + peak[2]) / 2, str(tmp_path / "plan"))
    rt = res.plan.runtime.to_json()
    assert [(s["dp"], s["tp"]) for s in rt["stages"]["stages"]] == [(1, 2), (1, 2)]
    assert rt["heads"] == 4 and {"head", "filter", "row_parallel"} <= set(rt["sub_plan_kinds"])
    run, _ = execute(res.plan_path, ExecuteOptions(steps=1, warmup=0, ddp=False, timeout_s=120),
                     out_dir=tmp_path / "run", progress=lambda *_: None)
    assert run.validation.passed and run.validation.dtype == "float64"
    assert run.extra["stages"]["cut_messages_checked"] == 2 * rt["stages"]["schedule"]["microbatches"]
    names = [c.tensor for c in run.validation.checks]
    assert any("grad blocks.0.attn.qkv.weight" in n for n in names) and len(names) > 20


def test_stage_data_is_refused_by_name_when_sharding_is_left_out(gpt8):
    with pytest.raises(PipelineError, match="needs the sharded kind"):
        _plan(gpt8, pipeline=2, stage_data="fsdp", kinds=("sample", "replicate", "head", "filter", "row_parallel"))
    with pytest.raises(PipelineError, match="is not auto"):
        _plan(gpt8, pipeline=2, stage_data="zero9")


def test_a_block_model_the_block_runtime_cannot_cut_gets_stage_plans():
    """torch's TransformerEncoder has layers.i blocks, but the block-stage runtime has no (pre,
    blocks, post) for it: block stages (--stage-data replicate) are refused by name at plan time,
    and with the default (auto) its stages run the solver's plan (``runtime.stage_program``)."""
    from autopar.errors import PipelineError as PE
    enc = ROOT / "strategies/examples/torch_encoder.py"
    with pytest.raises(PE, match="cannot cut EncoderClassifier"):
        _plan(enc, pipeline=2, stage_data="replicate")
    rt = _plan(enc, pipeline=2).plan.runtime.to_json()
    assert {s["data"] for s in rt["stages"]["stages"]} == {"plan"}
    assert rt["stage_plan"]["world_size"] == 2 and len(rt["stage_plan"]["units"]) == len(rt["stage_plan"]["layers"])
    with pytest.raises(PE, match="zbv schedule"):
        _plan(enc, pipeline=2, stage_data="plan", schedule="zbv", microbatches=4)


def test_zero_bubble_schedules_keep_stages_replicated(gpt8):
    with pytest.raises(PipelineError, match="zbv schedule"):
        _plan(gpt8, pipeline=2, schedule="zbv", microbatches=4, stage_data="fsdp")
    rt = _plan(gpt8, pipeline=2, schedule="zbv", microbatches=4).plan.runtime.to_json()
    assert rt["search"]["data_axes"] == ["replicate"]


def test_fsdp_unit_cost_is_level_1_of_decomp_fsdp():
    """A unit of an FSDP2 stage: memory (S + F) + F + k S, the reduce-scatter's input G transient, its
    gradient reduce-scattered once and its optimizer on the shard instead of an all-reduce and
    the whole, its gather exposed beyond the previous unit's forward."""
    from autopar.cost.stages import fsdp_unit_cost
    from autopar.decomp.fsdp import UnitParams
    from autopar.decomp.stages import StageCost
    u = UnitParams("b", ((10, 4), (7,)), 4)            # F = 4 (40 + 7) = 188; dp 4: rows 3 and 2, S = 4 (12 + 2)
    F, S, G = 188.0, 56.0, 224.0
    calls = []

    def coll(kind, p, n):
        calls.append((kind, p, n))
        return {"allgather": 5.0, "reduce_scatter": 3.0}[kind]
    c = fsdp_unit_cost(StageCost(1.0, 2.0, 0.5 + 0.25, 100.0, 3 * F), u, 4, 2.0, 0.25, coll,
                       lambda n, nbytes: nbytes / 1000.0, prev_fwd_s=4.0)
    assert c.static_bytes == (S + F) + F + 2.0 * S and c.transient_bytes == G
    assert c.grad_sync_s == pytest.approx(0.5 + 3.0 + S / 1000.0)
    assert c.fill_s == pytest.approx(1.0) and (c.fwd_s, c.bwd_s, c.act_bytes_per_microbatch) == (1.0, 2.0, 100.0)
    assert ("allgather", 4, G) in calls and ("reduce_scatter", 4, G) in calls


@pytest.mark.dist
def test_fsdp_inside_stages_is_chosen_under_a_limit_and_validates_at_world_4(monkeypatch, tmp_path):
    """Under a memory limit below every replicated stage layout's peak, the search shards each
    stage's dp axis with FSDP2 (the optimizer state over dp), plan.json says so per stage, and
    autopar execute validates every gradient and parameter (gathered) against one process in float64."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    for k, v in {"AUTOPAR_GPT_LAYERS": "4", "AUTOPAR_GPT_EMBED": "64", "AUTOPAR_GPT_HEADS": "4",
                 "AUTOPAR_GPT_SEQ": "8", "AUTOPAR_GPT_VOCAB": "32"}.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)

    def plan(limit, out=None, kinds=("sample", "replicate", "sharded")):     # no tensor parallelism: tp 1
        return make_plan(ROOT / "strategies/examples/gpt.py",
                         PlanOptions(world_size=4, batch_size=8, placement="block", trace_cache=False, pipeline=2,
                                     memory_limit_bytes=limit, write=out is not None, out_dir=out, kinds=kinds,
                                     optimizer_state_per_param=2.0),       # AdamW: FSDP2 saves F/2 a unit at dp 2
                         PlanHooks(profile=prof))
    free = plan(None).plan.runtime.to_json()
    peak: dict[str, float] = {}
    for o in free["stage_counts_priced"]:
        if "refused" not in o:
            peak[o["data"]] = min(peak.get(o["data"], float("inf")), o["peak_bytes_max"])
    assert peak["fsdp"] < peak["replicate"]
    res = plan((peak["fsdp"] + peak["replicate"]) / 2, str(tmp_path / "plan"))
    rt = res.plan.runtime.to_json()
    # stage 0 (two microbatches in flight under 1F1B) needs FSDP2; stage 1 takes it only where it
    # must: the search's per-stage "mixed" option, when it is the faster
    st = rt["stages"]["stages"]
    assert [s["dp"] for s in st] == [2, 2] and st[0].get("data") == "fsdp"
    assert "sharded" in rt["sub_plan_kinds"] and "FSDP2" in rt["reason"]
    assert any(o["data"] == "mixed" for o in rt["stage_counts_priced"])
    run, _ = execute(res.plan_path, ExecuteOptions(steps=1, warmup=0, ddp=False, timeout_s=120),
                     out_dir=tmp_path / "run", progress=lambda *_: None)
    assert run.validation.passed and run.validation.dtype == "float64"
    # each stage's measured peak (live tensor bytes, deterministic) beside its prediction: the
    # same order (the prediction counts the reduce-scatter buffer and in-flight activations whole)
    rec = run.extra["stages"]
    for k, want in rec["predicted_peak_bytes_per_stage"].items():
        assert 0.5 < rec["measured_peak_bytes_per_stage"][k] / want < 1.5, rec
    names = [c.tensor for c in run.validation.checks]
    assert any("grad blocks.0.attn.qkv.weight" in n for n in names) and len(names) > 20


@pytest.mark.dist
def test_hf_gpt2_pipeline_sends_only_the_hidden_state_and_validates_at_world_4(monkeypatch, tmp_path):
    """Hugging Face GPT-2 (its embedding tied to the head across the two stages) with
    ``--pipeline 2 --stage-data fsdp``: the units follow data flow (its traced embedding dropout
    is listed after the blocks), the cut carries only what a block returns (the attention mask
    built before the blocks is made again in each), and autopar execute validates it in float64
    with torch's sends checked against the plan's cut."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    for k, v in {"AUTOPAR_HF_LAYERS": "4", "AUTOPAR_HF_EMBED": "16", "AUTOPAR_HF_HEADS": "4", "AUTOPAR_HF_SEQ": "8",
                 "AUTOPAR_HF_VOCAB": "32"}.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    res = make_plan(ROOT / "strategies/examples/hf_gpt2.py",
                    PlanOptions(world_size=4, batch_size=8, placement="block", trace_cache=False, pipeline=2,
                                stage_data="fsdp", out_dir=str(tmp_path / "plan")), PlanHooks(profile=prof))
    rt = res.plan.runtime.to_json()
    assert [s.get("data") for s in rt["stages"]["stages"]] == ["fsdp", "fsdp"]
    (cut,) = rt["cuts"]
    assert [len(v["shape"]) for v in cut["values"]] == [3]          # the hidden state [rows, seq, embed] only
    run, _ = execute(res.plan_path, ExecuteOptions(steps=1, warmup=0, ddp=False, timeout_s=180),
                     out_dir=tmp_path / "run", progress=lambda *_: None)
    assert run.validation.passed and run.validation.dtype == "float64"
    assert run.extra["stages"]["cut_messages_checked"] == 2 * rt["stages"]["schedule"]["microbatches"]


@pytest.mark.dist
def test_batch_norm_blocks_on_data_parallel_stages_validate_their_running_statistics(tmp_path):
    """A model file of batch-norm blocks (``pipeline_parts()``) on two stages of dp 2 at world 4:
    autopar execute checks each stage's running statistics after the step (each replica's
    per-microbatch updates, averaged over dp) against one process, beside every gradient."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan
    from autopar.planner.strategies import stages  # noqa: F401
    from autopar.profile import load_profile
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    res = make_plan(ROOT / "tests/toys/bn_blocks.py",
                    PlanOptions(world_size=4, batch_size=16, placement="block", trace_cache=False, pipeline=2,
                                microbatches=4, out_dir=str(tmp_path / "plan")), PlanHooks(profile=prof))
    assert [s["dp"] for s in res.plan.runtime.to_json()["stages"]["stages"]] == [2, 2]
    run, _ = execute(res.plan_path, ExecuteOptions(steps=1, warmup=0, ddp=False, timeout_s=180),
                     out_dir=tmp_path / "run", progress=lambda *_: None)
    buffers = [c for c in run.validation.checks if "buffer" in c.tensor]
    assert run.validation.passed and len(buffers) == 4 * 2 * 2       # 4 ranks x 2 blocks each x mean, var
    assert all(c.passed for c in buffers)


def test_pipeline_options_without_pipeline_are_refused_by_name():
    """--microbatches, --schedule or --stage-data without --pipeline would be ignored silently."""
    from autopar.artifacts import PlanOptions
    from autopar.errors import AutoparError
    for kw in ({"microbatches": 4}, {"schedule": "gpipe"}, {"stage_data": "fsdp"}):
        with pytest.raises(AutoparError, match="without pipeline stages"):
            PlanOptions(world_size=2, **kw)
        PlanOptions(world_size=2, pipeline=2, **kw)          # with stages: fine


def test_the_generated_module_of_a_stage_plan_runs_the_stages(gpt8):
    """A stage plan's generated module lays out the stages and trains through
    ``autopar.parallelize`` (the pipeline), not the whole-world per-layer plan."""
    from autopar.codegen.generate import generate_module
    plan = _plan(gpt8, pipeline=2, stage_data="plan").plan
    text = generate_module(plan)
    compile(text, "gpt_dist.py", "exec")
    assert "stage 0: blocks [0, 4) on ranks [0, 1]" in text and "stage 1: blocks [4, 8) on ranks [2, 3]" in text
    assert "stage plan (the model on 2 ranks" in text and "cut 0 (stage 0 -> 1)" in text
    assert "autopar.parallelize(model, PLAN_FILE)" in text and "class PlannedModel" not in text


def test_auto_weighs_stage_plans_beside_block_stages_when_few_solves(gpt8):
    """Under --stage-data auto the search prices the solver's stage plan beside dp x tp block
    stages when at most PLAN_SOLVES_IN_AUTO stage plans would be solved (here 3: P = 2 ranks,
    M 2, 4 or 8), and keeps the fastest; a search over many stage counts and microbatch counts would
    solve far more, so there stage plans are asked for by name."""
    from autopar.planner.strategies.stages import PLAN_SOLVES_IN_AUTO, plan_solves
    rt = _plan(gpt8, pipeline=2).plan.runtime.to_json()
    assert rt["search"]["data_axes"] == ["replicate", "fsdp", "plan"]
    priced = [o for o in rt["stage_counts_priced"] if "refused" not in o]
    plans = [o for o in priced if o["data"] == "plan"]
    assert plans and all(o["tp"] == 1 and o["dp"] == 2 for o in plans)
    assert rt["price"]["step_s"] == min(o["step_s"] for o in priced)
    assert plan_solves([2], 4, 8, "1f1b", None) == {(2, 4), (2, 2), (2, 1)}
    assert len(plan_solves([2, 4, 8, 16, 32], 64, 512, "1f1b", None)) > PLAN_SOLVES_IN_AUTO


def test_stage_plans_with_local_batch_norm_are_refused_at_plan_time(monkeypatch):
    """Stage plans run batch norm with global statistics only: local ones (the default) are named
    at plan time, with the flag that fixes it."""
    monkeypatch.setenv("AUTOPAR_CONV_BN", "1")
    conv = ROOT / "strategies/examples/conv_blocks.py"
    with pytest.raises(PipelineError, match="--batch-norm global"):
        _plan(conv, pipeline=2, stage_data="plan")
    rt = _plan(conv, pipeline=2, stage_data="plan", batch_norm="global").plan.runtime.to_json()
    assert rt["stage_plan"]["batch_norm"]["mode"] == "global"


def test_a_stage_plan_is_solved_again_under_the_memory_limit(monkeypatch):
    """One 64x64 image per microbatch on two ranks a stage: the fastest stage plan keeps every
    layer whole on both ranks, which no cut fits under 1.5 MiB; the plan is then solved again
    under the budget every cut needs (``stage_plan_budget``), and splits the convolutions."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.planner import make_plan
    from autopar.profile import load_profile
    for k, v in {"AUTOPAR_CONV_SIDE": "64", "AUTOPAR_CONV_CH": "16"}.items():
        monkeypatch.setenv(k, v)
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)

    def plan(limit):
        return make_plan(ROOT / "strategies/examples/conv_blocks.py", PlanOptions(
            world_size=4, batch_size=4, write=False, placement="block", trace_cache=False, pipeline=2,
            stage_data="plan", microbatches=4, memory_limit_bytes=limit), PlanHooks(profile=prof)).plan.runtime.to_json()
    free = plan(None)
    assert set(free["stage_plan"]["choices"]) == {"replicate"} and max(free["price"]["peak_bytes"]) > 1.5 * 2**20
    tight = plan(1.5 * 2**20)
    kinds = {c.split("(")[0] for c in tight["stage_plan"]["choices"]}
    assert kinds & {"spatial", "filter", "channel"}
    assert max(tight["price"]["peak_bytes"]) <= 1.5 * 2**20 and tight["price"]["step_s"] > free["price"]["step_s"]


def test_explain_names_the_stage_plans_choice_for_a_layer(gpt8, tmp_path):
    """``autopar explain`` of a stage layout says that stages run, and, under a stage plan, the
    stage plan's choice for the layer and the stage that runs it."""
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.explain import explain
    from autopar.planner import make_plan
    from autopar.profile import load_profile
    prof = load_profile(ROOT / "calibration/cpu-2core-gloo.json", check_machine=False)
    res = make_plan(gpt8, PlanOptions(world_size=4, batch_size=8, placement="block", trace_cache=False, pipeline=2,
                                      stage_data="plan", out_dir=str(tmp_path / "p")), PlanHooks(profile=prof))
    text = explain(res.plan_path, 5)
    assert "this plan runs pipeline stages" in text
    assert "under the stage plan (the model on 2 ranks per stage, one microbatch) this layer is" in text
    assert "run on stage 0 (ranks [0, 1])" in text
    assert "x tp" not in res.plan.runtime.to_json()["reason"]
