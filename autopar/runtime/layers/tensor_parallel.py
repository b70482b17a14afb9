"""Run-time halves of the Megatron-style decompositions (``autopar.decomp.tensor_parallel``):
``head`` / ``mlp`` (column- and row-parallel projections, slices and views to the local heads),
``vocab`` (the embedding rows this rank holds, zeros elsewhere) and ``sequence`` (this rank's
block of the sequence)."""

from __future__ import annotations

from typing import Any

import torch

from ...decomp.base import runs
from ...decomp.ir import EXPAND, VIEW, Layer, OpSpec
from ...decomp.sharding import block_extent, block_start
from ...decomp.tensor_parallel.detect import projection
from ...decomp.tensor_parallel.heads import HeadParallel, cached_analysis
from ...decomp.tensor_parallel.sequence import SequenceParallel
from ...decomp.tensor_parallel.vocab import VocabParallel
from ..ops import call_local, local_sizes, resolve_target, substitute_cached
from .channel_filter import _add_bias, _anchor


@runs(HeadParallel)
def run_headparallel(dec, comm, layer: Layer, op: OpSpec, inputs: list[Any], params: dict[str, Any],
        buffers: dict[str, Any]):
    an, why = cached_analysis(layer, dec.parts)
    if an is None:
        raise RuntimeError(f"{layer.module or layer.name}: {why}")
    cs, ct = divmod(comm.rank, dec.parts)
    if op.name == an.row:
        if projection(op).conv1d:                      # addmm(bias, x, w): x @ w, bias once
            a = substitute_cached(op.args, dict(zip(op.inputs, inputs)), params, buffers)
            y, bias = torch.mm(a[1], a[2]), a[0]
        else:
            y, bias = _anchor(op, inputs, params, buffers, keep_bias=False)
        return _add_bias(y, bias if ct == 0 else None, op)
    values = dict(zip(op.inputs, inputs))
    args = substitute_cached(op.args, values, params, buffers)
    kwargs = substitute_cached(op.kwargs, values, params, buffers)
    if op.name in an.slices:
        s0, s1 = an.slices[op.name]
        if op.target.startswith("aten.narrow"):
            args[2], args[3] = s0, s1 - s0
        else:
            while len(args) < 4:
                args.append(None)
            args[2], args[3] = s0, s1
    elif op.kind in (VIEW, EXPAND) and len(args) >= 2 and isinstance(args[1], list):
        args[1] = local_sizes(args[1], op.out_shape, dec.local_shape(an, op.name, op.out_shape, cs))
    return resolve_target(op.target)(*args, **kwargs)


@runs(VocabParallel)
def run_vocabparallel(dec, comm, layer, op, inputs, params, buffers):
    ct = comm.rank % dec.parts
    w = params[op.param_names["weight"]]
    ids = inputs[0]
    v = int(op.params["weight"][0])
    lo, n = block_start(v, dec.parts, ct), block_extent(v, dec.parts, ct)
    mine = (ids >= lo) & (ids < lo + n)
    local = torch.where(mine, ids - lo, torch.zeros_like(ids))
    y = torch.ops.aten.embedding.default(w, local)
    return y * mine.unsqueeze(-1).to(y.dtype)


@runs(SequenceParallel)
def run_sequenceparallel(dec, comm, layer, op, inputs, params, buffers):
    cs, ct = divmod(comm.rank, dec.parts)
    seq = int(layer.out_shape[1])
    s0, ns = block_start(seq, dec.parts, ct), block_extent(seq, dec.parts, ct)
    local = []
    for x, sh in zip(inputs, op.in_shapes):
        if hasattr(x, "narrow") and not dec._full_rank(layer, sh) and x.dim() == len(sh):
            a = 1 - (len(layer.out_shape) - len(sh))
            if a >= 0 and int(sh[a]) == seq and x.shape[a] == seq:
                x = x.narrow(a, s0, ns)
        local.append(x)
    return call_local(op, local, params, buffers,
                      local_out_shape=dec.sharding().local_shape(op.out_shape, comm.rank, comm.world))
