"""DistModel: the base class of every generated module.

A generated module subclasses ``DistModel`` and writes ``forward`` as one line per traced op
(``self.op(name, *inputs)``) and one per transition (``self.move(...)``). The base class:

* loads the plan's layer graph and per-layer decisions (plain JSON, no process group needed to
  read them);
* takes the user's model (built with the same seed on every rank) and keeps, for every
  parameter, only this rank's shard (``Decomposition.param_shard``) as an ``nn.Parameter``, and
  a private copy of every buffer;
* creates the process groups the plan needs, collectively, in one order;
* runs each op through its layer's decomposition, each transition through ``redistribute``;
* synchronises gradients with ``GradSync`` (bucketed, overlapped SUM-allreduce per group);
* when the plan is pure data parallelism (every layer ``sample`` over the whole mesh), runs the
  user's own module instead of the traced program, on the same parameters and buffers
  (``runtime.native``: the same function without per-op dispatch);
* computes the local loss share ``L_r = loss(out_r, y_r) * n_r / N / replicas`` so that
  ``sum_r L_r`` is the single-process loss for any per-sample mean loss.

It imports neither the solver nor the tracer.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..artifacts import Plan, plan_from_decisions
from ..decomp.base import Decomposition, ParamShard
from ..decomp.ir import LayerGraphData, OpSpec
from ..decomp.sharding import Sharding, from_splits, loss_sharding_for
from .comm import assemble, Comm, local_slice
from .ops import BatchNormRuntime, _BN, call_local
from .redistribute import redistribute
from .gradsync import DEFAULT_BUCKET_CAP_BYTES, GradSync, layer_buckets
from .native import build_native, graph_parallel
from .structure import (_safe, map_output_tensor, output_structure, output_tensor,  # noqa: F401  (re-exported)
                        rebuild_output)
from ..decomp.graph.graphs import graph_roles
from ..decomp.redistribute import COLLECTIVES
from ..decomp.transition import plan_layouts
from ..errors import PlanFileError
from .graphs import assemble_graph_grad, split_graph_batch
from .layers.cross_entropy import VocabLoss


class LayerTimer:
    """Timestamps of layer boundaries in forward and backward (per-layer measured time)."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.sync = sync
        self.fwd: list[tuple[float, int]] = []
        self.bwd: list[tuple[float, int]] = []

    def mark_fwd(self, layer: int) -> None:
        self.sync()
        self.fwd.append((time.perf_counter(), layer))

    def mark_bwd(self, layer: int) -> None:
        self.sync()
        self.bwd.append((time.perf_counter(), layer))

    def per_layer_s(self, t_fwd_end: float, t_bwd_end: float) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for events, end, key in ((self.fwd, t_fwd_end, "fwd_s"), (self.bwd, t_bwd_end, "bwd_s")):
            ev = sorted(events)
            for i, (t, lay) in enumerate(ev):
                nxt = ev[i + 1][0] if i + 1 < len(ev) else end
                out.setdefault(lay, {"fwd_s": 0.0, "bwd_s": 0.0})[key] += max(0.0, nxt - t)
        return out


