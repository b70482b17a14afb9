"""Differentiable halo exchange for activations split over spatial dims (Dryden et al., IPDPS 2019).

Legend: x_NC* is a local block (N, C, *spatial) of a tensor whose layout (``Layout``) splits dim 0
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

Communication: ``torch.distributed.batch_isend_irecv`` on the default group with global ranks
from ``Layout.rank_of`` (neighbours are derived from mesh coordinates, never by hand); ranks
with nothing to exchange in a step issue nothing. Tested with gloo; with NCCL the first
``batch_isend_irecv`` of a group must involve every rank of the group, so run one collective on
the default group before the first exchange (untested here: no GPU). There is no overlap of
interior compute with the exchange: the op waits for the whole window, and the cost model
(``autopar.decomp.spatial``) prices exchange + compute sequentially.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch
import torch.distributed as dist

from ..decomp.layout import Layout, block_extent, block_start

SPATIAL_NAMES = {1: ("W",), 2: ("H", "W"), 3: ("D", "H", "W")}


def dim_name(dim: int, ndim: int) -> str:
    """'D'/'H'/'W' for a spatial tensor dim of an ``ndim``-d tensor, 'N'/'C' for 0/1."""
    if dim < 2:
        return "NC"[dim]
    names = SPATIAL_NAMES.get(ndim - 2)
    return names[dim - 2] if names else f"d{dim}"


@dataclass(frozen=True)
class WindowGeom:
    """Sliding-window geometry along one spatial dim (global input extent -> output extent)."""

    n_in: int
    n_out: int
    pad_lo: int
    stride: int
    k_eff: int          # dilation * (kernel - 1) + 1


def window_bounds(g: WindowGeom, parts: int, c: int) -> tuple[int, int]:
    """Global input window ``[a, b)`` that output block ``c`` of ``parts`` reads (may exceed
    ``[0, n_in)``: those positions are the op's padding)."""
    o0 = block_start(g.n_out, parts, c)
    on = block_extent(g.n_out, parts, c)
    a = o0 * g.stride - g.pad_lo
    return a, (o0 + on - 1) * g.stride - g.pad_lo + g.k_eff


def axis_problem(g: WindowGeom, parts: int, name: str = "") -> str | None:
    """None if a window op along a dim split in ``parts`` can run with neighbour halos; else why.

    Rules (module docstring): every input and output block >= 1 element; each window's real part
    ``[max(a,0), min(b,n))`` lies within the blocks c-1, c, c+1.
    """
    if g.n_in < parts:
        return f"local {name} extent 0 (input extent {g.n_in} < {parts} parts)"
    if g.n_out < parts:
        return f"local {name} output extent 0 (output extent {g.n_out} < {parts} parts)"
    for c in range(parts):
        a, b = window_bounds(g, parts, c)
        i0, i_n = block_start(g.n_in, parts, c), block_extent(g.n_in, parts, c)
        lo_need = i0 - max(a, 0)
        if c > 0 and lo_need > 0:
            have = block_extent(g.n_in, parts, c - 1)
            if lo_need > have:
                return f"local {name} extent {have} < halo radius {lo_need} at {parts} parts"
        hi_need = min(b, g.n_in) - (i0 + i_n)
        if c + 1 < parts and hi_need > 0:
            have = block_extent(g.n_in, parts, c + 1)
            if hi_need > have:
                return f"local {name} extent {have} < halo radius {hi_need} at {parts} parts"
    return None


@dataclass(frozen=True)
class HaloStep:
    """One dim of the exchange, for one rank. Window along ``dim`` = concatenation of
    ``z_lo`` fills, ``lo_len`` from ``lo_peer``, own ``[own_start, own_start+own_len)``,
    ``hi_len`` from ``hi_peer``, ``z_hi`` fills. ``sends``: (peer, start, length) slices of the
    own block (local coordinates along ``dim``) that neighbours' windows need."""

    dim: int
    z_lo: int
    lo_peer: int
    lo_len: int
    own_start: int
    own_len: int
    hi_peer: int
    hi_len: int
    z_hi: int
    sends: tuple[tuple[int, int, int], ...]
    in_extent: int

    @property
    def out_extent(self) -> int:
        return self.z_lo + self.lo_len + self.own_len + self.hi_len + self.z_hi

    @property
    def trivial(self) -> bool:
        return (self.out_extent == self.in_extent and self.own_start == 0
                and not self.sends and not self.lo_len and not self.hi_len)


@dataclass(frozen=True)
class HaloPlan:
    """Every step of one rank's exchange, and the shapes before and after."""

    steps: tuple[HaloStep, ...]
    in_shape: tuple[int, ...]        # local block
    window_shape: tuple[int, ...]    # local window

    def step_shapes(self) -> list[tuple[int, ...]]:
        """Shape of the tensor entering each step (earlier dims already widened)."""
        shape = list(self.in_shape)
        out = []
        for st in self.steps:
            out.append(tuple(shape))
            shape[st.dim] = st.out_extent
        return out

    def message_elems(self) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
        """Per step: ([(peer, elements sent)], [(peer, elements received)])."""
        res = []
        for st, shape in zip(self.steps, self.step_shapes()):
            cross = 1
            for d, e in enumerate(shape):
                if d != st.dim:
                    cross *= e
            sent = [(p, ln * cross) for p, _, ln in st.sends]
            recv = [(p, ln * cross) for p, ln in ((st.lo_peer, st.lo_len), (st.hi_peer, st.hi_len)) if ln]
            res.append((sent, recv))
        return res


def axis_pieces(g: WindowGeom, parts: int, c: int):
    """The window of block ``c`` along one dim, as ``(z_lo, lo_len, own_start, own_len, hi_len,
    z_hi, sends)``: fills below 0, elements from block c-1, own slice (local start, length),
    elements from block c+1, fills beyond ``n_in``; ``sends`` = (block q, local start, length)
    of the own block that neighbour q's window needs. Assumes ``axis_problem`` found nothing."""
    n = g.n_in
    i0, i_n = block_start(n, parts, c), block_extent(n, parts, c)
    a, b = window_bounds(g, parts, c)
    ra, rb = max(a, 0), min(b, n)            # real (non-padding) part of the window
    z_lo = max(0, min(b, 0) - a)
    z_hi = max(0, b - max(a, n))
    own_lo, own_hi = max(ra, i0), min(rb, i0 + i_n)
    own_len = max(0, own_hi - own_lo)
    lo_len = max(0, min(rb, i0) - ra)
    hi_len = max(0, rb - max(ra, i0 + i_n))
    sends = []
    for q in (c - 1, c + 1):
        if 0 <= q < parts:
            qa, qb = window_bounds(g, parts, q)
            lo, hi = max(qa, 0, i0), min(qb, n, i0 + i_n)
            if hi > lo:
                sends.append((q, lo - i0, hi - lo))
    assert z_lo + lo_len + own_len + hi_len + z_hi == b - a, (g, parts, c)
    return z_lo, lo_len, (own_lo - i0) if own_len else 0, own_len, hi_len, z_hi, tuple(sends)


class HaloIllegal(ValueError):
    """The split cannot serve this window op with nearest-neighbour halos (message says why)."""


@lru_cache(maxsize=4096)
def plan_halo(in_shape: tuple[int, ...], layout: Layout, geoms: tuple[tuple[int, WindowGeom], ...],
              rank: int, world: int) -> HaloPlan:
    """The exchange that turns ``rank``'s block of a tensor of global ``in_shape`` (layout
    ``layout``) into the input window of its output block (the output tensor has the same
    layout; its extents are in the geometries).

    ``geoms``: (tensor dim, geometry) for every dim handled explicitly (split dims, and any dim
    whose padding the op cannot apply itself); other dims are left to the op. Pure arithmetic:
    raises HaloIllegal on every rank alike when any block of any dim breaks the rules.
    """
    cs, rep = layout.coords(rank, world)
    axis_of = {d: i for i, (d, _) in enumerate(layout.splits)}
    local = list(layout.local_shape(in_shape, rank, world))
    steps = []
    for dim, g in sorted(geoms, key=lambda t: t[0]):
        parts = layout.parts_of(dim)
        why = axis_problem(g, parts, dim_name(dim, len(in_shape)))
        if why:
            raise HaloIllegal(why)
        axis = axis_of.get(dim)
        c = cs[axis] if axis is not None else 0

        def peer(cc: int) -> int:
            coords = list(cs)
            coords[axis] = cc
            return layout.rank_of(coords, rep, world)

        z_lo, lo_len, own_start, own_len, hi_len, z_hi, sends1 = axis_pieces(g, parts, c)
        sends = tuple((peer(q), s, ln) for q, s, ln in sends1)
        step = HaloStep(dim=dim, z_lo=z_lo, lo_peer=peer(c - 1) if lo_len else -1, lo_len=lo_len,
                        own_start=own_start, own_len=own_len,
                        hi_peer=peer(c + 1) if hi_len else -1, hi_len=hi_len, z_hi=z_hi,
                        sends=sends, in_extent=block_extent(g.n_in, parts, c))
        steps.append(step)
    in_local = tuple(local)
    for st in steps:
        local[st.dim] = st.out_extent
    return HaloPlan(steps=tuple(s for s in steps if not s.trivial), in_shape=in_local,
                    window_shape=tuple(local))


def _p2p(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
    ops = [dist.P2POp(dist.isend, t.contiguous(), p) for p, t in sends]
    ops += [dist.P2POp(dist.irecv, t, p) for p, t in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _with_extent(shape: Sequence[int], dim: int, n: int) -> list[int]:
    s = list(shape)
    s[dim] = n
    return s


class _HaloStepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, st: HaloStep, fill: float):
        ctx.st, ctx.in_shape = st, tuple(x.shape)
        d = st.dim
        recv_lo = x.new_empty(_with_extent(x.shape, d, st.lo_len)) if st.lo_len else None
        recv_hi = x.new_empty(_with_extent(x.shape, d, st.hi_len)) if st.hi_len else None
        _p2p([(p, x.narrow(d, s, n)) for p, s, n in st.sends],
             [(p, t) for p, t in ((st.lo_peer, recv_lo), (st.hi_peer, recv_hi)) if t is not None])
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
        _p2p(back, [(p, t) for p, _, t in got])
        dx = dy.new_zeros(ctx.in_shape)
        if st.own_len:
            dx.narrow(d, st.own_start, st.own_len).add_(dy.narrow(d, off_own, st.own_len))
        for _, s, t in got:       # accumulate neighbours' halo gradients into the boundary
            dx.narrow(d, s, t.shape[d]).add_(t)
        return dx, None, None


def halo_exchange(x: torch.Tensor, plan: HaloPlan, fill: float = 0.0) -> torch.Tensor:
    """Local block -> local input window (differentiable; see the module docstring)."""
    if tuple(x.shape) != plan.in_shape:
        raise ValueError(f"halo_exchange: local block has shape {tuple(x.shape)}, the plan expects "
                         f"{plan.in_shape}")
    for st in plan.steps:
        x = _HaloStepFn.apply(x, st, fill)
    return x
