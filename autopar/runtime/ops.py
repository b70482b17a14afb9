"""Local execution of one traced op, and batch normalisation with statistics over a group.

``call_local`` runs an op exactly as traced, on local tensors, after substituting references
(``{"v"}``, ``{"p"}``, ``{"b"}``) and, for ops whose arguments name sizes (view/reshape), the
local extents. Decompositions use it for every op whose mathematics is unchanged by their split
(e.g. any elementwise op, or a convolution under sample parallelism).

``run_batch_norm`` is the one batch-norm runtime; it computes the plan's statistics
(``autopar.decomp.bn``), which the running ``DistModel`` states through ``batch_norm_stats``:

* global: ``sync_batch_norm`` over every rank of ``ranks`` (per-rank mean and centred sum of
  squares, combined exactly), so that a batch norm over split samples or split spatial extents
  computes the single-process function;
* local: ``_GroupBatchNorm`` per group of G consecutive samples of this rank's block, combined
  only over the ranks holding other spatial blocks of the same samples; the running statistics'
  update (mean over all groups of the batch) is deferred to ``BatchNormRuntime.flush``, one
  all-reduce over the mesh per step, so every rank holds the same values.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .comm import Comm
from ..decomp.sharding import Sharding


@functools.lru_cache(maxsize=None)
def resolve_target(target: str):
    """'aten.conv2d.default' -> torch.ops.aten.conv2d.default (only torch.ops namespaces)."""
    parts = target.split(".")
    if len(parts) < 2 or parts[0] not in ("aten", "prims"):
        raise ValueError(f"unsupported op target {target!r}")
    obj = getattr(torch.ops, parts[0])
    for p in parts[1:]:
        obj = getattr(obj, p)
    return obj


def substitute(template: Any, values: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
               buffers: dict[str, torch.Tensor]) -> Any:
    """An op's argument template with its references filled in: ``{"v": name}`` a value,
    ``{"p": name}`` a parameter, ``{"b": name}`` a buffer, ``{"dtype": name}`` a torch dtype,
    ``{"float": "-inf"}`` a float JSON cannot hold; lists and other dicts recursively."""
    return _builder(template)(values, params, buffers)


def _builder(template: Any):
    """A function ``(values, params, buffers) -> substitute(template, ...)`` built once per
    template: the per-op dispatch of the traced path walks the template once, not every step."""
    if isinstance(template, dict):
        if len(template) == 1:
            (k, v), = template.items()
            if k == "v":
                return lambda V, P, B: V[v]
            if k == "p":
                return lambda V, P, B: P[v]
            if k == "b":
                return lambda V, P, B: B[v]
            if k == "dtype":
                d = getattr(torch, v)
                return lambda V, P, B: d
            if k == "float":
                f = float(v)                           # inf/nan, which JSON cannot hold
                return lambda V, P, B: f
        items = [(k, _builder(v)) for k, v in template.items()]
        return lambda V, P, B: {k: f(V, P, B) for k, f in items}
    if isinstance(template, list):
        fs = [_builder(v) for v in template]
        return lambda V, P, B: [f(V, P, B) for f in fs]
    return lambda V, P, B: template


_BUILDERS: dict[int, tuple[Any, Any]] = {}


def substitute_cached(template: Any, values: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
                      buffers: dict[str, torch.Tensor]) -> Any:
    """``substitute`` through a builder cached per template object (an op's ``args`` or
    ``kwargs``, which live as long as their OpSpec; the entry keeps the template alive, so its
    id is not reused)."""
    hit = _BUILDERS.get(id(template))
    if hit is None or hit[0] is not template:
        if len(_BUILDERS) > 100_000:
            _BUILDERS.clear()
        hit = _BUILDERS[id(template)] = (template, _builder(template))
    return hit[1](values, params, buffers)


def local_sizes(sizes: Sequence[int], global_out: Sequence[int], local_out: Sequence[int]) -> list[int]:
    """Rewrite a view/reshape size list for the local block (dims whose extent changed)."""
    sizes = list(sizes)
    if len(sizes) == len(global_out):
        return [int(l) if (s == g or s == -1) else s for s, g, l in zip(sizes, global_out, local_out)]
    return sizes


def call_local(op: Any, inputs: Sequence[torch.Tensor], params: dict[str, torch.Tensor],
               buffers: dict[str, torch.Tensor], local_out_shape: Sequence[int] | None = None) -> torch.Tensor:
    """Run ``op`` (an OpSpec) unchanged on local tensors."""
    values = dict(zip(op.inputs, inputs))
    args = substitute_cached(op.args, values, params, buffers)
    kwargs = substitute_cached(op.kwargs, values, params, buffers)
    if op.kind in ("view", "expand") and local_out_shape is not None and len(args) >= 2 \
            and isinstance(args[1], list):
        args[1] = local_sizes(args[1], op.out_shape, local_out_shape)
    return resolve_target(op.target)(*args, **kwargs)


class _SyncBatchNorm(torch.autograd.Function):
    """Batch norm over a group: one all-gather forward, one all-reduce backward.

    forward:  each rank shares (n_r, mean_r, M2_r) per channel (one all-reduce of a table) (M2_r = sum (x - mean_r)^2);
              every rank combines them (Chan et al.): N = sum n_r, mean = sum n_r mean_r / N,
              M2 = sum M2_r + n_r (mean_r - mean)^2, var = M2 / N; y = (x - mean) / sqrt(var +
              eps) * w + b.
    backward: S1 = sum_g sum dy, S2 = sum_g sum dy * xhat (one all-reduce of 2C floats);
              dx = w / sqrt(var + eps) * (dy - S1 / N - xhat * S2 / N); dw, db are the local
              partial sums (the gradient sync adds them over the ranks).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, comm, ranks, running_mean, running_var, momentum):
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        c = x.shape[1]
        n_local = x.numel() // c
        mean_r = x.mean(dims) if n_local else torch.zeros(c, dtype=x.dtype, device=x.device)
        m2_r = ((x - mean_r.reshape(shape)) ** 2).sum(dims)
        mine = torch.cat([torch.full((1,), float(n_local), dtype=x.dtype, device=x.device), mean_r, m2_r])
        # all-gather through an all-reduce of a zero-padded table (one row per rank): the
        # same bytes order of magnitude for 2C+1 floats, and one API on every backend
        g = torch.zeros(len(ranks), mine.numel(), dtype=x.dtype, device=x.device)
        g[list(ranks).index(comm.rank)] = mine
        dist.all_reduce(g, group=comm.group(ranks))
        n_g = g[:, :1]
        n = n_g.sum()
        mean = (n_g * g[:, 1:1 + c]).sum(0) / n
        m2 = (g[:, 1 + c:] + n_g * (g[:, 1:1 + c] - mean) ** 2).sum(0)
        var = m2 / n
        invstd = torch.rsqrt(var + eps)
        xhat = (x - mean.reshape(shape)) * invstd.reshape(shape)
        y = xhat
        if weight is not None:
            y = y * weight.reshape(shape)
        if bias is not None:
            y = y + bias.reshape(shape)
        if running_mean is not None and running_var is not None:
            m = 0.1 if momentum is None else momentum
            nn = float(n)
            running_mean.mul_(1 - m).add_(mean, alpha=m)
            running_var.mul_(1 - m).add_(var * (nn / max(nn - 1.0, 1.0)), alpha=m)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.meta = (comm, ranks, float(n), weight is not None, bias is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        comm, ranks, n, has_w, has_b = ctx.meta
        dims = [0] + list(range(2, dy.dim()))
        shape = [1, -1] + [1] * (dy.dim() - 2)
        s1 = dy.sum(dims)
        s2 = (dy * xhat).sum(dims)
        both = torch.cat([s1, s2])
        dist.all_reduce(both, group=comm.group(ranks))
        c = s1.numel()
        t1, t2 = both[:c], both[c:]
        scale = invstd if weight is None else invstd * weight
        dx = scale.reshape(shape) * (dy - (t1 / n).reshape(shape) - xhat * (t2 / n).reshape(shape))
        return (dx, s2 if has_w else None, s1 if has_b else None, None, None, None, None, None, None)


def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    training: bool, momentum: float, eps: float, comm: Comm,
                    ranks: Sequence[int]) -> torch.Tensor:
    """Batch norm whose statistics cover every rank of ``ranks`` (``_SyncBatchNorm``; the
    per-rank sample counts are gathered with the statistics); the plain local batch norm when
    not training or alone."""
    if not training or len(ranks) <= 1:
        return torch.nn.functional.batch_norm(x, running_mean, running_var, weight, bias,
                                              training, momentum, eps)
    return _SyncBatchNorm.apply(x, weight, bias, eps, comm, tuple(sorted(ranks)),
                                running_mean, running_var, momentum)


