"""Re-planning from the trace cache does not run the user's loss again: whether the loss is a
vocabulary cross-entropy (``planner.trace.vocab_loss_output``, seconds on a large GPT) is remembered
beside the cached trace, and a memo that does not name the graph's output is recomputed."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_vocab_loss_answer_is_remembered_beside_the_trace(tmp_path, monkeypatch):
    import autopar.planner.trace as pl
    from autopar.modelfile import load_model_file
    from autopar.trace.cache import trace_cached, trace_key
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    mf = load_model_file(ROOT / "strategies/examples/gpt.py")
    graph, _ = trace_cached(mf, 4)
    first = pl.vocab_loss_output_cached(mf, graph, 4)
    assert first == graph.output                       # the shipped GPT's loss is one cross-entropy
    memo = tmp_path / f"{trace_key(mf.path, 4)}.vocab-loss.json"
    assert memo.exists()

    def fail(*a, **k):
        raise AssertionError("the loss ran again")
    monkeypatch.setattr(pl, "vocab_loss_output", fail)
    assert pl.vocab_loss_output_cached(mf, graph, 4) == first
    # a memo naming another value (a stale or corrupt file) is not trusted
    memo.write_text('{"loss_output": "not_a_value"}')
    monkeypatch.setattr(pl, "vocab_loss_output", lambda *a: "recomputed")
    assert pl.vocab_loss_output_cached(mf, graph, 4) == "recomputed"
    memo.write_text("{corrupt")
    assert pl.vocab_loss_output_cached(mf, graph, 4) == "recomputed"
