"""The pre-dispatch recorder (``autopar.trace.recorder``) gives the layer graph torch.export
gives, field for field, without importing torch._dynamo; what it cannot reproduce falls back
to torch.export."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

from autopar.modelfile import load_model_file
from autopar.trace import recorder
from autopar.trace.tracer import RECORDER, trace_model


def _json(g) -> dict:
    """The graph's JSON without the tracer's name, the user module's per-process import name
    made one name."""
    text = re.sub(r"autopar_user_model_\d+", "autopar_user_model", json.dumps(g.to_json()))
    return {k: v for k, v in json.loads(text).items() if k != "tracer"}


def _by_export(monkeypatch):
    def refuse(model, inputs):
        raise recorder.Unsupported("test: use torch.export")
    monkeypatch.setattr(recorder, "record", refuse)


@pytest.mark.parametrize("example,batch,env", [
    ("resnet2d", 8, {}),                                   # conv, batch norm, buffer updates, residuals
    ("torch_encoder", 4, {"AUTOPAR_ENC_CAUSAL": "1"}),     # a mask made in forward, left unused by is_causal
    ("gpt", 4, {"AUTOPAR_GPT_LAYERS": "2"}),               # arange in forward, split/getitem, views
    ("meshtangle2d", 4, {}),
])
def test_recorder_graph_equals_export_graph(root, monkeypatch, example, batch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    mf = load_model_file(root / f"strategies/examples/{example}.py")
    rec = trace_model(mf, batch)
    assert rec.tracer == RECORDER
    with monkeypatch.context() as m:
        _by_export(m)
        exp = trace_model(mf, batch)
    assert exp.tracer == "torch.export"
    assert _json(rec) == _json(exp)
    assert any(op.source.startswith(f"{example}.py:") for lay in rec.layers for op in lay.ops)


def test_a_constant_with_data_falls_back_to_export(tmp_path):
    """A tensor made from data inside forward is not one the recorder knows: export traces the
    model and names the line, as before the recorder existed."""
    p = tmp_path / "const.py"
    p.write_text(textwrap.dedent("""
        import torch
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 4)
                self.scale = torch.ones(4)          # a plain attribute, not a buffer
            def forward(self, x):
                return self.fc(x) * self.scale
        def build_model():
            return M()
        def example_inputs(b):
            return (torch.randn(b, 4),)
    """))
    import torch
    mf = load_model_file(p)
    with torch.device("meta"):
        model, inputs = mf.build_model(), mf.example_inputs(2)
    with pytest.raises(recorder.Unsupported, match="constant with data"):
        recorder.record(model, inputs)
    from autopar.errors import TraceError
    try:
        g = trace_model(mf, 2)
    except TraceError as e:                    # export's own verdict on such a model
        assert "register it as a buffer" in str(e) or "does not trace" in str(e)
    else:
        assert g.tracer != RECORDER


def test_tracing_a_cnn_does_not_import_dynamo(root):
    """The point of the recorder: a cold trace of a CNN imports neither torch.export's tracer
    nor torch._dynamo (1-2 s of a cold ``autopar plan``)."""
    code = textwrap.dedent(f"""
        import sys
        from autopar.modelfile import load_model_file
        from autopar.trace.tracer import trace_model
        g = trace_model(load_model_file({str(root / 'strategies/examples/resnet2d.py')!r}), 8)
        print(g.tracer, "torch._dynamo" in sys.modules, "torch.export._trace" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.stdout.split()[-3:] == [RECORDER.split()[-1], "False", "False"]


def test_recording_leaves_no_global_state_behind(root):
    """Module hooks, backend flags, torch.compiler's compiling flags and the wrappers' cached
    attribute are all restored, also when the forward fails."""
    import torch
    from torch.nn.modules import module as m

    class Boom(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    before = (dict(m._global_forward_pre_hooks), dict(m._global_forward_hooks), torch.backends.cudnn.enabled,
              torch.backends.mkldnn.enabled, torch.compiler.is_compiling(), torch.compiler.is_exporting())
    mf = load_model_file(root / "strategies/examples/resnet2d.py")
    with torch.device("meta"):
        model, inputs = mf.build_model(), mf.example_inputs(2)
    recorder.record(model, inputs)
    with pytest.raises(recorder.Unsupported, match="boom"):
        recorder.record(Boom(), (torch.empty(2, device="meta"),))
    after = (dict(m._global_forward_pre_hooks), dict(m._global_forward_hooks), torch.backends.cudnn.enabled,
             torch.backends.mkldnn.enabled, torch.compiler.is_compiling(), torch.compiler.is_exporting())
    assert after == before
    import gc
    code = torch._compile._disable_dynamo(lambda: None).__code__
    for f in gc.get_referrers(code):
        cells = dict(zip(getattr(getattr(f, "__code__", None), "co_freevars", ()), f.__closure__ or ()))
        fn = cells["fn"].cell_contents if "fn" in cells else None
        assert fn is None or getattr(fn, "__dynamo_disable", None) is not fn