def run_batch_norm(op: Any, inputs: Sequence[torch.Tensor], params: dict[str, torch.Tensor],
                   buffers: dict[str, torch.Tensor], comm: Comm, ranks: Sequence[int],
                   channels: tuple[int, int] | None = None, layout: Any = None) -> torch.Tensor:
    """A traced ``aten.batch_norm`` (x, weight, bias, running_mean, running_var, training,
    momentum, eps) on this rank's block: the one batch-norm runtime every decomposition uses.
    Global statistics (the default): over the mesh ranks ``ranks``. Local statistics (inside
    ``batch_norm_stats`` of a local ``BatchNormRuntime``): per group of samples, combined over
    the ranks of ``layout`` (the input's layout; None = whole tensors) holding the other
    spatial blocks of the same samples. ``channels`` = (start, extent) of this rank's channel
    block when the channels are split: the running statistics are updated in that slice."""
    x, w, b, rm, rv, training, momentum, eps = substitute_cached(
        op.args, dict(zip(op.inputs, inputs)), params, buffers)[:8]
    rt = _BN.get()
    if rt is not None and rt.stats.local and training:
        lay = layout if layout is not None else Sharding()
        # the ranks holding other spatial blocks of the same samples (and channels)
        agg = lay.split_group([d for d in lay.shard_dims if d >= 2], comm.rank, comm.world)
        replicas = comm.world // (lay.parts_of(0) * lay.parts_of(1))
        return group_batch_norm(x, w, b, rm, rv, momentum, eps, comm, agg, rt, channels, replicas)
    if channels is not None:
        start, ext = channels
        rm = rm[start:start + ext] if rm is not None else None
        rv = rv[start:start + ext] if rv is not None else None
    return sync_batch_norm(x, w, b, rm, rv, training, momentum, eps, comm, ranks)


