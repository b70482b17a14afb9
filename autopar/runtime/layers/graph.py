"""Run-time half of the graph decompositions ``edges`` and ``nodes`` (``autopar.decomp.graph``):
every op on this rank's block of edges or nodes; a scatter-add's own input added by partial
index 0 only; ``expand`` / ``new_tensor`` to the local extent. (``graphs`` runs natively:
``autopar.runtime.native``.)"""

from __future__ import annotations

from typing import Any

from ...decomp.base import runs
from ...decomp.graph.common import ItemSplit, _act
from ...decomp.ir import Layer, OpSpec
from ..ops import call_local, resolve_target, substitute_cached


@runs(ItemSplit)
def run_itemsplit(dec, comm, layer: Layer, op: OpSpec, inputs: list[Any], params: dict[str, Any],
        buffers: dict[str, Any]):
    lays = dec.value_layouts(layer)
    out_lay = lays[op.name]
    local_out = out_lay.local_shape(op.out_shape, comm.rank, comm.world)
    if op.kind == "scatter" and out_lay.is_partial:
        # the scatter's own input is added once: by partial index 0
        if out_lay.partial_index(comm.rank, comm.world) != 0:
            base = _act(op.args[0])
            inputs = [x.new_zeros(x.shape) if v == base else x for v, x in zip(op.inputs, inputs)]
    if op.kind in ("expand", "new_tensor") and local_out != tuple(op.out_shape):
        values = dict(zip(op.inputs, inputs))
        args = substitute_cached(op.args, values, params, buffers)
        kwargs = substitute_cached(op.kwargs, values, params, buffers)
        args[1] = [lo if int(s) == int(g) else s for s, g, lo in zip(args[1], op.out_shape, local_out)]
        return resolve_target(op.target)(*args, **kwargs)
    return call_local(op, inputs, params, buffers, local_out_shape=local_out)
