"""Models as users have them: the untouched Hugging Face ResNet (built from a small config, its
loss reading ``output.logits``) plans, and the distributed model returns the model's own output
structure (a ``ModelOutput``), so the user's loss runs unchanged under ``autopar execute``."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("transformers")

from autopar.artifacts import PlanHooks, PlanOptions  # noqa: E402
from autopar.execute.runner import ExecuteOptions, execute  # noqa: E402
from autopar.planner import make_plan  # noqa: E402

pytestmark = pytest.mark.dist

HF = """
import torch
import torch.nn.functional as F
from transformers import ResNetConfig, ResNetForImageClassification


def build_model():
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic", num_labels=5)
    return ResNetForImageClassification(cfg)


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 32, 32),)


def example_targets(batch_size):
    return torch.randint(0, 5, (batch_size,))


def loss_fn(output, target):
    return F.cross_entropy(output.logits, target)
"""


@pytest.fixture
def hf(tmp_path):
    f = tmp_path / "hf_resnet.py"
    f.write_text(textwrap.dedent(HF))
    return f


def test_output_structure_is_the_models(hf):
    """Found on meta tensors (nothing allocated) and rebuilt around the local block."""
    import torch
    from transformers.modeling_outputs import ImageClassifierOutputWithNoAttention

    from autopar.modelfile import load_model_file
    from autopar.runtime.model import output_structure, output_tensor, rebuild_output
    from autopar.trace.tracer import trace_model

    mf = load_model_file(hf)
    graph = trace_model(mf, 4)
    st = output_structure(mf.build_model(), graph)
    t = torch.randn(2, 5)
    out = rebuild_output(st, t)
    assert isinstance(out, ImageClassifierOutputWithNoAttention) and out.logits is t
    assert output_tensor(out) is t and output_tensor(t) is t
    assert rebuild_output(None, t) is t


@pytest.mark.parametrize("world,force", [(2, {}), (2, {1: "replicate", 2: "spatial(1,2x1)"}),
                                         (4, {0: "spatial(2,2x1)", 3: "filter(2,2)"})])
def test_hugging_face_resnet_executes_with_the_users_loss(world, force, hf, tmp_path, profile):
    r = make_plan(hf, PlanOptions(world_size=world, batch_size=8, out_dir=tmp_path / "plan", max_candidates=30),
                  PlanHooks(profile=profile, force=force))
    for li, want in force.items():
        assert r.plan.layer(li).choice == want
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1, timeout_s=240),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, [c.tensor for c in run.validation.failures]
    assert run.baseline is not None and run.baseline.equivalent
