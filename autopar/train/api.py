"""``autopar.parallelize(model, "plan.json")``: the planned model as a trainable module.

The shape of ``torch.distributed.fsdp.fully_shard`` / ``parallelize_module``: the user builds
the single-process model on every rank (same seed; rank 0's values are broadcast anyway, as DDP
does), calls ``parallelize`` under an initialised process group and gets back a module that
holds only this rank's shard of every parameter (``ParamShard``) and a copy of every buffer.
Then, in the user's own loop::

    dmodel = autopar.parallelize(model, "plan.json")
    opt = torch.optim.AdamW(dmodel.parameters(), lr=1e-3)      # any elementwise optimizer
    for inputs, target in autopar.train.plan_loader(dataset, dmodel, seed=0):  # this rank's share
        opt.zero_grad()
        loss = dmodel.loss(inputs, target)       # or: dmodel.reduce_loss(my_loss(dmodel(*inputs), target))
        loss.backward()                          # gradients are summed over replicas at its end
        autopar.train.clip_grad_norm_(dmodel, 1.0)
        opt.step()

Loss convention. Each rank computes the user's per-sample *mean* loss on its block of samples
of the output (the plan's loss layout, ``DistModel.loss_layout``); ``reduce_loss`` returns a
tensor whose **value** is the single-process loss (the shares summed over the mesh) and whose
**gradient** is this rank's share ``L_r = loss_r * n_r / N / replicas`` (the runtime's gradient
convention: ``sum_r L_r = L``). ``loss.item()`` is therefore the same number on every rank and
in one process, and ``loss.backward()`` back-propagates exactly the share.

Gradient synchronisation. The runtime's ``GradSync`` all-reduces each gradient over the ranks
holding the same shard, overlapped with backward; ``finish_grads`` (writing the sums back) is
queued to run when backward ends (as DDP and FSDP2 do), so ``optimizer.step()`` sees summed
gradients without any extra call. Gradient accumulation over several backwards, as with
FSDP2: ``dmodel.set_requires_gradient_sync(False)`` for all micro-batches but the last (their
gradients stay local partial sums and add up), ``True`` for the last, whose backward sums the
accumulated gradients once.

Eval mode. ``dmodel.eval()`` runs batch norm on its running statistics and dropout as the
identity, whatever mode the model was traced in: each op's ``training`` argument follows the
module's mode (``_mode_spec``).

This module is part of the runtime side: it imports ``autopar.runtime``, ``autopar.artifacts``
and ``autopar.decomp``, never the solver, tracer or cost model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..artifacts import Plan, load_plan
from ..decomp.base import ParamShard
from ..errors import AutoparError, PlanFileError
from ..runtime.native import use_engine
from .mismatch import ModelMismatch, first_of, mismatches  # noqa: F401  (ModelMismatch re-exported)
from .stages import PipelineModule
from ..io import sha256_file
from ..modelfile import default_loss, load_model_file, model_env
from ..runtime.comm import Comm
from ..runtime.launch import init_from_env
from ..runtime.model import _safe
from .checkpoint import load_sharded_state_dict, sharded_state_dict

class _GlobalLoss(torch.autograd.Function):
    """forward: the sum of every rank's share over the mesh (the single-process loss);
    backward: the incoming gradient times ``grad_scale``: 1, so that each rank back-propagates
    its own share (the sum convention of ``autopar.decomp.base``), or P on torch's averaging
    DDP engine (``runtime.native``, "Engines"), exact for P a power of two."""

    @staticmethod
    def forward(ctx, share, comm, grad_scale=1):
        ctx.grad_scale = grad_scale
        total = share.detach().clone()
        comm.all_reduce_(total)
        return total

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.grad_scale == 1 else g * ctx.grad_scale), None, None


class ParallelModule:
    """Mixin added to a plan's generated ``DistModel`` class by ``parallelize`` (like
    ``fully_shard`` turns a module into an ``FSDPModule``). Everything the user's loop needs:
    ``forward`` on this rank's inputs, ``loss`` / ``reduce_loss``, ``reduce_sum`` for metrics,
    ``train``/``eval``, and what checkpoints and clipping use (``plan``, ``param_shard``,
    ``local_params``)."""

    plan: Plan
    loss_fn_default: Callable[..., torch.Tensor]

    def _setup_train(self, plan: Plan, loss_fn: Callable[..., torch.Tensor],
                     target_shape: tuple[int, ...] | None = None) -> None:
        self.plan = plan
        self.loss_fn_default = loss_fn
        #: the global target the plan's loss was traced with (``train.data.BatchSharding``)
        self.target_shape = target_shape
        self._grads_pending = False
        self._specs_train = dict(self.spec)
        self._specs_eval = {name: _mode_spec(op, False) for name, op in self.spec.items()}

    # ---- modes -------------------------------------------------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        self.spec = self._specs_train if mode else self._specs_eval
        return self

    def _apply(self, fn, *args, **kwargs):
        # ``.to()`` / ``.double()`` replace buffer tensors; the runtime reads them through
        # ``self.bufs``, which must follow (parameters are converted in place)
        out = super()._apply(fn, *args, **kwargs)
        self.bufs = {q: getattr(self, _safe(q)) for q in self.bufs}
        return out

    # ---- forward and loss --------------------------------------------------------------------
    def forward(self, *inputs: torch.Tensor):
        """This rank's forward on its ``inputs``: what the user's model returns (a tensor, a
        tuple, a dict, a Hugging Face ``ModelOutput``), its output tensor this rank's block,
        under every runtime (the traced program rebuilds the structure, ``DistModel.structured``;
        a native plan runs the module itself)."""
        out = super().forward(*inputs)
        nat = self.__dict__.get("_native")
        if nat is not None and nat.ddp is not None:
            return out       # DDP's reducer writes the gradients in backward: nothing to queue
        leaves = [t for t in _tensor_leaves(out) if t.requires_grad]
        if torch.is_grad_enabled() and leaves and self.comm.world > 1:
            # whichever tensor the loss reads, backward through it queues the gradient sums
            # (``finish_grads`` runs once per backward however many hooks fire)
            self._grads_pending = True
            for t in leaves:
                t.register_hook(self._queue_finish)
        return out

    def _queue_finish(self, grad):
        # runs when backward reaches the output; the callback runs when that backward ends
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_grads)
        return grad

    def finish_grads(self) -> None:
        """Wait for the gradient all-reduces and write the sums back (once per backward;
        queued automatically by ``forward``, a no-op when called again). With gradient sync
        off, the all-reduces are discarded: the gradients stay this rank's partial sums."""
        if self.comm.world == 1 or not self._grads_pending:
            return
        self._grads_pending = False
        if getattr(self, "_sync_grads", True):
            super().finish_grads()
            return
        # every rank sends the same all-reduces (those not launched during backward now, in
        # bucket order: ``GradSync``), the sums dropped
        self.gradsync.finish(write_back=False)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """FSDP2's switch for gradient accumulation (module docstring). The skipped
        micro-batches still send their all-reduces (GradSync starts them during backward) and
        their results are dropped: correct, not yet cheaper."""
        self._sync_grads = bool(requires_gradient_sync)

    def reduce_loss(self, loss_local: torch.Tensor) -> torch.Tensor:
        """The single-process loss from this rank's per-sample mean loss over its output block:
        value summed over the mesh, gradient this rank's share (module docstring)."""
        f = self.__dict__.get("_share_factor")
        if f is None:       # once: the layouts are fixed, and finding them scans the graph
            lay = self.loss_layout()
            shape = self.graph.value_shape(self.graph.output)
            n_local = lay.local_shape(shape, self.comm.rank, self.comm.world)[0]
            f = self.__dict__["_share_factor"] = n_local / shape[0] / self.loss_replicas()
        share = loss_local * f
        if self.comm.world == 1:
            return share
        nat = self.__dict__.get("_native")
        return _GlobalLoss.apply(share, self.comm, nat.grad_scale if nat is not None else 1)

    def loss(self, inputs: torch.Tensor | Sequence[torch.Tensor], target: torch.Tensor | None = None,
             loss_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        """Forward on this rank's ``inputs`` (``shard_batch`` / ``plan_loader``) and the loss on
        this rank's ``target`` block; ``loss_fn`` (default: the model file's ``loss_fn``, else
        autopar's default loss) must be a per-sample mean."""
        xs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        out = self(*xs)                 # the model's own structure: the loss reads what it reads
        fn = loss_fn or self.loss_fn_default
        with self.loss_context():      # a vocabulary-parallel loss: F.cross_entropy on the block
            loss = fn(out, target) if target is not None else fn(out)
        return self.reduce_loss(loss)

    def reduce_sum(self, local: torch.Tensor | float) -> torch.Tensor:
        """Sum of a per-rank metric computed on this rank's output block (e.g. the number of
        correct predictions), each sample counted once: replicas of a block are divided out."""
        t = torch.as_tensor(local, dtype=torch.float64, device=self.comm.device).clone()
        t = t / self.loss_layout().replicas(self.comm.world)
        return self.comm.all_reduce_(t)

    # ---- state dicts (FSDP2's shape: single-process names, sharded values) --------------------
    def state_dict(self, *args, **kwargs) -> dict[str, Any]:
        """Single-process names -> this rank's part: ready for ``torch.distributed.checkpoint``
        (``dcp.save(dmodel.state_dict(), ...)``; ``checkpoint.sharded_state_dict``)."""
        return sharded_state_dict(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """After ``dcp.load(sd, ...)`` into ``sd = dmodel.state_dict()``, or with a full
        single-process state dict: every rank gets its part (collective)."""
        load_sharded_state_dict(self, state_dict)
        return torch.nn.modules.module._IncompatibleKeys([], [])

    # ---- what checkpoints and clipping use ----------------------------------------------------
    @property
    def engine(self) -> str:
        """What runs this rank's steps: "torch-ddp" or "autopar-native" (a pure data-parallel
        plan, ``runtime.native``: "Engines"), else "autopar-traced" (the program op by op)."""
        nat = self.__dict__.get("_native")
        return nat.engine if nat is not None else "autopar-traced"

    @property
    def batch_size(self) -> int:
        """The global batch the plan was made for (every step must use it)."""
        return int(self.graph.value_shape(self.graph.inputs[0].name)[0]) if self.graph.inputs else \
            int(self.plan.model.batch_size)

    def local_params(self) -> dict[str, nn.Parameter]:
        """This rank's parameter (shard) of every qualified name."""
        return {self.qualname[s]: p for s, p in self.params.items()}

    def param_shard(self, qual: str) -> ParamShard:
        return self.shards.get(qual, ParamShard())

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full (single-process) shape of every parameter."""
        return {q: tuple(self._global_param_shape(q, p)) for q, p in self.local_params().items()}

    def shard_owner(self, qual: str) -> bool:
        """True on the one rank that speaks for this rank's shard of ``qual`` (the lowest of
        the ranks holding the same shard): norms and checkpoints count each shard once."""
        grp = self.param_shard(qual).grad_group(self.comm.rank, self.comm.world)
        return self.comm.rank == min(grp)


def _tensor_leaves(out: Any) -> list[torch.Tensor]:
    """Every tensor of a model's output (a tensor, or the leaves of a tuple, dict or
    ``ModelOutput``; other objects, such as a key/value cache, hold none that count)."""
    if isinstance(out, torch.Tensor):
        return [out]
    import torch.utils._pytree as pytree
    return [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]


def _mode_spec(op, training: bool):
    """``op`` with its ``training`` argument set: batch norm (arg 5) uses running statistics,
    dropout (arg 2) is the identity when ``training`` is False."""
    if op.kind == "batch_norm" and len(op.args) > 5:
        args = list(op.args)
        args[5] = training
        return dataclasses.replace(op, args=args, attrs={**op.attrs, "training": training})
    if op.kind == "dropout" and len(op.args) > 2:
        args = list(op.args)
        args[2] = training
        return dataclasses.replace(op, args=args, attrs={**op.attrs, "training": training})
    return op


# ---------------------------------------------------------------------------------------------
# parallelize
# ---------------------------------------------------------------------------------------------
def _load_generated_class(plan: Plan, plan_path: Path):
    gen = plan_path.parent / plan.generated
    if not plan.generated or not gen.is_file():
        raise PlanFileError(f"the generated module {gen} of plan {plan_path} is missing",
                            "re-plan (autopar plan) to write it beside plan.json")
    name = f"autopar_generated_{abs(hash(str(gen.resolve()))) % 10**8}"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, gen)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    cls = getattr(mod, "PlannedModel", None)
    if cls is None:
        raise PlanFileError(f"{gen} defines no PlannedModel", "re-plan to regenerate it")
    return cls


def check_model(model: nn.Module, plan: Plan) -> None:
    """The model's parameter names and shapes must be those the plan was traced with
    (``ModelMismatch`` lists the first mismatches)."""
    want: dict[str, tuple[int, ...]] = {}
    for lay in plan.graph().layers:
        for op in lay.ops:
            for role, q in op.param_names.items():
                want[q] = tuple(op.params[role])
    have = {q: tuple(p.shape) for q, p in model.named_parameters()}
    bad = mismatches(want, have)
    if bad:
        raise ModelMismatch(f"the model does not match the plan's ({plan.model.name}): "
                            + first_of(bad),
                            "build the model the plan was made from, or re-plan for this one")


def _model_file_loss(plan: Plan, plan_path: Path) -> tuple[Callable[..., torch.Tensor], tuple[int, ...] | None]:
    """(the model file's loss, the shape of its ``example_targets`` at the plan's batch size,
    made on the meta device: what the plan's loss was traced with; None when unknown)."""
    mp = plan.model_file(plan_path)
    if mp.is_file():
        try:
            mf = load_model_file(mp, env=plan.model_env())
        except AutoparError:
            return default_loss, None
        shape = None
        try:
            with torch.device("meta"):
                t = mf.example_targets(int(plan.model.batch_size or plan.graph().batch_size))
            shape = tuple(int(n) for n in t.shape) if isinstance(t, torch.Tensor) else None
        except Exception:  # noqa: BLE001 - no example_targets, or one that needs real tensors
            shape = None
        return mf.loss_fn(), shape
    return default_loss, None


def check_model_file(plan: Plan, plan_path: Path) -> None:
    """The plan's model file, where it still exists, must be unchanged since planning."""
    mp = plan.model_file(plan_path)
    if plan.model.sha256 and mp.is_file() and sha256_file(mp) != plan.model.sha256:
        raise PlanFileError(f"the model file {mp} changed since plan {plan_path} was made "
                            f"(sha256 differs)", "re-plan it: autopar plan "
                            f"{mp} --world-size {plan.world_size}")


def parallelize(model: nn.Module, plan: str | Path, *, comm=None, sync_module_states: bool = True,
                loss_fn: Callable[..., torch.Tensor] | None = None,
                bucket_cap_bytes: int | None = None, module_class: type | None = None,
                engine: str | None = None) -> nn.Module:
    """This rank's part of ``model`` under the plan in ``plan`` (a plan.json path).

    Collective: every rank of the process group calls it. ``model`` is the single-process
    model built on every rank; with ``sync_module_states`` (default, as DDP) rank 0's
    parameters and buffers are broadcast first, so ranks need not share a seed. The returned
    module (a ``ParallelModule`` subclass of the plan's generated class) holds only this
    rank's shards; ``model`` can be dropped. Errors say what to do: no process group, a plan
    for another world size, a model file changed since planning, or a model whose parameter
    names or shapes are not the plan's. ``module_class``: the plan's generated class when the
    caller has it (the generated module's own ``main``); else it is imported from the file
    beside the plan. ``engine``: a pure data-parallel plan's engine ("torch-ddp", "autopar" or
    "auto", ``runtime.native``'s "Engines"; None: as ``AUTOPAR_ENGINE`` says, default "auto");
    the module's ``engine`` says which runs.
    """
    import torch.distributed as dist

    plan_path = Path(plan)
    p = load_plan(plan_path)
    initialised = dist.is_available() and dist.is_initialized()
    if comm is None:
        if not initialised and p.world_size > 1:
            raise AutoparError(f"autopar.parallelize needs a process group: plan {plan_path} runs on "
                               f"{p.world_size} ranks and torch.distributed is not initialised",
                               f"start the script with torchrun --nproc-per-node {p.world_size} and call "
                               f"autopar.train.init_distributed({str(plan_path)!r}) (or "
                               f"torch.distributed.init_process_group) before parallelize")
        comm = Comm.from_env()
    if comm.world != p.world_size:
        raise PlanFileError(f"plan {plan_path} was made for world size {p.world_size}, this process "
                            f"group has {comm.world} ranks",
                            f"run with {p.world_size} processes, or re-plan: autopar plan MODEL.py "
                            f"--world-size {comm.world}")
    check_model_file(p, plan_path)
    check_model(model, p)
    if sync_module_states and comm.world > 1:
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=comm.global_rank(0), group=comm.mesh_group)
    if p.runtime is not None and p.runtime.expected == "stages":      # pipeline stages (issue 41)
        with model_env(p.model_env()):
            mf = load_model_file(p.model_file(plan_path))
        with torch.random.fork_rng(devices=[]):   # the cut shapes only: the user's random stream stays as it was
            x = mf.example_inputs(p.model.batch_size)[0]
        return PipelineModule(model, p, loss_fn or mf.loss_fn(), x)
    cls = module_class or _load_generated_class(p, plan_path)
    train_cls = type(f"Parallel{cls.__name__}", (ParallelModule, cls), {"__module__": __name__})
    kw = {} if bucket_cap_bytes is None else {"bucket_cap_bytes": bucket_cap_bytes}
    with use_engine(engine):
        dm = train_cls(p, model, comm, **kw)
    file_loss, target_shape = _model_file_loss(p, plan_path)
    # a loss of the caller's own may read targets of another shape than the model file's
    dm._setup_train(p, loss_fn or file_loss, target_shape if loss_fn is None else None)
    dm.train(model.training)
    return dm


def init_distributed(plan: str | Path, backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment with the plan's rank placement
    (the process torchrun calls RANK p joins as the plan's logical rank); returns (rank, world).
    A no-op returning the current (rank, world) when a group exists."""
    p = load_plan(plan)
    return init_from_env(backend=backend, timeout_s=timeout_s, placement=p.placement())
