"""Sub-graph planning units (``autopar.trace.units``): a module's layers merged into one unit
with several inputs and outputs, planned as one choice, executed equal to one process."""

import textwrap

import pytest

from autopar.modelfile import load_model_file
from autopar.trace.cache import trace_cached
from autopar.trace.units import UnitError, merge_units

BRANCHY = """
import torch
from torch import nn
import torch.nn.functional as F

class Block(nn.Module):
    # two parallel branches; the sum leaves the block, and so does branch a on its own
    def __init__(self, c):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.b = nn.Conv2d(c, c, 1)
    def forward(self, x):
        ya = self.a(x)
        return F.relu(ya + self.b(x)), ya

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.block = Block(6)
        self.post = nn.Conv2d(6, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)
    def forward(self, x):
        h = F.relu(self.stem(x))
        y, side = self.block(h)
        z = self.post(y) + side
        return self.fc(z.mean(dim=(2, 3)))

PLANNING_UNITS = {units!r}

def build_model():
    return Net()

def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 8, 8),)
"""


def _write(tmp_path, units):
    p = tmp_path / "branchy.py"
    p.write_text(textwrap.dedent(BRANCHY.format(units=units)))
    return p


def test_merge_makes_one_unit_with_two_outputs(tmp_path):
    mf = load_model_file(_write(tmp_path, ["block"]))
    graph, _ = trace_cached(mf, 4, use_cache=False)
    units = [lay for lay in graph.layers if lay.module == "block"]
    assert len(units) == 1
    unit = units[0]
    assert len(unit.outputs) == 2 and unit.side_outputs, unit.outputs
    assert {op.module for op in unit.ops} >= {"block.a", "block.b"}
    # every value the unit reads from outside is one input (the stem's activation)
    assert len(unit.inputs) == 1
    prod = graph.producer()
    for v in unit.outputs:
        assert prod[v] == unit.index
    # edges carry each output to its own consumer
    out_edges = {(v, d) for s, d, v in graph.edges() if s == unit.index}
    assert {v for v, _ in out_edges} == set(unit.outputs)
    # topological order: every edge goes forward
    assert all(s < d for s, d, _ in graph.edges())
    # JSON round trip keeps the side outputs
    from autopar.decomp.ir import LayerGraphData
    again = LayerGraphData.from_json(graph.to_json())
    assert [lay.outputs for lay in again.layers] == [lay.outputs for lay in graph.layers]


def test_no_units_leaves_the_graph_alone(tmp_path):
    mf = load_model_file(_write(tmp_path, []))
    graph, _ = trace_cached(mf, 4, use_cache=False)
    assert merge_units(graph, []) is graph
    assert all(lay.outputs == [lay.output] for lay in graph.layers)


def test_unit_that_would_form_a_cycle_is_refused(tmp_path):
    # stem and post in one unit, with the block in between reading from and feeding it
    mf = load_model_file(_write(tmp_path, ["stem", "post"]))
    graph, _ = trace_cached(mf, 4, use_cache=False)
    merge_units(graph, ["stem"])          # alone: fine
    from autopar.decomp.ir import LayerGraphData
    # force both into one unit by renaming post's module into stem's
    data = graph.to_json()
    for lay in data["layers"]:
        if lay["module"].startswith("post"):
            lay["module"] = "stem.post"
            for op in lay["ops"]:
                op["module"] = "stem.post"
    with pytest.raises(UnitError, match="stem"):
        merge_units(LayerGraphData.from_json(data), ["stem"])


def test_bad_planning_units_is_a_named_error(tmp_path):
    from autopar.errors import ModelFileError
    mf = load_model_file(_write(tmp_path, "block"))
    with pytest.raises(ModelFileError, match="PLANNING_UNITS"):
        mf.planning_units()


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["sample", "spatial"])
def test_unit_plan_executes_equal_to_one_process(kind, tmp_path, profile):
    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.execute.runner import ExecuteOptions, execute
    from autopar.planner import make_plan

    model = _write(tmp_path, ["block"])
    mf = load_model_file(model)
    graph, _ = trace_cached(mf, 4, use_cache=False)
    unit = next(lay.index for lay in graph.layers if lay.module == "block")
    r = make_plan(model, PlanOptions(world_size=2, batch_size=4, out_dir=tmp_path / "plan"),
                  PlanHooks(profile=profile, force={unit: kind}))
    assert r.plan.layer(unit).decomposition().kind == kind
    run, _ = execute(r.plan_path, ExecuteOptions(steps=1, warmup=0, instrumented_steps=1,
                                                 timeout_s=180, ddp=False),
                     out_dir=tmp_path / "run", progress=lambda s: None)
    assert run.validation.passed, run.validation.failures
