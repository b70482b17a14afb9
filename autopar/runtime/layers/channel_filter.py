"""Run-time halves of ``channel`` / ``filter`` / ``channel_filter`` and ``row_parallel``
(``autopar.decomp.channel_filter``): the anchor (convolution or linear) on the weight shards,
partial sums over the channel group reduce-scattered and the bias added once; the rest of the
layer on the local block."""

from __future__ import annotations

from typing import Any

from ...decomp.base import runs
from ...decomp.channel_filter import RowParallel, _feature_dim, _WeightGrid
from ...decomp.ir import BATCH_NORM, Layer, OpSpec
from ...decomp.sharding import block_extent
from ..comm import reduce_scatter_dim
from ..ops import call_local, resolve_target, run_batch_norm, substitute_cached


@runs(_WeightGrid)
def run_weightgrid(dec, comm, layer: Layer, op: OpSpec, inputs: list[Any], params: dict[str, Any],
        buffers: dict[str, Any]):
    out_lay = dec.out_placement(layer)
    if op.name == layer.anchor.name:
        return _run_anchor(dec, comm, layer, op, inputs, params, buffers)
    if op.kind == BATCH_NORM:
        return run_batch_norm(op, inputs, params, buffers, comm,
                              out_lay.split_group([0], comm.rank, comm.world),
                              channels=out_lay.local_bounds(op.out_shape, comm.rank, comm.world)[1],
                              layout=out_lay)
    return call_local(op, inputs, params, buffers,
                      local_out_shape=out_lay.local_shape(op.out_shape, comm.rank, comm.world))


def _run_anchor(dec, comm, layer, op, inputs, params, buffers):
    """Local conv/linear on the shards; when channels are split, the partial sums are
    reduce-scattered over the channel group and the bias is added once, after it."""
    s, pc, pf = dec.grid()
    if pc == 1:                                   # filter: nothing to sum
        return _anchor(op, inputs, params, buffers, keep_bias=True)[0]
    y, bias = _anchor(op, inputs, params, buffers, keep_bias=False)
    ranks = dec.group(comm.rank, "c")
    if dec.rs_along_batch:
        out_lay = dec.out_placement(layer)
        dim = 0
        extents = [out_lay.local_bounds(op.out_shape, q, comm.world)[0][1] for q in ranks]
    else:
        dim = _feature_dim(op)
        extents = [block_extent(int(op.out_shape[dim]), pc, i) for i in range(pc)]
    return _add_bias(reduce_scatter_dim(y, dim, comm, ranks, extents), bias, op)


@runs(RowParallel)
def run_rowparallel(dec, comm, layer: Layer, op: OpSpec, inputs: list[Any], params: dict[str, Any],
        buffers: dict[str, Any]):
    y, bias = _anchor(op, inputs, params, buffers, keep_bias=False)
    first = dec.out_placement(layer).partial_index(comm.rank, comm.world) == 0
    return _add_bias(y, bias if first else None, op)


def _anchor(op: OpSpec, inputs: list[Any], params: dict[str, Any], buffers: dict[str, Any],
            keep_bias: bool):
    """(the anchor's local result, its bias or None): with ``keep_bias`` False the anchor runs
    without its bias, for layers whose partial sums must not each add it."""
    values = dict(zip(op.inputs, inputs))
    args = substitute_cached(op.args, values, params, buffers)
    kwargs = substitute_cached(op.kwargs, values, params, buffers)
    bias = None
    if not keep_bias:
        if len(args) > 2:
            bias, args[2] = args[2], None
        elif "bias" in kwargs:
            bias, kwargs["bias"] = kwargs["bias"], None
    return resolve_target(op.target)(*args, **kwargs), bias


def _add_bias(y, bias, op: OpSpec):
    """``y`` + the bias broadcast along the anchor's feature dim (``y`` when there is none)."""
    if bias is None:
        return y
    shape = [1] * y.dim()
    shape[_feature_dim(op)] = -1
    return y + bias.reshape(shape)