# ---- local ("ghost") statistics: per group of G consecutive samples ---------------------------

class BatchNormRuntime:
    """The statistics a running plan computes (``decomp.bn.BatchNormStats``) and, under local
    statistics, the running-statistics updates not yet applied (``record``, ``flush``).

    A step's update of a running statistic is affine, ``r <- (1 - m) r + m S / k`` with ``S``
    the sum over the mesh of every rank's (weighted) group statistics (``record``'s ``sm``,
    ``sv``) and ``k`` the number of groups. The updates of several steps compose to
    ``r <- D r + m A / k`` with ``D = (1 - m)^T`` and ``A = sum_t (1 - m)^(T - t) S_t``, and ``A``
    is a sum over the mesh of the same recursion over each rank's own sums. So each rank only
    accumulates its own ``A`` and ``D`` step by step (no communication), and ``flush`` sums the
    ``A`` over the mesh in ONE all-reduce when something reads the running statistics (the same
    deferral as a native plan's, ``runtime.native``): before it, a blocking all-reduce every step
    cost the traced ResNet-2D 2 ms of a 28 ms step at 2 ranks, unpriced."""

    def __init__(self, stats, batch: int) -> None:
        self.stats = stats
        self.stats_groups = stats.groups(batch) if stats.local else 1
        # per running buffer, in the order first recorded (the same program on every rank):
        # [running_mean, running_var, momentum, A_mean, A_var, D]
        self.acc: dict[int, list] = {}

    @property
    def pending(self) -> bool:
        """Whether updates are recorded and not yet applied."""
        return bool(self.acc)

    def record(self, running_mean, running_var, momentum: float, sm, sv) -> None:
        """One step's update of ``running_mean`` / ``running_var`` with this rank's sums ``sm``,
        ``sv`` (float64, full channel vectors, zero outside this rank's channels)."""
        key = id(running_mean)
        e = self.acc.get(key)
        if e is None:
            self.acc[key] = [running_mean, running_var, momentum, sm.clone(), sv.clone(), 1.0 - momentum]
            return
        if e[2] != momentum:
            raise RuntimeError("a batch norm's momentum changed between steps with updates pending; "
                               "call flush_batch_norm() before changing it")
        e[3].mul_(1.0 - momentum).add_(sm)
        e[4].mul_(1.0 - momentum).add_(sv)
        e[5] *= 1.0 - momentum

    def flush(self, comm: Comm) -> None:
        """Apply the recorded updates: ONE all-reduce over the mesh of every buffer's ``A``, then
        on every rank ``r <- D r + m A / k`` (every rank then holds the same running statistics).
        Collective when anything is recorded (every rank runs the same batch norms)."""
        if not self.acc:
            return
        entries = list(self.acc.values())
        self.acc = {}
        flat = torch.cat([torch.cat([am, av]) for _, _, _, am, av, _ in entries])
        if comm.world > 1:
            dist.all_reduce(flat, group=comm.mesh_group)
        k = self.stats_groups
        off = 0
        with torch.no_grad():
            for rm, rv, m, am, _, d in entries:
                c = am.numel()
                mean, var = flat[off:off + c], flat[off + c:off + 2 * c]
                off += 2 * c
                rm.mul_(d).add_(mean.to(rm.dtype) / k, alpha=m)
                rv.mul_(d).add_(var.to(rv.dtype) / k, alpha=m)


