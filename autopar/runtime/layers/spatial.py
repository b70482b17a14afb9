"""Run-time half of ``spatial`` (``autopar.decomp.spatial``): convolutions and pools on the
halo-extended local block (``halo.halo_exchange``), batch norm over the spatial group, global
means as an all-reduced sum, everything else local."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ...decomp.base import runs
from ...decomp.ir import ADAPTIVE_POOL, BATCH_NORM, CONV, MEAN, POOL, Layer, OpSpec
from ...decomp.sharding import block_extent
from ...decomp.spatial import Spatial, _expand, window_params
from ...decomp.spatial.geometry import window_bounds
from ..comm import all_reduce_sum
from ..ops import call_local, run_batch_norm
from .halo import halo_exchange


@runs(Spatial)
def run_spatial(dec, comm, layer: Layer, op: OpSpec, inputs: list[Any], params: dict[str, Any],
        buffers: dict[str, Any]):

    lays = dec.value_layouts(layer)
    full = dec.sharding()
    x_sp = bool(op.inputs) and lays[op.inputs[0]] == full
    if op.kind == CONV:
        x = halo_exchange(inputs[0], dec.plan(op, comm.rank, comm.world), 0.0, comm)
        w = params[op.param_names["weight"]]
        b = params[op.param_names["bias"]] if "bias" in op.param_names else None
        a = op.attrs
        conv = (torch.nn.functional.conv1d, torch.nn.functional.conv2d,
                torch.nn.functional.conv3d)[dec.k - 1]
        return conv(x, w, b, _expand(a.get("stride"), dec.k, 1), dec.native_padding(op),
                    _expand(a.get("dilation"), dec.k, 1), int(a.get("groups", 1)))
    if op.kind == POOL:
        return _run_pool(dec, op, inputs[0], comm)
    if op.kind == BATCH_NORM:
        lay = lays[op.inputs[0]]
        return run_batch_norm(op, inputs, params, buffers, comm,
                              lay.data_group(comm.rank, comm.world), layout=lay)
    if op.kind in (ADAPTIVE_POOL, MEAN) and x_sp:
        keep = True if op.kind == ADAPTIVE_POOL else bool(op.attrs.get("keepdim", False))
        dims = dec.spatial_dims
        s = inputs[0].sum(dim=dims, keepdim=keep)
        s = all_reduce_sum(s, comm, full.split_group(dims, comm.rank, comm.world))
        return s / float(math.prod(int(op.in_shapes[0][d]) for d in dims))
    return call_local(op, inputs, params, buffers)


def _run_pool(dec, op: OpSpec, x, comm):
    """Pool on the explicit window (padding 0, no ceil): max with -inf fill; average as
    window sum / count, where count = the positions torch counts (inside [-pad, n + pad)
    with count_include_pad, inside [0, n) without; the constant override if given)."""
    a = op.attrs
    k = dec.k
    plan = dec.plan(op, comm.rank, comm.world)
    params = window_params(op, k)
    ks = _expand(a.get("kernel"), k, 1)
    stride = [s for _, _, s, _ in params]
    if a.get("pool") == "max":
        xw = halo_exchange(x, plan, float("-inf"), comm)
        mp = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[k - 1]
        return mp(xw, ks, stride, 0, _expand(a.get("dilation"), k, 1), False)
    xw = halo_exchange(x, plan, 0.0, comm)
    if k == 1:
        s = F.avg_pool2d(xw.unsqueeze(2), [1] + ks, [1] + stride, 0, False, True, 1).squeeze(2)
    else:
        ap = (None, F.avg_pool2d, F.avg_pool3d)[k - 1]
        s = ap(xw, ks, stride, 0, False, True, 1)
    if a.get("divisor_override"):
        return s / float(a["divisor_override"])
    return s / _pool_counts(dec, op, comm.rank, comm.world).to(dtype=s.dtype, device=s.device)


def _pool_counts(dec: Spatial, op: OpSpec, rank: int, world: int):
    """Tensor (1, 1, *local out) of the divisors of an average pool for ``rank``'s block."""
    full = dec.sharding()
    cs, _ = full.coords(rank, world)
    axis_of = {d: i for i, d in enumerate(full.shard_dims)}
    include = bool(op.attrs.get("count_include_pad", True))
    per_dim = []
    for (d, g), (lo, hi, s, k_eff) in zip(dec.window_geoms(op), window_params(op, dec.k)):
        p = full.parts_of(d)
        c = cs[axis_of[d]] if d in axis_of else 0
        a, _ = window_bounds(g, p, c)
        on = block_extent(g.n_out, p, c)
        lim_lo, lim_hi = (-lo, g.n_in + hi) if include else (0, g.n_in)
        cnt = [max(0, min(a + o * s + k_eff, lim_hi) - max(a + o * s, lim_lo)) for o in range(on)]
        per_dim.append(torch.tensor(cnt, dtype=torch.float64))
    grid = per_dim[0]
    for v in per_dim[1:]:
        grid = grid.unsqueeze(-1) * v
    return grid.reshape((1, 1) + tuple(grid.shape))
