"""Stage 2, trace: the model's layer graph on meta tensors (or the trace cache), attention
blocks and Conv1D MLPs merged into units, and whether the loss is a vocabulary cross-entropy."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..decomp.tensor_parallel.cross_entropy import loss_is_cross_entropy
from ..decomp.tensor_parallel.detect import attention_modules, mlp_modules
from ..io import atomic_write_json, read_json
from ..modelfile import output_structure, rebuild_output
from ..ops import describe_unregistered
from ..trace.cache import cache_dir, trace_cached, trace_key
from ..trace.tracer import STEP_TRACER
from ..trace.units import merge_units
from .load import Loaded, Request


@dataclass(frozen=True)
class Traced:
    graph: Any                 # ``decomp.ir.LayerGraphData``
    from_cache: bool
    loss_output: str | None    # the output a vocabulary-parallel loss may read (``vocab_loss_output``)
    trace_s: float


def trace(loaded: Loaded, req: Request, graph=None) -> Traced:
    """Trace (or take ``graph``, a hook), say so, and name the unregistered ops."""
    t = time.perf_counter()
    cached = False
    mf, use_cache = loaded.mf, req.options.trace_cache
    if graph is None:
        graph, cached = trace_cached(mf, loaded.batch_size, use_cache=use_cache)
        graph = attention_units(graph)
    trace_s = time.perf_counter() - t
    req.say(f"traced {mf.name}: {len(graph.layers)} layers ({graph.tracer}"
            f"{', from the trace cache' if cached else ''}) in {trace_s:.2f} s")
    if graph.unregistered:
        req.say(describe_unregistered(graph.unregistered))
    loss = vocab_loss_output_cached(mf, graph, loaded.batch_size, use_cache)
    return Traced(graph, cached, loss, trace_s)


def attention_units(graph):
    """``graph`` with every attention block and every Conv1D MLP
    (``decomp.tensor_parallel.detect``) merged into one sub-graph unit, so that head
    parallelism and the Megatron MLP pair can be priced for it."""
    att = attention_modules(graph)
    return merge_units(graph, att + mlp_modules(graph, att))


def vocab_loss_output_cached(mf, graph, batch_size: int, use_cache: bool = True) -> str | None:
    """``vocab_loss_output``, remembered beside the trace cache under the trace's key (it runs
    the user's loss on meta tensors: seconds of torch import and tracing on a re-plan that the
    trace cache otherwise spares). A cached answer is trusted only when it names the graph's
    own output, or no output; anything else is recomputed."""
    if not use_cache:
        return vocab_loss_output(mf, graph, batch_size)
    path = cache_dir() / f"{trace_key(mf.path, batch_size)}.vocab-loss.json"
    try:
        got = read_json(path, ValueError, "vocabulary-loss memo")["loss_output"]
        if got is None or got == graph.output:
            return got
    except (OSError, ValueError, KeyError, TypeError):
        pass
    out = vocab_loss_output(mf, graph, batch_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"loss_output": out})
    except OSError:
        pass                      # a read-only cache folder: computed again next time
    return out


def vocab_loss_output(mf, graph, batch_size: int) -> str | None:
    """The graph's output when the model file's loss is one cross-entropy over the output's last
    dim and a lone linear makes it, on (batch, sequence, vocabulary) logits (a language-model
    head: ``vocab_head`` may then split the vocabulary and run the loss vocabulary-parallel);
    None otherwise. Imports torch (to run the loss on meta tensors) only for such a head, so
    re-planning a CNN from the trace cache still imports no torch."""
    out = graph.output
    lay = next((lay for lay in graph.layers if lay.output == out), None)
    if lay is None or len(lay.ops) != 1 or lay.anchor.kind != "linear" or len(lay.out_shape) < 3:
        return None
    try:
        target = mf.example_targets(batch_size)
    except Exception:
        return None
    loss = mf.loss_fn()
    if graph.tracer == STEP_TRACER:
        # the model returns a structure (a ModelOutput) and the loss reads the logits from it:
        # feed the loss the same structure, found on a model built on the meta device
        import torch
        try:
            with torch.device("meta"):
                structure = output_structure(mf.build_model(), graph)
        except Exception:
            return None
        user_loss = loss

        def loss(x, *t):
            return user_loss(rebuild_output(structure, x), *t)
    return out if loss_is_cross_entropy(loss, lay.out_shape, target) is None else None