_BN: contextvars.ContextVar[BatchNormRuntime | None] = contextvars.ContextVar("autopar_batch_norm", default=None)


@contextlib.contextmanager
def batch_norm_stats(rt: BatchNormRuntime | None):
    """Within this block ``run_batch_norm`` computes ``rt``'s statistics (None: global)."""
    tok = _BN.set(rt)
    try:
        yield
    finally:
        _BN.reset(tok)


def _group_table(x: torch.Tensor, g: int):
    """x (n, C, *) -> per group of g samples: (count, mean (k, C), M2 (k, C)), k = n / g."""
    k = x.shape[0] // g
    xg = x.reshape((k, g) + tuple(x.shape[1:]))
    dims = [1] + list(range(3, xg.dim()))
    count = float(xg.numel() // (k * x.shape[1])) if k else 0.0
    mean = xg.mean(dims)
    shape = [k, 1, -1] + [1] * (x.dim() - 2)
    m2 = ((xg - mean.reshape(shape)) ** 2).sum(dims)
    return count, mean, m2


class _GroupBatchNorm(torch.autograd.Function):
    """Batch norm per group of ``g`` consecutive local samples, each group's statistics combined
    over ``ranks`` (the ranks holding the other spatial blocks of the same samples; one rank:
    nothing is sent).

    forward:  per group k and channel: (n_r, mean_rk, M2_rk) on each rank, gathered through one
              all-reduce of a zero-padded (|ranks|, k, 2C+1) table and combined (Chan et al.):
              n = sum n_r, mean_k = sum n_r mean_rk / n, M2_k = sum M2_rk + n_r (mean_rk -
              mean_k)^2, var_k = M2_k / n; y = (x - mean_k) / sqrt(var_k + eps) * w + b.
    backward: per group S1_k = sum dy, S2_k = sum dy * xhat (one all-reduce of k x 2C floats
              over ``ranks``); dx = w / sqrt(var_k + eps) * (dy - S1_k / n - xhat S2_k / n);
              dw, db the local sums (the gradient sync adds them over the ranks).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, eps, g, comm, ranks, box):
        c = x.shape[1]
        k = x.shape[0] // g
        n_r, mean_r, m2_r = _group_table(x, g)
        if len(ranks) > 1:
            mine = torch.cat([torch.full((k, 1), n_r, dtype=x.dtype, device=x.device), mean_r, m2_r], 1)
            tab = torch.zeros((len(ranks),) + tuple(mine.shape), dtype=x.dtype, device=x.device)
            tab[list(ranks).index(comm.rank)] = mine
            dist.all_reduce(tab, group=comm.group(ranks))
            n_g = tab[:, :, :1]                                  # (R, k, 1)
            n = n_g.sum(0)                                       # (k, 1)
            mean = (n_g * tab[:, :, 1:1 + c]).sum(0) / n
            m2 = (tab[:, :, 1 + c:] + n_g * (tab[:, :, 1:1 + c] - mean) ** 2).sum(0)
            n = float(n[0, 0]) if k else 0.0
        else:
            n, mean, m2 = n_r, mean_r, m2_r
        var = m2 / n
        invstd = torch.rsqrt(var + eps)
        shape = [k, 1, -1] + [1] * (x.dim() - 2)
        xg = x.reshape((k, g) + tuple(x.shape[1:]))
        xhat = ((xg - mean.reshape(shape)) * invstd.reshape(shape)).reshape(x.shape)
        wshape = [1, -1] + [1] * (x.dim() - 2)
        y = xhat
        if weight is not None:
            y = y * weight.reshape(wshape)
        if bias is not None:
            y = y + bias.reshape(wshape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.meta = (comm, ranks, n, g, weight is not None, bias is not None)
        box.append((mean.detach(), var.detach(), n))   # for the running statistics
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        comm, ranks, n, g, has_w, has_b = ctx.meta
        k = dy.shape[0] // g
        gshape = (k, g) + tuple(dy.shape[1:])
        dims = [1] + list(range(3, dy.dim() + 1))
        dyg, xg = dy.reshape(gshape), xhat.reshape(gshape)
        s1 = dyg.sum(dims)                                       # (k, C)
        s2 = (dyg * xg).sum(dims)
        if len(ranks) > 1:
            both = torch.cat([s1, s2], 1)
            dist.all_reduce(both, group=comm.group(ranks))
            c = s1.shape[1]
            s1, s2 = both[:, :c], both[:, c:]
        shape = [k, 1, -1] + [1] * (dy.dim() - 2)
        scale = invstd if weight is None else invstd * weight
        dx = scale.reshape(shape) * (dyg - (s1 / n).reshape(shape) - xg * (s2 / n).reshape(shape))
        # dw, db: this rank's sums (over its own samples only, before the all-reduce)
        dims_local = [0] + list(range(2, dy.dim()))
        dw = (dy * xhat).sum(dims_local) if has_w else None
        db = dy.sum(dims_local) if has_b else None
        return dx.reshape(dy.shape), dw, db, None, None, None, None, None


def group_batch_norm(x, weight, bias, running_mean, running_var, momentum: float, eps: float,
                     comm: Comm, ranks: Sequence[int], rt: BatchNormRuntime, channels=None,
                     replicas: int = 1):
    """Training batch norm with local statistics (``_GroupBatchNorm``); the running statistics'
    contribution of this rank's groups (sum over its groups of the group mean and unbiased
    variance), divided by ``replicas`` (the ranks holding the same samples and channels, which
    compute the same groups), is queued on ``rt`` (``BatchNormRuntime.flush``)."""
    g = int(rt.stats.group)
    if x.shape[0] % g:
        raise RuntimeError(f"batch norm on {x.shape[0]} local samples cannot be split into groups of "
                           f"{g} (the plan's --bn-group); the planner must not allow this")
    if len(ranks) <= 1:
        return _native_group_batch_norm(x, weight, bias, running_mean, running_var, momentum, eps, g,
                                        rt, channels, replicas)
    box: list = []
    y = _GroupBatchNorm.apply(x, weight, bias, eps, g, comm, tuple(sorted(ranks)), box)
    if running_mean is not None and running_var is not None:
        mean, var, n = box[0]
        full_c = running_mean.numel()
        sm = torch.zeros(full_c, dtype=torch.float64, device=x.device)
        sv = torch.zeros(full_c, dtype=torch.float64, device=x.device)
        a, e = channels if channels is not None else (0, full_c)
        sm[a:a + e] = mean.sum(0).double() / replicas
        sv[a:a + e] = (var * (n / max(n - 1.0, 1.0))).sum(0).double() / replicas
        rt.record(running_mean, running_var, 0.1 if momentum is None else momentum, sm, sv)
    return y


def _native_group_batch_norm(x, weight, bias, running_mean, running_var, momentum, eps, g: int,
                             rt: BatchNormRuntime, channels, replicas: int):
    """Local statistics when this rank holds its groups whole (nothing to combine): torch's own
    batch-norm kernel and its backward. One group: ``batch_norm`` on the block. k > 1 groups:
    the groups moved into the channel dim, (k, g, C, *) -> (g, k C, *), so that each (group,
    channel) pair is one channel of one ``batch_norm`` (weight and bias repeated k times).
    The group means and unbiased variances come out of the kernel through scratch running
    buffers updated with momentum 1 (``r <- batch statistic``)."""
    import torch.nn.functional as F
    k = x.shape[0] // g
    c = x.shape[1]
    track = running_mean is not None and running_var is not None
    # the scratch statistics take the parameters' dtype: under autocast the input may be bf16
    # while weight and running statistics stay float32 (torch's mixed-dtype batch norm)
    sdt = weight.dtype if weight is not None else (running_mean.dtype if track else x.dtype)
    mean_k = torch.zeros(k * c, dtype=sdt, device=x.device) if track else None
    var_k = torch.ones(k * c, dtype=sdt, device=x.device) if track else None
    if k == 1:
        y = F.batch_norm(x, mean_k, var_k, weight, bias, True, 1.0, eps)
    else:
        rest = tuple(x.shape[2:])
        xt = x.reshape((k, g, c) + rest).transpose(0, 1).reshape((g, k * c) + rest)
        w = weight.repeat(k) if weight is not None else None
        b = bias.repeat(k) if bias is not None else None
        yt = F.batch_norm(xt, mean_k, var_k, w, b, True, 1.0, eps)
        y = yt.reshape((g, k, c) + rest).transpose(0, 1).reshape(x.shape)
    if track:
        full_c = running_mean.numel()
        sm_k = mean_k.reshape(k, c).sum(0).double() / replicas
        sv_k = var_k.reshape(k, c).sum(0).double() / replicas
        if channels is None:          # every channel here: the sums are the full vectors
            sm, sv = sm_k, sv_k
        else:
            sm = torch.zeros(full_c, dtype=torch.float64, device=x.device)
            sv = torch.zeros(full_c, dtype=torch.float64, device=x.device)
            a, e = channels
            sm[a:a + e] = sm_k
            sv[a:a + e] = sv_k
        rt.record(running_mean, running_var, 0.1 if momentum is None else momentum, sm, sv)
    return y
