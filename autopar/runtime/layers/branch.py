"""Run-time halves of ``branch`` and ``head_groups`` (``autopar.decomp.branch``): a branch's ops
on its group only (zeros elsewhere: the partial-sum form), joins after ``boundary.branch_sum``
of their partial inputs."""

from __future__ import annotations

import torch

from ...decomp.base import runs
from ...decomp.branch import PARTIAL, SHARED, Branch, _local_shape, analysis
from ...decomp.branch.heads import P, HeadGroups
from ...decomp.branch.heads import _local_shape as _heads_local_shape
from ..ops import call_local
from .boundary import branch_sum


@runs(Branch)
def run_branch(dec, comm, layer, op, inputs, params, buffers):
    """Shared ops on every rank; a branch's ops on its group only (zeros elsewhere: the
    partial-sum form); joins local, or after ``branch_sum`` of their partial inputs."""
    an = analysis(layer)
    rank, world = comm.rank, comm.world
    mine = dec.group_of_rank(rank)
    out_shape = _local_shape(dec._value_layout(an, op.name), tuple(op.out_shape), rank, world)
    role = an.role[op.name]
    if role == "branch" and dec.group_of_branch(layer, an.branch_of[op.name]) != mine:
        ref = next((t for t in inputs if t.is_floating_point()), None)
        dtype = ref.dtype if ref is not None else torch.float32
        # a leaf that takes part in autograd: a collective after it (the transition that
        # sums a partial output, a reduce join) must run its backward on every rank
        return torch.zeros(out_shape, dtype=dtype, device=comm.device,
                           requires_grad=dtype.is_floating_point and torch.is_grad_enabled())
    if role == "join":
        xs = list(inputs)
        if an.join_mode[op.name] == "gather":     # my group's branches' slices, in order
            mine_xs = [x for v, x in zip(op.inputs, xs)
                       if dec.group_of_branch(layer, an.branch_of[v]) == mine]
            return torch.cat(mine_xs, dim=an.split_dim[op.name])
        if an.join_mode[op.name] == "reduce":
            grp = dec.branch_group(rank)
            xs = [branch_sum(x, comm, grp) if an.state.get(v) == PARTIAL else x
                  for v, x in zip(op.inputs, xs)]
        elif op.target in _ZERO_SHARED and mine != 0:
            xs = [torch.zeros_like(x) if an.state.get(v, SHARED) == SHARED else x
                  for v, x in zip(op.inputs, xs)]
        inputs = xs
    return call_local(op, inputs, params, buffers, local_out_shape=out_shape)


@runs(HeadGroups)
def run_headgroups(dec, comm, layer, op, inputs, params, buffers):
    """One op on this rank's blocks (module docstring: modes)."""
    hp = dec._plan(layer)
    rank, world = comm.rank, comm.world
    mode = hp.mode[op.name]
    g = dec.group_of_rank(rank)
    out_shape = _heads_local_shape(dec.value_layout(hp.state.get(op.name)), tuple(op.out_shape), rank, world)
    xs = list(inputs)
    if mode == "row" and g != 0 and "bias" in op.param_names:
        q = op.param_names["bias"]
        params = {**params, q: torch.zeros_like(params[q]).detach()}
    elif mode == "sum" and g != 0:
        xs = [torch.zeros_like(x) if hp.state.get(v) is None else x for v, x in zip(op.inputs, xs)]
    elif mode == "reduce":
        grp = dec.branch_group(rank)
        xs = [branch_sum(x, comm, grp) if hp.state.get(v) == P else x for v, x in zip(op.inputs, xs)]
    return call_local(op, xs, params, buffers, local_out_shape=out_shape)


_ZERO_SHARED = ("aten.add.Tensor", "aten.sub.Tensor", "aten.cat.default", "aten.stack.default")
