"""Spatial decomposition, geometry: halo windows of sliding-window ops on spatially split
tensors. Pure arithmetic, no torch.

Plan-time legality (``axis_problem``, asked by ``autopar.decomp.spatial``), the halo widths a
split window op states on its input placement (``halo_widths``: ``HaloShard(d, lo, hi)``) and
the per-rank exchange plan (``plan_halo``) that the run-time half (``.exchange``) executes.

The geometry is the single source of each block's window: a ``HaloShard`` states the widest
halo of any block on each side, not every block's (uneven blocks and strides make them differ,
and a window may trim its own block), so the exchange cannot be read from the placement
exactly; ``plan_halo`` instead checks that no block reads more than the placement states. The rules, the
window arithmetic and the corner scheme are written out in ``.exchange``'s docstring; ranks in
a ``HaloPlan`` are ranks of the layer's mesh (mesh-local), which the runtime maps to
process-group ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from ..sharding import Sharding, block_extent, block_start, dim_name


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


@lru_cache(maxsize=4096)
def halo_widths(g: WindowGeom, parts: int) -> tuple[int, int]:
    """(lo, hi): the most elements any block's window takes from its lower / upper neighbour
    along a dim split in ``parts`` (``axis_pieces``: max over blocks c of lo_len(c), hi_len(c));
    (0, 0) when the dim is not split. What ``HaloShard(d, lo, hi)`` states."""
    if parts <= 1:
        return 0, 0
    lo = hi = 0
    for c in range(parts):
        _, lo_len, _, _, hi_len, _, _ = axis_pieces(g, parts, c)
        lo, hi = max(lo, lo_len), max(hi, hi_len)
    return lo, hi


class HaloIllegal(ValueError):
    """The split cannot serve this window op with nearest-neighbour halos (message says why)."""


@lru_cache(maxsize=4096)
def plan_halo(in_shape: tuple[int, ...], layout: Sharding, geoms: tuple[tuple[int, WindowGeom], ...],
              rank: int, world: int) -> HaloPlan:
    """The exchange that turns ``rank``'s block of a tensor of global ``in_shape`` (layout
    ``layout``: the sharding the op reads its input in, ``HaloShard`` on the split dims whose
    windows reach a neighbour, ``Spatial.window_placement``) into the input window of its output
    block (the output tensor has the same owned blocks; its extents are in the geometries).
    Raises HaloIllegal if a block reads more of a neighbour than ``layout``'s halo states.

    ``geoms``: (tensor dim, geometry) for every dim handled explicitly (split dims, and any dim
    whose padding the op cannot apply itself); other dims are left to the op. Pure arithmetic:
    raises HaloIllegal on every rank alike when any block of any dim breaks the rules.
    """
    cs, rep = layout.coords(rank, world)
    axis_of = {d: i for i, d in enumerate(layout.shard_dims)}
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
        h_lo, h_hi = layout.halo(dim)
        if lo_len > h_lo or hi_len > h_hi:
            raise HaloIllegal(f"block {c} of {parts} along {dim_name(dim, len(in_shape))} reads "
                              f"{lo_len} below / {hi_len} above its block, but its placement "
                              f"{layout} states a halo of {h_lo} / {h_hi}")
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
