"""Spatial decomposition, run-time half: differentiable halo exchange for activations split over
spatial dims (Dryden et al., IPDPS 2019). Imported only by the runtime (``runtime.layers.spatial``).

Legend: x_NC* is a local block (N, C, *spatial) of a tensor whose layout (``Sharding``) splits dim 0
(samples) and any subset of the spatial dims 2.. (D/H/W) over a process grid; "dim" is a tensor
dim, "axis" a mesh axis. Blocks follow the ``tensor_split`` rule, so uneven extents are handled.

What a sliding-window op (convolution, pooling) needs
-----------------------------------------------------
Along one spatial dim of global input extent ``n``, with left padding ``pad_lo``, stride ``s`` and
effective kernel extent ``k_eff = dilation * (K - 1) + 1``, output index ``o`` reads the input
window ``[o*s - pad_lo, o*s - pad_lo + k_eff)``. The rank holding output block ``[O0, O0 + On)``
(the *output* layout's block: same splits, applied to the output shape) therefore needs the
input window::

    [a, b) = [O0*s - pad_lo,  (O0 + On - 1)*s - pad_lo + k_eff)

It builds that window, in order, from: fill values where ``a < 0`` (the op's padding), the part
held by the lower neighbour, the part of its own block, the part held by the upper neighbour,
fill values where ``b > n``; then the op runs with padding 0 along that dim and produces exactly
its output block. Parts of its own block outside ``[a, b)`` are trimmed. Because the window is
derived from the output block, **stride > 1 needs no alignment of block starts with the
stride**: the correct offset is computed for every block (``window_bounds``), and even kernels
(no symmetric halo) work the same way.

Legality (``axis_problem``, checked for every block of every split dim, at plan time by
``autopar.decomp.spatial`` and again here): every block holds >= 1 element of the input and of
the output, and each window reaches at most the *immediate* neighbours, i.e. the halo depth
needed on each side is <= the extent of the neighbour on that side::

    I0(c) - max(a(c), 0)         <= In(c-1)      (lower side; I0, In: input block start, extent)
    min(b(c), n) - (I0(c)+In(c)) <= In(c+1)      (upper side)

Anything else is allowed: odd and even kernels, any stride (no alignment of block starts with
the stride is required; a block may trim part of its own block or take its whole window from a
neighbour), any dilation, symmetric or asymmetric padding (string "same"), any remainders.
Dims that are not split run with the op's own padding unless it is asymmetric (then they get an
explicit window too). The fill value is 0 for convolution and average pooling (zero padding),
-inf for max pooling (torch's implicit padding never wins a max; torch guarantees every window
holds a real element); fill positions get no gradient.

Halo widths and the placement
-----------------------------
The layer's input placement states the halo (``HaloShard(d, lo, hi)``, ``Spatial.window_placement``):
the widest halo any block reads on each side. The exchange does not read its widths from it:
with uneven blocks or a stride, blocks read different widths (and may trim their own block), so
the geometry (``decomp.spatial.geometry.plan_halo``) stays the single source of every block's
window and checks that no block reads more than the placement states (``HaloIllegal``).

Corners and edges
-----------------
Split dims are exchanged one after the other (``plan_halo`` orders them by dim); a later step
sends slices that include the halos received in earlier steps. Neighbours along a later dim share
the block coordinate along every earlier dim, hence the same earlier windows, so edge and corner
regions arrive from the diagonal neighbours in two (2-D) or three (3-D) hops, with 2 messages
per split dim instead of 8 or 26.

Backward
--------
Each step is an autograd Function whose backward is the exact adjoint of its forward: the
gradient of the received parts is sent back to the neighbour that sent them and ACCUMULATED into
the boundary of its block; gradients of fill values are dropped; the own part is copied. The
steps' backwards run in reverse order, so corner gradients travel back through both hops.

Communication: ``torch.distributed.batch_isend_irecv`` on the default group; neighbours are
mesh-local ranks from ``Sharding.rank_of`` (derived from mesh coordinates, never by hand), mapped
to global ranks by the layer's ``Comm`` (so a plan runs unchanged on a sub-mesh); ranks
with nothing to exchange in a step issue nothing. Tested with gloo; with NCCL the first
``batch_isend_irecv`` of a group must involve every rank of the group, so run one collective on
the default group before the first exchange (untested here: no GPU). There is no overlap of
interior compute with the exchange: the op waits for the whole window, and the cost model
(``autopar.decomp.spatial``) prices exchange + compute sequentially.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ...decomp.spatial.geometry import HaloPlan, HaloStep


def _p2p(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
         comm) -> None:
    """Point-to-point with mesh-local peers, sent on the default group by their global ranks."""
    g = comm.global_rank
    ops = [dist.P2POp(dist.isend, t.contiguous(), g(p)) for p, t in sends]
    ops += [dist.P2POp(dist.irecv, t, g(p)) for p, t in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _with_extent(shape: Sequence[int], dim: int, n: int) -> list[int]:
    s = list(shape)
    s[dim] = n
    return s


class _HaloStepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, st: HaloStep, fill: float, comm):
        ctx.st, ctx.in_shape, ctx.comm = st, tuple(x.shape), comm
        d = st.dim
        recv_lo = x.new_empty(_with_extent(x.shape, d, st.lo_len)) if st.lo_len else None
        recv_hi = x.new_empty(_with_extent(x.shape, d, st.hi_len)) if st.hi_len else None
        _p2p([(p, x.narrow(d, s, n)) for p, s, n in st.sends],
             [(p, t) for p, t in ((st.lo_peer, recv_lo), (st.hi_peer, recv_hi)) if t is not None],
             comm)
        pieces = []
        if st.z_lo:
            pieces.append(x.new_full(_with_extent(x.shape, d, st.z_lo), fill))
        if recv_lo is not None:
            pieces.append(recv_lo)
        if st.own_len:
            pieces.append(x.narrow(d, st.own_start, st.own_len))
        if recv_hi is not None:
            pieces.append(recv_hi)
        if st.z_hi:
            pieces.append(x.new_full(_with_extent(x.shape, d, st.z_hi), fill))
        return torch.cat(pieces, dim=d)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        st = ctx.st
        d = st.dim
        off_lo = st.z_lo
        off_own = off_lo + st.lo_len
        off_hi = off_own + st.own_len
        back = []
        if st.lo_len:
            back.append((st.lo_peer, dy.narrow(d, off_lo, st.lo_len)))
        if st.hi_len:
            back.append((st.hi_peer, dy.narrow(d, off_hi, st.hi_len)))
        got = [(p, s, dy.new_empty(_with_extent(dy.shape, d, n))) for p, s, n in st.sends]
        _p2p(back, [(p, t) for p, _, t in got], ctx.comm)
        dx = dy.new_zeros(ctx.in_shape)
        if st.own_len:
            dx.narrow(d, st.own_start, st.own_len).add_(dy.narrow(d, off_own, st.own_len))
        for _, s, t in got:       # accumulate neighbours' halo gradients into the boundary
            dx.narrow(d, s, t.shape[d]).add_(t)
        return dx, None, None, None


def halo_exchange(x: torch.Tensor, plan: HaloPlan, fill: float, comm) -> torch.Tensor:
    """Local block -> local input window (differentiable; see the module docstring). Peers in
    ``plan`` are ranks of ``comm``'s mesh (``Comm.global_rank`` maps them)."""
    if tuple(x.shape) != plan.in_shape:
        raise ValueError(f"halo_exchange: local block has shape {tuple(x.shape)}, the plan expects "
                         f"{plan.in_shape}")
    for st in plan.steps:
        x = _HaloStepFn.apply(x, st, fill, comm)
    return x
