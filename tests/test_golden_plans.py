"""Golden plans: the ILP (not just a cost comparison) picks what the papers say it should."""

import textwrap

from autopar.artifacts import PlanHooks, PlanOptions
from autopar.planner import make_plan

MLP = """
import torch
from torch import nn
WIDTH = {width}
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.c = nn.Linear(WIDTH, 4)
    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))
def build_model():
    return M()
def example_inputs(b):
    return (torch.randn(b, WIDTH),)
"""


def _plan(tmp_path, width, batch, profile, world=2, **kw):
    f = tmp_path / f"mlp{width}.py"
    f.write_text(textwrap.dedent(MLP.format(width=width)))
    r = make_plan(f, PlanOptions(world_size=world, batch_size=batch, write=False, **kw), PlanHooks(profile=profile))
    return {l.module: l.choice for l in r.plan.layers}


def test_very_wide_layers_with_a_small_batch_go_to_channel_or_filter(tmp_path, profile):
    choice = _plan(tmp_path, 4096, 2, profile)
    for m in ("a", "b"):
        assert choice[m].startswith(("channel", "filter")), choice


def test_narrow_layers_with_a_large_batch_stay_sample(tmp_path, profile):
    choice = _plan(tmp_path, 16, 8192, profile)
    assert all(c.startswith("sample") for c in choice.values()), choice


def test_memory_forces_spatial_for_one_huge_sample(tmp_path, root, profile, monkeypatch):
    monkeypatch.setenv("AUTOPAR_MESH_SIZE", "256")
    from autopar.errors import InfeasiblePlan
    model = root / "strategies/examples/meshtangle2d.py"
    hooks = PlanHooks(profile=profile)
    free = make_plan(model, PlanOptions(world_size=4, batch_size=1, write=False, kinds=["sample", "replicate"],
                                        memory_limit_bytes=None), hooks)
    need = free.plan.predicted.memory_per_rank_bytes
    # one sample per rank does not fit: only spatial decomposition can plan it
    try:
        make_plan(model, PlanOptions(world_size=4, batch_size=1, write=False, kinds=["sample", "replicate"],
                                     memory_limit_bytes=need * 0.5), hooks)
        raise AssertionError("sample/replicate should not fit")
    except InfeasiblePlan:
        pass
    r = make_plan(model, PlanOptions(world_size=4, batch_size=1, write=False, memory_limit_bytes=need * 0.5), hooks)
    kinds = {l.choice.split("(")[0] for l in r.plan.layers}
    assert "spatial" in kinds and r.plan.predicted.memory_per_rank_bytes <= need * 0.5