def param_aliases(model: nn.Module) -> dict[str, str]:
    """{other name: first name} of every parameter reachable under several names (a tied
    weight: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``): what ``state_dict()``
    lists beside the names ``named_parameters()`` keeps."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), n) != n:
            out[n] = first[id(p)]
    return out


def param_shards(graph: LayerGraphData, decisions: dict[int, Decomposition]) -> dict[str, ParamShard]:
    """How each parameter is sharded under the plan (by qualified name)."""
    shards: dict[str, ParamShard] = {}
    for lay in graph.layers:
        dec = decisions[lay.index]
        for op in lay.ops:
            for role, qual in op.param_names.items():
                sh = dec.layer_param_shard(lay, op, role)
                if qual in shards and shards[qual] != sh:
                    raise ValueError(f"parameter {qual} is used by several layers with different "
                                     f"shardings; the planner must not allow this")
                shards[qual] = sh
    return shards


def plan_partitions(graph: LayerGraphData, decisions: dict[int, Decomposition],
                    world: int) -> list[list[list[int]]]:
    """Every process-group partition (mesh-local ranks) a plan uses: gradient groups, each
    decomposition's own groups, and the collectives of every transition between layers (and
    of the output's move to the loss layout). Pure: the runner asks it for each plan of a run
    set, to create every group of every plan up front."""

    parts: list[list[list[int]]] = []
    for sh in param_shards(graph, decisions).values():
        parts.append([sh.grad_group(r, world) for r in range(world)])
    for lay in graph.layers:
        parts.extend(decisions[lay.index].partitions(lay, world))
    moves = []
    for u, v, value in graph.edges():
        moves.append((decisions[u].out_placement(graph.layers[u], value),
                      decisions[v].in_placement(graph.layers[v], value), graph.value_shape(value)))
    prod = graph.producer()
    if graph.output in prod:
        li = prod[graph.output]
        out = decisions[li].out_placement(graph.layers[li], graph.output)
        shape = graph.value_shape(graph.output)
        moves.append((out, loss_sharding_for(out, shape[0], world), shape))
    for src, dst, shape in moves:
        if src.owned() != dst.owned():      # a halo is the consuming layer's own exchange
            for st in plan_layouts(src, dst, tuple(int(n) for n in shape), world):
                if isinstance(st, COLLECTIVES) and hasattr(st, "groups"):
                    parts.append([list(g) for g in st.groups])
    return parts


def plan_groups(plan: Any, ranks: Sequence[int]) -> list[tuple[int, ...]]:
    """Global rank tuples of every process group ``plan`` needs when it runs on the mesh of
    global ``ranks`` (mesh rank i = ``ranks[i]``): its partitions (``plan_partitions``) and the
    whole mesh. What ``create_groups`` must make, on every process, before plans run on
    sub-meshes."""
    graph = plan.graph()
    decisions = {d.layer: d.decomposition() for d in plan.layers}
    ranks = tuple(int(r) for r in ranks)
    out = {tuple(sorted(ranks[r] for r in g)) for part in plan_partitions(graph, decisions, len(ranks))
           for g in part if 1 < len(g) < len(ranks)}
    out.add(tuple(sorted(ranks)))
    return sorted(out)


class DistModel(nn.Module):
    def __init__(self, plan: Plan | dict[str, Any], model: nn.Module, comm: Comm | None = None,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, native: bool | None = None,
                 layers: Sequence[int] | None = None) -> None:
        """``layers``: hold only the parameters and buffers these layers' ops use (a pipeline
        stage running its own layers of the plan, ``runtime.stage_program``); the traced program
        is then run per layer range (never natively) and only these layers' gradients synchronise."""
        super().__init__()
        if not isinstance(plan, Plan):   # a plan file's dict (older generated modules) or an in-memory
            # plan of decisions only (calibrate.overhead): both checked like a plan file
            plan = (Plan.from_json(plan, "the plan given to DistModel") if "schema" in plan
                    else plan_from_decisions(plan, "the plan given to DistModel"))
        # by default the plan runs on the ranks its mesh names (the whole world, or a sub-mesh)
        self.comm = comm or Comm.from_env(ranks=plan.mesh.ranks)
        world = self.comm.world
        if plan.world_size != world:
            raise PlanFileError(f"plan was made for world size {plan.world_size}, running at {world}",
                                f"re-plan with --world-size {world}")
        self.graph = plan.graph()
        self.decisions: dict[int, Decomposition] = {d.layer: d.decomposition() for d in plan.layers}
        self.layer_of: dict[str, int] = {}
        self.spec: dict[str, OpSpec] = {}
        for lay in self.graph.layers:
            for op in lay.ops:
                self.layer_of[op.name] = lay.index
                self.spec[op.name] = op
        self.first_op = {lay.ops[0].name: lay.index for lay in self.graph.layers}
        self.last_op = {lay.ops[-1].name: lay.index for lay in self.graph.layers}
        self.buffer_updates = list(self.graph.buffer_updates)
        self.timer: LayerTimer | None = None
        # batch-norm statistics the plan was made for (``decomp.bn``); local ones defer the
        # running statistics' update to ``flush_batch_norm`` (one all-reduce when read)
        self.bn_stats = plan.bn_stats()
        self.bn_runtime = (BatchNormRuntime(self.bn_stats, int(plan.model.batch_size or self.graph.batch_size))
                           if self.bn_stats.local else None)
        self.output_spec = output_structure(model, self.graph)
        self._prepared: dict[str, tuple] = {}   # per op: (spec, layer index, decomposition, ...)
        self._moves: dict[tuple, tuple] = {}    # per transition: (src layout, dst layout, shape)

        # ---- parameters: this rank's shard of each ----------------------------------------
        full_params = dict(model.named_parameters())
        used_bufs = None
        if layers is not None:          # a stage of the plan: its layers' parameters and buffers only
            mine = {int(i) for i in layers}
            ops = [op for lay in self.graph.layers if lay.index in mine for op in lay.ops]
            used = {q for op in ops for q in op.param_names.values()}
            used_bufs = {q for op in ops for q in op.buffers.values()}
            full_params = {q: p for q, p in full_params.items() if q in used}
            self.buffer_updates = [op for op in self.buffer_updates if set(op.buffers.values()) <= used_bufs]
            native = False
        self.param_aliases = param_aliases(model)    # a tied weight's other names (``full_state_dict``)
        shards = param_shards(self.graph, self.decisions)
        self.shards = shards
        self.params = nn.ParameterDict()
        self.qualname: dict[str, str] = {}
        for qual, p in full_params.items():
            sh = shards.get(qual, ParamShard())
            local = p.detach()[sh.index(p.shape, self.comm.rank, world)].clone()
            self.params[_safe(qual)] = nn.Parameter(local, requires_grad=p.requires_grad)
            self.qualname[_safe(qual)] = qual
        self.bufs: dict[str, torch.Tensor] = {}
        for qual, buf in model.named_buffers():
            if used_bufs is not None and qual not in used_bufs:
                continue
            t = buf.detach().clone()
            self.register_buffer(_safe(qual), t)
            self.bufs[qual] = t

        # ---- process groups (collective, one order everywhere) -----------------------------
        self.comm.ensure_partitions(plan_partitions(self.graph, self.decisions, world))
        self.comm.barrier()  # one collective on the mesh before any point-to-point (NCCL)

        # parameters in the order of the layers that use them (backward reverses it)
        layer_of_param: dict[str, int] = {}
        for lay in self.graph.layers:
            for op in lay.ops:
                for q in op.param_names.values():
                    layer_of_param.setdefault(q, lay.index)
        ordered = sorted(full_params, key=lambda q: layer_of_param.get(q, -1))
        bucket_of_layer = layer_buckets([(lay.index, lay.param_numel * lay.itemsize) for lay in self.graph.layers],
                                         bucket_cap_bytes)
        self.gradsync = GradSync(self.comm, [
            (self.params[_safe(q)], tuple(shards.get(q, ParamShard()).grad_group(self.comm.rank, world)),
             bucket_of_layer.get(layer_of_param.get(q, -1)))
            for q in ordered], bucket_cap_bytes=bucket_cap_bytes)

        # ---- pure data parallelism runs the user's module itself (``runtime.native``) -------
        # (``native``: None = when the plan allows it and AUTOPAR_NATIVE is not 0; False = never)
        self._native, self.native_off_reason = build_native(
            self, model, int(plan.model.batch_size or self.graph.batch_size), allowed=native)

        # ---- graph parallelism of a PyG batch (``decomp.graph.graphs``): whole graphs per rank,
        # the user's module run natively (there is no op-by-op path for it)
        self._graph_roles = self._graph_shard = None
        if graph_parallel(self.decisions) is not None:
            self._graph_roles, why = graph_roles(self.graph)
            if self._graph_roles is None or self._native is None:
                raise PlanFileError(f"a graph-parallel plan cannot run here: {why or self.native_off_reason}",
                                    "re-plan (the planner keeps an op-by-op plan when graphs(P) is illegal), "
                                    "and leave AUTOPAR_NATIVE unset")

    def __init_subclass__(cls, **kwargs) -> None:
        """A generated ``forward`` (the traced program, op by op) gives way to the user's module
        when the plan is pure data parallelism (``runtime.native``: the same function)."""
        super().__init_subclass__(**kwargs)
        fwd = cls.__dict__.get("forward")
        if fwd is not None and not getattr(fwd, "_autopar_native_aware", False):
            import functools

            @functools.wraps(fwd)
            def forward(self, *inputs, **kwargs):
                nat = self.__dict__.get("_native")
                if nat is not None:
                    return nat.forward(*inputs, **kwargs)
                return fwd(self, *inputs, **kwargs)
            forward._autopar_native_aware = True
            cls.forward = forward

    @property
    def native(self) -> bool:
        """Whether this rank runs the user's module natively (``runtime.native``)."""
        return self.__dict__.get("_native") is not None

    # ---- what generated forward() calls ------------------------------------------------------
    def param(self, qual: str) -> torch.Tensor:
        return self.params[_safe(qual)]

    def op(self, name: str, *inputs: torch.Tensor) -> torch.Tensor:
        prep = self._prepared.get(name)
        if prep is None:
            spec = _with_float_dtype(self.spec[name], self.params)
            li = self.layer_of[name]
            prep = self._prepared[name] = (spec, li, self.decisions[li], self.graph.layers[li],
                                           [(q, _safe(q)) for q in spec.param_names.values()],
                                           list(spec.buffers.values()))
        spec, li, dec, layer, pnames, bnames = prep
        timer = self.timer
        if timer is not None and name in self.first_op:
            timer.mark_fwd(li)
        store = self.params._parameters     # the ParameterDict's own dict (no Module.__getattr__)
        params = {q: store[sq] for q, sq in pnames}
        buffers = {q: self.bufs[q] for q in bnames}
        rt = self.bn_runtime
        if rt is not None:                  # local batch-norm statistics for run_batch_norm
            tok = _BN.set(rt)
            try:
                out = dec.run(self.comm, layer, spec, list(inputs), params, buffers)
            finally:
                _BN.reset(tok)
        else:
            out = dec.run(self.comm, layer, spec, list(inputs), params, buffers)
        if timer is not None and name in self.last_op and out.requires_grad:
            out.register_hook(lambda g, li=li: (self.timer.mark_bwd(li), None)[1])
        return out

    def move(self, x: torch.Tensor, value: str, src: Sequence, dst: Sequence,
             layer: int | None = None) -> torch.Tensor:
        """Transition of activation ``value`` from sharding ``src`` to ``dst`` (their JSON),
        on the way into ``layer`` (its time counts for that layer)."""
        if self.timer is not None and layer is not None:
            self.timer.mark_fwd(layer)
        key = (value, repr(src), repr(dst))
        move = self._moves.get(key)
        if move is None:     # once per transition, not per step (value_shape scans the graph)
            move = self._moves[key] = (_sharding(src), _sharding(dst),
                                       tuple(self.graph.value_shape(value)))
        return redistribute(x, move[0], move[1], move[2], self.comm)

    def flush_batch_norm(self) -> None:
        """Apply the deferred running-statistics updates of local batch-norm statistics
        (collective over the mesh when any is pending; ``runtime.ops.BatchNormRuntime``, and a
        native plan's, ``runtime.native``). Every reader of the running statistics calls it, on
        every rank: ``train()``, ``full_buffers`` (validation, checkpoints), a tournament's
        exchange; after it every rank holds the plan's values."""
        if self.bn_runtime is not None:
            self.bn_runtime.flush(self.comm)
        nat = self.__dict__.get("_native")
        if nat is not None:
            nat.flush(self.comm)

    def train(self, mode: bool = True):
        if hasattr(self, "bn_runtime"):
            self.flush_batch_norm()
        if hasattr(self, "_prepared"):
            self._prepared.clear()   # a mode may run other op specs (batch norm in eval mode)
        nat = self.__dict__.get("_native")
        if nat is not None:
            nat.train(mode)
        return super().train(mode)

    def update_buffers(self) -> None:
        """Buffer-only ops of the traced program (e.g. BatchNorm's num_batches_tracked += 1).
        The deferred running statistics stay deferred (``flush_batch_norm``)."""
        if not self.training:
            return
        for op in self.buffer_updates:
            call_local(op, [], {}, self.bufs)

    # ---- layouts of the model's inputs and output ---------------------------------------------
    def input_layout(self, name: str) -> Sharding:
        """The blocks model input ``name`` is fed in: its first consumer's ``in_placement``, owned
        blocks only (``Sharding.owned``: a halo'd input is fed its Shard, the layer exchanges
        the halo)."""
        for lay in self.graph.layers:
            if name in lay.inputs:
                return self.decisions[lay.index].in_placement(lay, name).owned()
        return Sharding()

    def output_layout(self) -> Sharding:
        prod = self.graph.producer()
        li = prod[self.graph.output]
        return self.decisions[li].out_placement(self.graph.layers[li], self.graph.output)

    def loss_layout(self) -> Sharding:
        """Where the generated forward leaves the output (``loss_sharding_for``; the output's own
        layout when its producer computes the loss in place, ``loss_in_place``)."""
        if self._vocab_loss() is not None:
            return self.output_layout()
        return loss_sharding_for(self.output_layout(), self.graph.value_shape(self.graph.output)[0],
                               self.comm.world)

    def _vocab_loss(self):
        """(tensor group, first global column of this rank's block) when the output's producer
        computes a vocabulary-parallel loss (``decomp.tensor_parallel.vocab.VocabHead``), else None."""
        li = self.graph.producer()[self.graph.output]
        if not getattr(self.decisions[li], "loss_in_place", False):
            return None
        lay, shape = self.output_layout(), self.graph.value_shape(self.graph.output)
        last = len(shape) - 1
        return (lay.split_group([last], self.comm.rank, self.comm.world),
                lay.local_bounds(shape, self.comm.rank, self.comm.world)[last][0])

    def loss_context(self):
        """What the loss must run inside: for a vocabulary-parallel loss, the mode that turns
        ``F.cross_entropy`` on this rank's logits block into ``vocab_parallel_cross_entropy``."""
        import contextlib
        vl = self._vocab_loss()
        if vl is None:
            return contextlib.nullcontext()
        return VocabLoss(vl[1], self.comm.group(vl[0]))

    def loss_replicas(self) -> int:
        """Ranks computing the same loss share: the loss layout's replicas, times the tensor
        group of a vocabulary-parallel loss (every rank of it returns the whole loss)."""
        vl = self._vocab_loss()
        return self.loss_layout().replicas(self.comm.world) * (len(vl[0]) if vl is not None else 1)

    def shard_inputs(self, full_inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._graph_roles is not None:     # whole graphs per rank (``runtime.graphs``)
            local, _, self._graph_shard = split_graph_batch(self._graph_roles, full_inputs, None,
                                                            self.comm.rank, self.comm.world)
            return local
        return [local_slice(x, self.input_layout(gi.name), self.comm)
                for gi, x in zip(self.graph.inputs, full_inputs)]

    def assemble_input_grad(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """The whole gradient of graph input ``name`` from every rank's block (collective)."""
        shape = next(gi.shape for gi in self.graph.inputs if gi.name == name)
        if self._graph_roles is not None and self._graph_shard is not None:
            i = next(k for k, gi in enumerate(self.graph.inputs) if gi.name == name)
            full = assemble_graph_grad(self._graph_roles, i, grad, shape, self._graph_shard)
            return self.comm.all_reduce_(full)
        return assemble(grad, self.input_layout(name), shape, self.comm, "sum")

    def local_loss(self, out_local: torch.Tensor, target_full: torch.Tensor | None,
                   loss_fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        """This rank's share of the loss: loss(out_r, y_r) * n_r / N / replicas."""
        meta = self.__dict__.get("_loss_meta")
        if meta is None:    # once: the layouts are fixed, and finding them scans the graph
            shape = self.graph.value_shape(self.graph.output)
            meta = self.__dict__["_loss_meta"] = (
                shape[0], target_rows(self.loss_layout(), shape, self.comm.rank, self.comm.world),
                self._vocab_loss() is not None, self.loss_replicas())
        n_global, rows, vocab, replicas = meta
        n_local = output_tensor(out_local).shape[0]
        # the target's rows: those of this rank's output block, whatever the target's shape
        t = target_full[rows] if target_full is not None else None
        with self.loss_context() if vocab else contextlib.nullcontext():
            loss = loss_fn(out_local, t) if t is not None else loss_fn(out_local)
        f = n_local / n_global / replicas
        nat = self.__dict__.get("_native")      # torch's averaging DDP: its gradient P times
        return nat.loss_share(loss, f) if nat is not None else loss * f

    def finish_grads(self) -> None:
        """Wait for the gradient all-reduces and write the sums back. Running statistics of
        local batch norm, the traced program's and a native plan's alike, are left to their
        readers (``flush_batch_norm``; ``runtime.ops.BatchNormRuntime``, ``runtime.native``): no
        collective per step for them."""
        self.gradsync.finish()

    # ---- the model's output structure ----------------------------------------------------------
    def structured(self, out_local: torch.Tensor):
        """The traced output tensor (this rank's block) in the structure the user's model
        returns (e.g. a Hugging Face ``ModelOutput`` whose ``logits`` it is), so the user's loss
        runs unchanged; the tensor itself when the model returns a tensor."""
        return rebuild_output(self.output_spec, out_local)

    # ---- assembling full tensors (validation) -------------------------------------------------
    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter rebuilt in full on every rank (values; replicas are equal)."""
        return self._full(lambda p: p.detach())

    def full_grads(self) -> dict[str, torch.Tensor]:
        return self._full(lambda p: p.grad if p.grad is not None else torch.zeros_like(p))

    def full_buffers(self) -> dict[str, torch.Tensor]:
        """Every floating buffer rebuilt in full. A buffer used by an op whose weight is sharded
        (a channel-sharded batch norm's running stats) is valid only in each rank's slice: the
        slices are assembled like the weight's shards."""
        self.flush_batch_norm()
        out = {}
        world, rank = self.comm.world, self.comm.rank
        owner: dict[str, ParamShard] = {}
        for lay in self.graph.layers:
            dec = self.decisions[lay.index]
            for op in lay.ops:
                if op.buffers and "weight" in op.param_names:
                    sh = dec.param_shard(op, "weight")
                    for q in op.buffers.values():
                        owner[q] = sh
        for q, b in self.bufs.items():
            if not b.is_floating_point():
                continue
            sh = owner.get(q)
            if sh is None or not sh.dims:
                out[q] = b.detach().clone()
                continue
            full = torch.zeros_like(b)
            if rank == min(sh.grad_group(rank, world)):
                sl = sh.index(b.shape, rank, world)
                full[sl] = b[sl]
            out[q] = self.comm.all_reduce_(full)
        return out

    def _full(self, get: Callable[[nn.Parameter], torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for safe, p in self.params.items():
            qual = self.qualname[safe]
            t = get(p)
            w = self.whole_param(qual, t)
            out[qual] = t.clone() if w is t else w
        return out

    def whole_param(self, qual: str, t: torch.Tensor) -> torch.Tensor:
        """The single-process tensor of ``t``, this rank's shard of parameter ``qual`` (or of a
        tensor shaped like it: its gradient, an optimizer state): ``t`` itself when the plan keeps
        the parameter whole, else every shard put in place over the mesh (collective: every rank
        of the mesh calls it for the same ``qual``)."""
        sh = self.shards.get(qual, ParamShard())
        if not sh.dims:
            return t
        world, rank = self.comm.world, self.comm.rank
        shape = list(self._global_param_shape(qual, t))
        full = torch.zeros(shape, dtype=t.dtype, device=t.device)
        if rank == min(sh.grad_group(rank, world)):
            full[sh.index(shape, rank, world)] = t
        return self.comm.all_reduce_(full)

    def _global_param_shape(self, qual: str, p: torch.Tensor) -> list[int]:
        for lay in self.graph.layers:
            for op in lay.ops:
                for role, q in op.param_names.items():
                    if q == qual:
                        return list(op.params[role])
        return list(p.shape)


_FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _with_float_dtype(spec: OpSpec, params) -> OpSpec:
    """``spec`` with a floating ``dtype=`` keyword (a factory op such as ``torch.zeros(...,
    dtype=x.dtype)``, traced in the model's float32) set to the dtype the model's parameters
    have now (float64 during validation); ``spec`` itself when nothing changes."""
    want = spec.kwargs.get("dtype") if isinstance(spec.kwargs, dict) else None
    if not (isinstance(want, dict) and want.get("dtype") in _FLOAT_DTYPES):
        return spec
    run = next((str(p.dtype).replace("torch.", "") for p in params.values() if p.is_floating_point()), None)
    if run is None or run == want["dtype"]:
        return spec
    import dataclasses
    return dataclasses.replace(spec, kwargs={**spec.kwargs, "dtype": {"dtype": run}})


# ---- the model's output structure (a tensor, or e.g. a Hugging Face ModelOutput) -------------


def _sharding(obj) -> Sharding:
    """A ``self.move`` argument: a sharding's JSON, or the ``[[dim, parts], ...]`` /
    ``{"splits", "partial"}`` form code generated for a plan of schema 2 or older holds."""
    if isinstance(obj, dict) and "mesh" in obj:
        return Sharding.from_json(obj)
    if isinstance(obj, dict):
        return from_splits(obj.get("splits", ()), int(obj.get("partial", 1)))
    return from_splits(obj)


def target_rows(loss_layout: Sharding, out_shape: Sequence[int], rank: int, world: int) -> slice:
    """This rank's rows of the target, whatever its shape (``[B]`` labels, ``[B, S]`` tokens,
    ``[B, H, W]`` pixels, one value per graph or node): the target is cut along dim 0 only, as
    the output's dim 0 is under the loss layout (``out_shape``: the output's global shape). A
    vocabulary-parallel loss splits the output's last dim too: each rank of that split reads
    the same whole target rows."""
    s, e = loss_layout.local_bounds(tuple(int(n) for n in out_shape), rank, world)[0]
    return slice(s, s + e)


