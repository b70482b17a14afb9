"""The trace cache: a second plan of an unchanged model skips tracing; any change misses."""

import json

from autopar.trace import cache


def _model(path, width):
    path.write_text(f'''
import torch
def build_model():
    return torch.nn.Sequential(torch.nn.Linear(8, {width}), torch.nn.ReLU(), torch.nn.Linear({width}, 2))
def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
''')
    return path


def test_second_trace_hits_and_changes_miss(tmp_path, monkeypatch):
    from autopar.modelfile import load_model_file
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    m = _model(tmp_path / "m.py", 16)
    g1, hit1 = cache.trace_cached(load_model_file(m), 4)
    g2, hit2 = cache.trace_cached(load_model_file(m), 4)
    assert (hit1, hit2) == (False, True)
    assert json.dumps(g1.to_json(), sort_keys=True) == json.dumps(g2.to_json(), sort_keys=True)
    k = cache.trace_key(m, 4)
    assert cache.trace_key(m, 8) != k                      # batch size
    monkeypatch.setenv("AUTOPAR_SOME_SIZE", "3")
    assert cache.trace_key(m, 4) != k                      # the models' environment knobs
    monkeypatch.delenv("AUTOPAR_SOME_SIZE")
    (tmp_path / "helper.py").write_text("X = 1\n")
    assert cache.trace_key(m, 4) != k                      # a neighbour the model may import
    _model(m, 32)
    g3, hit3 = cache.trace_cached(load_model_file(m), 4)   # the model itself
    assert not hit3 and g3.layers[0].ops[0].out_shape[-1] == 32


def test_corrupt_entry_is_traced_again(tmp_path, monkeypatch):
    from autopar.modelfile import load_model_file
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    m = _model(tmp_path / "m.py", 16)
    cache.trace_cached(load_model_file(m), 4)
    entry = tmp_path / "cache" / f"{cache.trace_key(m, 4)}.json"
    entry.write_text(entry.read_text()[:50])
    g, hit = cache.trace_cached(load_model_file(m), 4)
    assert not hit and g.layers
    assert cache.load(cache.trace_key(m, 4)) is not None   # rewritten whole
