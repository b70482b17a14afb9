"""The native fast path: a plan that is pure data parallelism runs the user's own module.

When every layer of a plan is ``sample(P)`` over the whole mesh of P ranks (no transition, no
replicated or split weight), each rank computes exactly what the user's ``nn.Module`` computes
on its block of samples. Running the traced program op by op through ``DistModel.op`` then only
adds Python dispatch (substitution of every argument, a decomposition call per op, the local
batch-norm bookkeeping) that torch DDP does not pay. ``NativeDataParallel`` runs the module's
own ``forward`` instead, on the same ``nn.Parameter`` objects and buffer tensors as the
``DistModel`` (so the optimizer, ``GradSync``'s bucketed overlapped all-reduces, validation and
checkpoints see one set of tensors), and keeps the plan's function:

* batch norm: local statistics with G = N / P (the samples one rank holds) are what torch's
  kernel computes on the rank's block; the plan's running statistics (one update per step with
  the MEAN over the P groups, identical on every rank) are the mean over the ranks of the
  natively updated buffers, because the update ``r <- (1 - m) r + m s`` is affine in ``s`` with
  the same coefficients on every rank (``m`` fixed, or ``1 / num_batches_tracked``, which every
  rank counts alike). Affine maps compose, so this holds after any number of steps: each rank
  updates its buffers locally, and one all-reduce of every running mean and variance, when
  something reads them (``flush``: ``DistModel.flush_batch_norm``, called by ``train()``/
  ``eval()``, ``full_buffers`` and so validation and checkpoints, and a tournament's exchange),
  gives every rank the plan's values. Nothing is sent per step (an asynchronous all-reduce of
  the statistics every step did, served by gloo's threads on the ranks' own cores; the cost
  model never priced it). ``benchmarks/bench_native_overhead.py`` times the native ResNet-2D
  plan against DDP before and after (``reports/benchmarks/native_overhead_resnet2d*.txt``).
* gradients: SUM over the mesh (the runtime's convention: each rank back-propagates its share
  ``L_r = loss_r n_r / N`` of the loss). By default by torch DDP's own reducer, configured as the
  DDP baseline is (``execute.baseline``: DDP's default buckets, 1 MiB first, then 25 MiB; C++
  autograd hooks copying each gradient into its bucket), with a comm hook that sums instead of
  averaging and no buffer broadcast (``GradSync`` hands its hooks over): the same gradient
  synchronisation DDP pays, so a native plan carries no per-parameter Python work that DDP does
  not. ``benchmarks/bench_native_overhead.py`` (``reports/benchmarks/native_overhead.txt``)
  compares the two reducers with DDP phase by phase (main-thread CPU per phase): ``GradSync``'s
  Python hooks, concatenation and copy-back are work that DDP's reducer does in C++ inside
  backward. The cost model still prices ``GradSync``'s whole-layer buckets of 25 MiB
  (``layer_buckets``), not DDP's 1 MiB first bucket. ``GradSync`` (bucketed as priced) stays
  where DDP's reducer cannot be used: a module whose parameters do
  not all receive a gradient in a meta forward + backward (DDP would wait for them; its
  ``find_unused_parameters`` costs a graph walk a step), and on request
  (``AUTOPAR_NATIVE_REDUCER=gradsync``). ``NativeDataParallel.reducer`` says which runs and why.
* anything else (global statistics, another ``--bn-group``, a buffer that forward updates and
  that is not batch norm's (read-only buffers, e.g. a causal mask, are fine),
  an output whose local shape differs from the plan's, a model the meta run cannot execute)
  keeps the traced path; ``why_not`` says which.

A graph-parallel plan of a PyG batch (every layer ``graphs(P, B)``, ``decomp.graph.graphs``)
runs here too, and only here: each rank's sub-batch of whole graphs comes from
``runtime.graphs.split_graph_batch`` (``DistModel.shard_inputs``), the module's output is cut to
the rank's B / P graph rows (``runtime.graphs.graph_rows``), gradients as above.

Engines. Such a plan runs on one of two engines (``NativeDataParallel.engine``, recorded in
``autopar execute``'s run.json ``extra.engine`` and on ``autopar.parallelize``'s module):

* ``"torch-ddp"``: torch's ``DistributedDataParallel`` itself, as a user would write it: DDP's
  own C++ reducer, which AVERAGES the gradients over the P ranks, no comm hook, no buffer
  broadcast. The plan's function is kept by the loss convention: the runtime's share of rank r
  is ``L_r = loss_r n_r / N`` and the plan SUMS the gradients of the shares; DDP averages the
  gradients of what each rank back-propagates, so each rank back-propagates ``P L_r`` (= its
  block's mean loss ``loss_r`` when the blocks are equal, ``n_r = N / P``: the factor is then
  exactly 1 and no multiplication happens). ``local_loss`` and ``reduce_loss`` keep the VALUE
  of the share (their sum over the ranks is the single-process loss) and scale only its
  gradient by P (``loss_share``); for P a power of two ``x / P * P`` is exact in floating point,
  so the gradients equal the SUM convention's bit for bit; otherwise to rounding. A gradient
  DDP does not average, that of an input which requires one, gets the factor 1 / P back on
  the way in (``forward``), so it too is the single process's. ``autopar
  execute`` times the DDP object itself on the rank's block with the model file's loss.
  Chosen only where DDP's reducer runs (every parameter gets a gradient), the blocks of samples
  are equal, the loss is not replicated, and the rows of the output are the module's own (not
  graph parallelism); elsewhere the plan runs on the next engine, ``engine_reason`` says why.
* ``"autopar-native"``: autopar's wrapper (above): DDP's reducer with the SUM hook, or
  ``GradSync``, each rank back-propagating its share.

``DEFAULT_ENGINE`` is the faster of the two measured side by side (interleaved rounds of both
on the shipped GPT and HF GPT-2 at world 2 and 4, ``benchmarks/bench_engines.py``, its verdict
in ``reports/benchmarks/engines.json``; ``tests/test_engines.py`` holds the constant to it).
``AUTOPAR_ENGINE`` (or ``use_engine``, which ``autopar execute --engine`` and
``autopar.parallelize(engine=...)`` use) forces one: "torch-ddp", "autopar" (= "autopar-native")
or "auto" (the default).

``AUTOPAR_NATIVE=0`` turns the fast path off (the benchmarks compare both). Per-layer times
(``LayerTimer``) come from hooks on the leaf modules that name a layer: an op outside a module
(a functional relu, an add) counts for the layer measured before it.

Part of the runtime: imports neither the solver nor the tracer.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..errors import AutoparError
from .structure import _safe, map_output_tensor, output_tensor
from ..decomp.graph.graphs import graph_roles
from ..decomp.ir import not_data_parallel
from .graphs import graph_rows

#: the engines of a pure data-parallel plan (module docstring, "Engines")
TORCH_DDP, AUTOPAR_NATIVE = "torch-ddp", "autopar-native"
ENGINES = (TORCH_DDP, AUTOPAR_NATIVE)
#: the engine where both can run: the faster measured side by side (module docstring;
#: ``reports/benchmarks/engines.json`` "verdict", held to it by ``tests/test_engines.py``)
DEFAULT_ENGINE = TORCH_DDP
_ALIASES = {"auto": "auto", "torch-ddp": TORCH_DDP, "ddp": TORCH_DDP, "autopar": AUTOPAR_NATIVE,
            "autopar-native": AUTOPAR_NATIVE, "native": AUTOPAR_NATIVE}
_ENGINE: contextvars.ContextVar[str | None] = contextvars.ContextVar("autopar_engine", default=None)


class EngineError(AutoparError):
    """An engine name that is none of ``ENGINES`` (or "auto")."""


def engine_name(name: str, where: str = "engine") -> str:
    """``name`` as "auto" or one of ``ENGINES`` (aliases: "ddp", "autopar", "native")."""
    key = str(name).strip().lower()
    if key not in _ALIASES:
        raise EngineError(f"{where} {name!r} is not an engine of a data-parallel plan",
                          "use auto, torch-ddp or autopar")
    return _ALIASES[key]


@contextlib.contextmanager
def use_engine(name: str | None):
    """Within this block a native plan built here runs on engine ``name`` (None: as
    ``AUTOPAR_ENGINE`` says). ``autopar execute --engine`` and ``parallelize(engine=)``."""
    tok = _ENGINE.set(engine_name(name) if name is not None else None)
    try:
        yield
    finally:
        _ENGINE.reset(tok)


def engine_request() -> str:
    """The engine asked for: ``use_engine``'s, else ``AUTOPAR_ENGINE``'s, else "auto"."""
    got = _ENGINE.get()
    if got is not None:
        return got
    return engine_name(os.environ.get("AUTOPAR_ENGINE", "auto"), "AUTOPAR_ENGINE")


class _Share(torch.autograd.Function):
    """value ``loss * value_factor``, gradient ``g * grad_factor`` (``loss_share``)."""

    @staticmethod
    def forward(ctx, loss, value_factor: float, grad_factor: float):
        ctx.grad_factor = grad_factor
        return loss * value_factor

    @staticmethod
    def backward(ctx, g):
        return g * ctx.grad_factor, None, None


def reducer_choice() -> str:
    """``AUTOPAR_NATIVE_REDUCER``: "ddp" (default: torch DDP's reducer wherever it can be used,
    module docstring) or "gradsync" (autopar's ``GradSync`` always)."""
    r = os.environ.get("AUTOPAR_NATIVE_REDUCER", "ddp").strip().lower()
    if r not in ("ddp", "gradsync"):
        raise ValueError(f"AUTOPAR_NATIVE_REDUCER={r!r}: use ddp or gradsync")
    return r


def _first(fut):
    return fut.value()[0]


def _sum_hook(group, bucket):
    """DDP comm hook: SUM the bucket over the process group ``group`` (DDP's default averages).
    It calls the group's own all-reduce, not ``torch.distributed.all_reduce``, whose Python
    wrapper, run once a bucket inside backward, cost the padded GNN about 3 % of its step
    (main-thread CPU side by side with DDP, ``benchmarks/bench_native_overhead.py``)."""
    return group.allreduce([bucket.buffer()]).get_future().then(_first)


def all_params_get_grads(model: nn.Module, graph, world: int) -> bool:
    """Whether one meta forward + backward of ``model`` on a rank's block gives every
    parameter that requires grad a gradient (DDP's reducer waits for each of them)."""
    from torch.func import functional_call

    try:
        names = [q for q, p in model.named_parameters() if p.requires_grad]
        meta = {q: torch.empty_like(p, device="meta").requires_grad_(q in names)
                for q, p in model.named_parameters()}
        meta.update({q: torch.empty_like(b, device="meta") for q, b in model.named_buffers()})
        xs = _meta_inputs(model, graph, world)
        out = output_tensor(functional_call(model, meta, tuple(xs), strict=False))
        leaves = [meta[q] for q in names]
        grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
        return all(g is not None for g in grads)
    except Exception:  # noqa: BLE001 - unknown: keep the reducer that tolerates missing grads
        return False


def _meta_inputs(model: nn.Module, graph, world: int) -> list[torch.Tensor]:
    """One rank's block of every graph input on meta; floating inputs take the dtype of the
    module's floating parameters (``execute`` validates in float64 a model traced in float32).
    The inputs of a PyG batch (``decomp.graph.graphs.graph_roles``: nodes and edges along dim 0,
    ``edge_index [2, E]`` along dim 1) are cut along their item dim, others along dim 0."""
    fdt = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    items = {}
    if graph_roles(graph)[0] is not None:
        items = {v: int(d) for lay in graph.layers for op in lay.ops
                 for v, (d, _) in (op.attrs.get("items") or {}).items()}
    xs = []
    for gi in graph.inputs:
        dt = getattr(torch, gi.dtype, torch.float32)
        if dt.is_floating_point and fdt is not None:
            dt = fdt
        shape = list(gi.shape)
        d = items.get(gi.name, 0) if shape else 0
        if shape:
            shape[d] = shape[d] // world
        xs.append(torch.empty(shape, dtype=dt, device="meta"))
    return xs


def native_enabled() -> bool:
    """``AUTOPAR_NATIVE`` (default on): "0", "off", "false" or "no" keep the traced path."""
    return os.environ.get("AUTOPAR_NATIVE", "1").strip().lower() not in ("0", "off", "false", "no")


def graph_parallel(decisions: dict) -> int | None:
    """B (graphs in the batch) when every layer is ``graphs(P, B)`` (a graph-parallel plan of a
    PyG batch, ``decomp.graph.graphs``: whole graphs per rank, run natively), else None."""
    decs = list(decisions.values())
    if decs and all(d.kind == "graphs" for d in decs):
        return int(decs[0].graphs)
    return None


def why_not_native(graph, decisions: dict, world: int, bn_stats, model: nn.Module,
                   batch: int) -> str | None:
    """None when the plan may run ``model`` natively (module docstring), else the reason."""
    if graph_parallel(decisions) is not None:
        # whole graphs per rank (``runtime.graphs.split_graph_batch``): the module runs on a
        # rank's sub-batch as written; only training batch norm would change the function
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training:
                return f"batch norm {type(m).__name__} under graph parallelism (statistics per rank)"
        return None
    why = not_data_parallel(graph, decisions, world)
    if why is not None:
        return why
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    bn_bufs = {id(b) for m in bns for b in m.buffers(recurse=False)}
    updated = {q for op in graph.buffer_updates for q in op.buffers.values()}
    for q, b in model.named_buffers():
        if id(b) not in bn_bufs and q in updated:
            return f"buffer {q} is updated in forward and does not belong to a batch norm"
    if any(m.training and (m.track_running_stats is False or m.running_mean is not None) for m in bns):
        if not bn_stats.local:
            return "global batch-norm statistics (the native kernel normalises each rank's block alone)"
        if batch % world or bn_stats.group != batch // world:
            return (f"batch-norm groups of {bn_stats.group} samples, not the {batch // max(world, 1)} "
                    f"samples of a rank")
    # the module on one rank's block must produce the plan's block of the output
    import torch.utils._pytree as pytree
    from torch.func import functional_call

    try:
        meta = {k: torch.empty_like(v, device="meta") for k, v in
                list(model.named_parameters()) + list(model.named_buffers())}
        for gi in graph.inputs:
            if not gi.shape or gi.shape[0] % world:
                return f"input {gi.name} {list(gi.shape)} does not split into {world} equal sample blocks"
        xs = _meta_inputs(model, graph, world)
        with torch.no_grad():
            out = functional_call(model, meta, tuple(xs), strict=False)
        got = list(output_tensor(out).shape)
    except Exception as e:  # noqa: BLE001 - any failure keeps the traced path
        return f"the module does not run on a rank's block of samples ({type(e).__name__}: {e})"
    want = list(graph.value_shape(graph.output))
    if not want or want[0] % world:
        return f"output {want} does not split into {world} sample blocks"
    want[0] //= world
    if got != want:
        return f"the module's output on a rank's block is {got}, the plan's block is {want}"
    del pytree
    return None


class NativeDataParallel:
    """Runs ``model`` (its parameters and buffers rebound to the ``DistModel``'s own) as the
    rank's forward; the batch-norm running statistics are averaged over the mesh when read
    (``flush``)."""

    def __init__(self, dm, model: nn.Module, canonical: dict[str, str], out_rows=None) -> None:
        import copy

        self.dm = dm
        self.out_rows = out_rows      # graph parallelism: the rank's rows of the output
        # a copy of the module whose parameters ARE the DistModel's Parameter objects (tied ones
        # included) and whose buffers are its buffers; the user's module is left untouched
        memo: dict[int, Any] = {}
        for qual, t in model.named_parameters(remove_duplicate=False):
            memo[id(t)] = dm.params[_safe(canonical.get(qual, qual))]
        for qual, t in model.named_buffers(remove_duplicate=False):
            memo[id(t)] = dm.bufs.get(canonical.get(qual, qual), t)
        self.model = model = copy.deepcopy(model, memo)
        model.train(dm.training)
        self._buf_slots: list[tuple[nn.Module, str, str]] = []
        for qual, _ in model.named_buffers(remove_duplicate=False):
            mod, leaf = _owner(model, qual)
            self._buf_slots.append((mod, leaf, canonical.get(qual, qual)))
        self._bufs_seen = None         # the ``dm.bufs`` dict the slots were last bound to
        self._rebind_buffers()
        self._bns = [m for m in model.modules()
                     if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        self._pending = False        # running statistics updated since the last ``flush``
        # gradients: torch DDP's reducer (SUM hook, no buffer broadcast) where it can be used,
        # else GradSync (module docstring); ``reducer`` says which and why
        self.ddp = None
        comm = dm.comm
        self._ddp_sig: tuple = ()
        # the engine (module docstring, "Engines"): torch's DDP as is (gradients averaged, each
        # rank back-propagating P times its share: ``grad_scale``), or autopar's wrapper
        want = engine_request()
        self.engine, self.grad_scale, self._sum_hook = AUTOPAR_NATIVE, 1, True
        self.engine_reason = "asked for (autopar)" if want == AUTOPAR_NATIVE else ""
        if comm.world <= 1:
            self.reducer = "none (one rank)"
            self.engine_reason = self.engine_reason or "one rank: nothing to reduce"
        elif reducer_choice() == "gradsync":
            self.reducer = "autopar's GradSync (AUTOPAR_NATIVE_REDUCER=gradsync)"
            self.engine_reason = self.engine_reason or "AUTOPAR_NATIVE_REDUCER=gradsync"
        elif not all_params_get_grads(model, dm.graph, comm.world):
            self.reducer = ("autopar's GradSync (a parameter gets no gradient in a meta forward + "
                            "backward: DDP's reducer would wait for it)")
            self.engine_reason = self.engine_reason or "a parameter gets no gradient: DDP would wait for it"
        else:
            if want == TORCH_DDP or (want == "auto" and DEFAULT_ENGINE == TORCH_DDP):
                why = self._why_not_torch_ddp()
                if why is None:
                    self.engine, self.grad_scale, self._sum_hook = TORCH_DDP, comm.world, False
                    self.engine_reason = ("asked for" if want == TORCH_DDP else
                                          "the default (the faster engine measured, reports/benchmarks/engines.md)")
                else:
                    self.engine_reason = why
            elif not self.engine_reason:
                self.engine_reason = "the default (the faster engine measured, reports/benchmarks/engines.md)"
            self._make_ddp()
            dm.gradsync.hand_over()
            self.reducer = ("torch DDP's reducer (its own average)" if self.engine == TORCH_DDP
                            else "torch DDP's reducer (SUM hook)")
        self._timer_modules: list[tuple[nn.Module, int]] = []
        leaves = {n: m for n, m in model.named_modules() if not any(True for _ in m.children())}
        seen = set()
        for lay in dm.graph.layers:
            m = leaves.get(lay.module)
            if m is not None and lay.module not in seen:
                seen.add(lay.module)
                self._timer_modules.append((m, lay.index))

    def _why_not_torch_ddp(self) -> str | None:
        """None when torch's DDP, averaging, computes the plan's function with each rank
        back-propagating its block's mean loss (module docstring), else why not."""
        dm, world = self.dm, self.dm.comm.world
        if self.out_rows is not None:
            return "graph parallelism: the rank's rows of the output are cut from the module's"
        try:
            n = int(dm.graph.value_shape(dm.graph.output)[0])
            replicas = dm.loss_replicas()
        except Exception as e:  # noqa: BLE001 - unknown placement: the wrapper that scales shares
            return f"the loss placement is unknown ({type(e).__name__}: {e})"
        if n % world:
            return f"the output's {n} rows do not split into {world} equal blocks"
        if replicas != 1:
            return f"the loss is computed by {replicas} replicas of each block"
        return None

    def _make_ddp(self) -> None:
        """torch DDP's reducer over the mesh: no buffer broadcast (every buffer is read-only or
        batch norm's, averaged when read: ``flush``), no init sync (the parameters are equal on
        every rank by construction); autopar's engine adds the SUM hook, torch's averages
        (``engine``). Rebuilt when the parameters change dtype or device (``.to()`` after
        construction: DDP's buckets have the old ones)."""
        from torch.nn.parallel import DistributedDataParallel as DDP
        comm = self.dm.comm
        dev = comm.device
        self.ddp = DDP(self.model, device_ids=[dev.index] if dev.type == "cuda" else None,
                       process_group=comm.mesh_group, forward_sync_buffers=False, init_sync=False)
        if self._sum_hook:
            group = comm.mesh_group if comm.mesh_group is not None else dist.group.WORLD
            self.ddp.register_comm_hook(group, _sum_hook)
        self.ddp.train(self.model.training)
        self._ddp_sig = self._param_sig()

    def _param_sig(self) -> tuple:
        """dtype and device of the first and last parameter (``.to()`` converts every one, in
        place: the Parameter objects stay, so their list is kept): checked every forward."""
        ps = self.__dict__.get("_ends")
        if ps is None:
            allp = list(self.model.parameters())
            ps = self._ends = (allp[0], allp[-1]) if allp else ()
        return tuple((p.dtype, p.device) for p in ps)

    def _rebind_buffers(self) -> None:
        """Buffers may be replaced (``.to()``); the DistModel's ``bufs`` are the truth. Its dict
        is replaced whenever a buffer is (``train.api.ParallelModule._apply``; nothing assigns
        into it): the slots are rebound only when the dict is another (checked every forward)."""
        bufs = self.dm.bufs
        if bufs is self._bufs_seen:
            return
        self._bufs_seen = bufs
        for mod, leaf, qual in self._buf_slots:
            t = bufs.get(qual)
            if t is not None and mod._buffers.get(leaf) is not t:
                mod._buffers[leaf] = t

    def train(self, mode: bool) -> None:
        (self.ddp if self.ddp is not None else self.model).train(mode)

    def loss_share(self, loss: torch.Tensor, factor: float) -> torch.Tensor:
        """This rank's loss share ``loss * factor`` (``factor = n_r / N / replicas``,
        ``DistModel.local_loss``): its value as under every runtime, its gradient ``grad_scale``
        times larger under torch's averaging DDP (module docstring, "Engines")."""
        if self.grad_scale == 1:
            return loss * factor
        return _Share.apply(loss, factor, factor * self.grad_scale)

    def step_args(self, optim, local_inputs, target_full, loss_fn) -> tuple:
        """What ``execute.timing.timed_steps`` takes before ``n`` for the torch-ddp engine: the
        DDP object itself on the rank's block, the model file's loss on the rank's target rows
        (``runtime.model.target_rows``: a slice, so a view), nothing to finish (DDP's reducer
        writes the averaged gradients in backward). Each rank back-propagates its block's mean
        loss: the share times ``grad_scale`` with equal blocks (module docstring, "Engines")."""
        dm = self.dm
        shape = tuple(int(n) for n in dm.graph.value_shape(dm.graph.output))
        s, e = dm.loss_layout().local_bounds(shape, dm.comm.rank, dm.comm.world)[0]
        t = target_full[s:s + e] if target_full is not None else None
        loss_of = (lambda o: loss_fn(o, t)) if t is not None else loss_fn
        return self.ddp, optim, list(local_inputs), loss_of, _nothing

    def forward(self, *inputs: torch.Tensor):
        if self.dm.bufs is not self._bufs_seen:
            self._rebind_buffers()
        timer = self.dm.timer
        handles = self._timer_hooks(timer) if timer is not None else ()
        try:
            ddp = self.ddp
            if ddp is not None:
                if self._param_sig() != self._ddp_sig:
                    self._make_ddp()
                    ddp = self.ddp
                # gradient accumulation (``train.api``: set_requires_gradient_sync) as DDP's no_sync
                ddp.require_backward_grad_sync = self.dm.__dict__.get("_sync_grads", True)
                if self.grad_scale != 1 and torch.is_grad_enabled():
                    # an input's gradient is not averaged: undo the shares' factor on it
                    inputs = tuple(_Share.apply(x, 1.0, 1.0 / self.grad_scale)
                                   if isinstance(x, torch.Tensor) and x.requires_grad else x for x in inputs)
                out = ddp(*inputs)
            else:
                out = self.model(*inputs)
        finally:
            for h in handles:
                h.remove()
        if self.out_rows is not None:     # graph parallelism: the rank's rows, in any structure
            out = map_output_tensor(out, self.out_rows)
        if self.model.training and self._bns:
            self._pending = True        # this rank's running statistics moved (``flush``)
        return out

    def _timer_hooks(self, timer) -> list:
        hs = []
        for m, li in self._timer_modules:
            hs.append(m.register_forward_pre_hook(lambda mod, args, li=li: timer.mark_fwd(li)))

            def post(mod, args, out, li=li):
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda g, li=li: (timer.mark_bwd(li), None)[1])
            hs.append(m.register_forward_hook(post))
        return hs

    # ---- batch-norm running statistics: the mean over the ranks ------------------------------
    def flush(self, comm) -> None:
        """Every running mean and variance := its mean over the ranks (module docstring), when a
        training forward has updated them since the last flush. Collective over the mesh: every
        rank calls it at the same point (each reader of the buffers does)."""
        if not self._pending:
            return
        self._pending = False
        if comm.world <= 1:
            return
        bufs = [b for m in self._bns for b in (m.running_mean, m.running_var) if b is not None]
        if not bufs:
            return
        flat = torch.cat([b.detach().reshape(-1) for b in bufs])
        dist.all_reduce(flat, group=comm.mesh_group)
        flat.div_(comm.world)
        off = 0
        with torch.no_grad():
            for b in bufs:
                n = b.numel()
                b.copy_(flat[off:off + n].view_as(b))
                off += n


def _nothing() -> None:
    return None


def _owner(model: nn.Module, qual: str) -> tuple[nn.Module, str]:
    *path, leaf = qual.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    return mod, leaf


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every parameter and buffer name (duplicates of tied tensors included) -> the name
    ``named_parameters()`` / ``named_buffers()`` give the tensor (the DistModel's key)."""
    out: dict[str, str] = {}
    for named in (model.named_parameters, model.named_buffers):
        first = {id(t): q for q, t in named()}
        for q, t in named(remove_duplicate=False):
            out[q] = first[id(t)]
    return out


def build_native(dm, model: nn.Module, batch: int, allowed: bool | None = None
                 ) -> tuple[NativeDataParallel | None, str | None]:
    """(the fast path, None) when the plan allows it, else (None, the reason). ``allowed``:
    None = as ``AUTOPAR_NATIVE`` says, False = never (the traced path), True = when legal."""
    if allowed is False:
        return None, "native=False"
    if allowed is None and not native_enabled():
        return None, "AUTOPAR_NATIVE=0"
    why = why_not_native(dm.graph, dm.decisions, dm.comm.world, dm.bn_stats, model, batch)
    if why is not None:
        return None, why
    try:    # e.g. a module that cannot be deep-copied: the traced path, with the reason
        names = canonical_names(model)
        import copy
        copy.deepcopy(model, {id(t): t for t in list(model.parameters()) + list(model.buffers())})
    except Exception as e:  # noqa: BLE001
        return None, f"the module cannot be copied ({type(e).__name__}: {e})"
    rows = None
    b = graph_parallel(dm.decisions)
    if b is not None:
        world = dm.comm.world
        rows = lambda out: graph_rows(out, b, world)  # noqa: E731
    return NativeDataParallel(dm, model, names, out_rows=rows), None


__all__: Sequence[Any] = ("NativeDataParallel", "build_native", "why_not_native", "native_enabled",
                          "ENGINES", "DEFAULT_ENGINE", "EngineError", "use_engine", "engine_request")
