"""Sample parallelism through views that merge the batch with the next dims (Hugging Face's
Conv1D: ``x.view(-1, E)`` of an ``(N, S, E)`` activation, an ``addmm``, and the view back):
legal when the sample parts divide N (block c of the N S rows is then exactly the rows of
sample block c), illegal otherwise; an empty operand (a legacy empty cache concatenated to)
is ignored. The Hugging Face GPT-2 plan is data-parallel through its attention and MLP."""

import textwrap

import pytest

from autopar.decomp.common import batch_dim_ok
from autopar.modelfile import load_model_file
from autopar.trace.tracer import trace_model

MODEL = textwrap.dedent('''
    import torch
    from torch import nn

    class Conv1D(nn.Module):          # Hugging Face's Conv1D
        def __init__(self, nf, nx):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf))
            self.bias = nn.Parameter(torch.zeros(nf))

        def forward(self, x):
            size_out = x.size()[:-1] + (self.weight.shape[1],)
            x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
            return x.view(size_out)

    def build_model():
        return Conv1D(8, 4)

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 3, 4),)
''')


def _layers(tmp_path, batch):
    f = tmp_path / "conv1d.py"
    f.write_text(MODEL)
    return trace_model(load_model_file(f), batch).layers


def test_merged_rows_are_sample_blocks_when_parts_divide_the_batch(tmp_path):
    layers = _layers(tmp_path, 4)
    merged = [lay for lay in layers if len({int(s[0]) for op in lay.ops for s in op.in_shapes + [op.out_shape]}) > 1]
    assert merged, [(lay.name, [op.out_shape for op in lay.ops]) for lay in layers]
    for lay in merged:
        assert batch_dim_ok(lay) is not None              # other decompositions: dim 0 must be the batch
        assert batch_dim_ok(lay, merged_parts=2) is None
        assert batch_dim_ok(lay, merged_parts=4) is None
        assert "dim 0 is not the batch" in batch_dim_ok(lay, merged_parts=3)


def test_merged_rows_rejected_when_parts_do_not_divide_the_batch(tmp_path):
    for lay in _layers(tmp_path, 3):
        if len({int(s[0]) for op in lay.ops for s in op.in_shapes + [op.out_shape]}) > 1:
            assert batch_dim_ok(lay, merged_parts=2) is not None


def test_hf_gpt2_plan_is_data_parallel_through_its_blocks(root):
    pytest.importorskip("transformers")
    from autopar.artifacts import PlanOptions
    from autopar.planner import make_plan
    r = make_plan(str(root / "strategies/examples/hf_gpt2.py"),
                  PlanOptions(world_size=2, write=False, calibration=str(root / "calibration/cpu-2core-gloo.json")))
    kinds = {op.kind: set() for o in r.table.layers for op in o.layer.ops}
    for o, ci in zip(r.table.layers, r.solution.choice):
        for op in o.layer.ops:
            kinds[op.kind].add(o.choices[ci].kind)
    assert kinds["linear"] == {"sample"}, kinds["linear"]          # every Conv1D (addmm)
    assert kinds["attention"] == {"sample"}, kinds["attention"]
