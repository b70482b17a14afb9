"""Tracing on meta tensors: layer graphs of CNNs, residual edges kept, nothing allocated, and
named errors for bad model files."""

import textwrap

import pytest

from autopar.errors import ModelFileError, TraceError
from autopar.modelfile import load_model_file
from autopar.trace.graph import to_networkx
from autopar.trace.tracer import trace_model


def test_resnet2d_graph(root):
    g = trace_model(load_model_file(root / "strategies/examples/resnet2d.py"), 8)
    kinds = [l.kind for l in g.layers]
    assert kinds.count("conv") == 15 and kinds[-1] == "linear"
    # batch norm and ReLU fold into their convolution; residual adds are their own layers
    assert [op.kind for op in g.layers[0].ops] == ["conv", "batch_norm", "unary"]
    adds = [l for l in g.layers if l.kind == "binary"]
    assert len(adds) == 6 and all(len(l.inputs) == 2 for l in adds)
    nxg = to_networkx(g)
    skip = [(u, v) for u, v in nxg.edges if v - u > 1]
    assert skip, "residual edges must be kept"
    conv = g.layers[0].anchor
    assert conv.params["weight"] == [16, 3, 3, 3] and conv.param_names["weight"] == "stem.0.weight"
    assert conv.flops_fwd == 2 * 8 * 16 * 32 * 32 * 3 * 9 and conv.flops_bwd == 2 * conv.flops_fwd
    assert conv.module == "stem.0" and conv.source.startswith("resnet2d.py:")
    assert g.buffer_updates and all(op.kind == "buffer_update" for op in g.buffer_updates)
    assert nxg.nodes[0]["param_numel"] == 16 * 3 * 9 + 2 * 16


def test_huge_3d_sample_traces_without_allocating(tmp_path, root, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CNN3D_SIZE", "512")
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    g = trace_model(load_model_file(root / "strategies/examples/cnn3d_large.py"), 1)
    assert g.inputs[0].shape == [1, 1, 512, 512, 512]
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 400  # one fp32 activation of 8 channels would be 4 GiB


def _write(tmp_path, body, name="m.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        load_model_file(tmp_path / "nope.py")


def test_file_that_does_not_import(tmp_path):
    p = _write(tmp_path, "import torch\nraise RuntimeError('broken on purpose')\n")
    with pytest.raises(ModelFileError, match=r"does not import.*broken on purpose.*m.py:2"):
        load_model_file(p)


def test_file_without_entry_points(tmp_path):
    p = _write(tmp_path, "def build_model():\n    pass\n")
    with pytest.raises(ModelFileError, match="example_inputs"):
        load_model_file(p)


def test_untraceable_model_names_the_line(tmp_path):
    p = _write(tmp_path, """
        import torch
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.l = nn.Linear(4, 4)
            def forward(self, x):
                if x.sum().item() > 0:   # data-dependent control flow
                    return self.l(x)
                return x
        def build_model():
            return M()
        def example_inputs(b):
            return (torch.randn(b, 4),)
        """)
    with pytest.raises(TraceError) as e:
        trace_model(load_model_file(p), 2)
    assert "m.py:10" in str(e.value) or "item" in str(e.value)
