"""Run-time halves of ``sample`` and ``replicate`` (``autopar.decomp.sample``,
``autopar.decomp.replicate``): every op on this rank's samples, or whole; batch norm with the
statistics of its data group."""

from __future__ import annotations

from ...decomp.base import runs
from ...decomp.ir import BATCH_NORM
from ...decomp.sharding import Sharding
from ...decomp.replicate import Replicate
from ...decomp.sample import Sample, _layout, _local_shape
from ..ops import call_local, run_batch_norm


@runs(Sample)
def run_sample(dec, comm, layer, op, inputs, params, buffers):
    lay = _layout(dec.parts)
    if op.kind == BATCH_NORM:
        return run_batch_norm(op, inputs, params, buffers, comm,
                              lay.data_group(comm.rank, comm.world), layout=lay)
    return call_local(op, inputs, params, buffers,
                      local_out_shape=_local_shape(dec.parts, tuple(op.out_shape), comm.rank, comm.world))


@runs(Replicate)
def run_replicate(dec, comm, layer, op, inputs, params, buffers):
    if op.kind == BATCH_NORM:   # local statistics: per group of the whole batch, on this rank
        return run_batch_norm(op, inputs, params, buffers, comm, [comm.rank], layout=Sharding())
    return call_local(op, inputs, params, buffers)
