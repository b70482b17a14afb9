"""The run-time half of sharded data parallelism (``autopar.decomp.fsdp``): torch's own engines.

``parallelize(model, mesh, units, tp_styles)`` applies, in torchtitan's order,

1. tensor parallelism: DTensor's ``parallelize_module`` on the mesh's tensor axis with
   ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` for the sub-modules
   ``tp_styles`` names (only ``nn.Linear`` / ``nn.Embedding`` / norms: where DTensor's styles
   match the placements; Hugging Face GPT-2's ``Conv1D`` stores its weight transposed and is not
   one of them, so a GPT-2 plan here is sharding alone);
2. activation checkpointing on every unit whose decision says ``ac`` (``checkpoint_unit``:
   ``torch.utils.checkpoint.checkpoint(forward, use_reentrant=False)`` around the unit's own
   forward, parameter names untouched), so that FSDP2's hooks, applied next, stay outside it;
3. sharding per unit: FSDP2 ``fully_shard(unit, mesh=<data axis>, reshard_after_forward=...)``
   on every unit the plan shards (level 3: reshard as decided; levels 1 and 2: kept from
   forward to backward), and ``fully_shard`` over an HSDP mesh of shard size 1 (``(dp, 1)``:
   replicate, all-reduce the gradient) on a unit the plan keeps data parallel;
4. the root: ``fully_shard(model)`` on the data axis for every parameter no unit holds
   (embeddings, final norm, head; a tied weight lands here once, shared by both users).

A plan of ZeRO-1 on DDP (every unit ``engine == DDP_ZERO``: plan-wide, ``decomp.fsdp.check_plan``)
instead gets torch's ZeRO-1: ``replicate(model)`` (composable DDP: parameter names kept, gradients
all-reduced and averaged, ``gradient_as_bucket_view``), and the optimizer must be
``make_optimizer(model, cls, **defaults)``, a ``ZeroRedundancyOptimizer`` over the data axis
(each rank holds the state of its partition of the tensors and broadcasts what it updated).

``set_microbatch(model, last)`` is gradient accumulation as the levels mean it: level-1 units
skip the reduce-scatter until the last micro-batch (they keep the whole gradient, ZeRO-1),
others reduce-scatter every micro-batch. ``check_optimizer`` refuses an optimizer that is not
elementwise: on sharded parameters it would compute another update than one process.

Gradients: FSDP2 averages over the data axis (its reduce-scatter divides by N), so the loss each
rank back-propagates is its block's mean: the mean of the means is the global mean loss.

``LiveBytes``: the peak of live tensor bytes during a step on CPU (on CUDA, the allocator's own
``max_memory_allocated``), to set beside ``decomp.fsdp.plan_memory_bytes``.

Part of the runtime: imports neither the solver nor the tracer.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..decomp.fsdp import DDP_ZERO, Sharded, TiedUnitsError, check_plan
from ..decomp.mesh import Mesh
from ..errors import AutoparError, PlanFileError
from .dtensor import device_mesh

#: optimizers whose update looks across elements (per-tensor norms, curvature): wrong on shards
NON_ELEMENTWISE = ("LBFGS", "LAMB", "Lamb", "FusedLAMB", "LARS", "Lars", "Shampoo", "Adafactor", "Muon")

TP_STYLES = ("colwise", "rowwise", "sequence")


def check_optimizer(optimizer: Any) -> None:
    """Refuse, naming it, an optimizer that is not elementwise (module docstring)."""
    _check_elementwise(type(getattr(optimizer, "optim", optimizer)).__name__)   # ZeRO-1: its local one


def _check_elementwise(name: str) -> None:
    if name in NON_ELEMENTWISE:
        raise AutoparError(f"{name} is not elementwise: on sharded parameters and optimizer state it "
                           f"computes another update than one process",
                           "use an elementwise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop)")


def make_mesh(world: int, tp: int = 1, device: str = "cpu"):
    """A ``DeviceMesh`` of the world: ("dp",) or ("dp", "tp") with the tensor axis innermost
    (consecutive ranks: inside a node, torchtitan's layout). Made by ``runtime.dtensor``."""
    if tp < 1 or world % tp:
        raise AutoparError(f"tensor axis of {tp} ranks does not divide the world of {world}",
                           "choose a tensor-parallel size that divides the world")
    if tp == 1:
        return device_mesh(Mesh.world(world, "dp"), device)
    return device_mesh(Mesh.world(world).reshape((world // tp, tp), ("dp", "tp")), device)


def _style(name: str):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    try:
        return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}[name]()
    except KeyError:
        raise AutoparError(f"unknown tensor-parallel style {name!r}", f"use one of {', '.join(TP_STYLES)}") from None


def check_tp_styles(model: nn.Module, tp_styles: Mapping[str, str]) -> None:
    """Refuse a style on a module DTensor's styles do not fit (e.g. GPT-2's ``Conv1D``)."""
    mods = dict(model.named_modules())
    for path, style in tp_styles.items():
        m = mods.get(path)
        if m is None:
            raise AutoparError(f"tensor-parallel style for {path!r}: the model has no such module",
                               "name modules as model.named_modules() does")
        ok = (nn.Linear, nn.Embedding) if style != "sequence" else (nn.LayerNorm, nn.RMSNorm, nn.Dropout)
        if not isinstance(m, ok):
            raise AutoparError(f"{path} is a {type(m).__name__}: DTensor's {style} style applies to "
                               f"{' / '.join(c.__name__ for c in ok)} only",
                               "keep this unit data parallel or sharded without tensor parallelism")


ZERO3 = "zero3"


def checkpoint_unit(module: nn.Module) -> nn.Module:
    """Activation checkpointing of ``module`` in place (``decomp.fsdp``, "Activation
    checkpointing"): its forward runs under ``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)``, which keeps only the forward's inputs and runs it again in backward
    (the RNG state restored, so dropout draws the same mask). The instance's ``forward`` is
    replaced (not the module: ``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module``
    into every parameter name); hooks registered on the module (FSDP2's gather and reshard) run
    around it, outside the checkpoint, as with torchtitan's wrapper."""
    from torch.utils.checkpoint import checkpoint
    if getattr(module, "_autopar_ac", False):
        return module
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    module.forward = forward
    module._autopar_ac = True                  # noqa: SLF001
    return module


def check_tied(model: nn.Module, units: Iterable[str]) -> None:
    """Refuse, naming both, a parameter shared by two units (tied weights): FSDP2 manages a
    parameter in the one unit that registers it, and the other would use it unmanaged. A tie
    inside one unit or the root is fine (GPT-2's wte / lm_head are both the root's)."""
    paths = sorted((u for u in units if u), key=len, reverse=True)

    def owner(q: str) -> str:
        return next((u for u in paths if q.startswith(u + ".")), "")
    seen: dict[int, tuple[str, str]] = {}
    for q, p in model.named_parameters(remove_duplicate=False):
        u = owner(q)
        if id(p) in seen and seen[id(p)][1] != u:
            q0, u0 = seen[id(p)]
            raise TiedUnitsError.naming(q0, u0, q, u)
        seen.setdefault(id(p), (q, u))


def parallelize(model: nn.Module, mesh, units: Mapping[str, Sharded | None],
                tp_styles: Mapping[str, str] | None = None, root: Sharded | None | str = ZERO3) -> nn.Module:
    """Apply the plan to ``model`` in place and return it (module docstring). ``mesh``: a
    ``DeviceMesh`` with a "dp" axis and, with ``tp_styles``, a "tp" axis; ``units``: module path
    -> its decision (None: data parallel); ``root``: the root's (default ZeRO-3; None: data
    parallel)."""
    tp_styles = dict(tp_styles or {})
    check_tied(model, units)
    names = mesh.mesh_dim_names or ()
    if tp_styles:
        if "tp" not in names:
            raise AutoparError("tensor-parallel styles given but the mesh has no 'tp' axis",
                               "make the mesh with make_mesh(world, tp)")
        check_tp_styles(model, tp_styles)
        from torch.distributed.tensor.parallel import parallelize_module
        parallelize_module(model, mesh["tp"], {k: _style(v) for k, v in tp_styles.items()})
    dp_mesh = mesh["dp"] if "tp" in names else mesh
    root_dec = (Sharded(3, True, dp_mesh.size()) if root == ZERO3 else root)
    if root_dec is not None and root_dec.ac:
        raise AutoparError("activation checkpointing on the root (the whole model) keeps nothing less",
                           "checkpoint units (blocks) only; a plan file was edited by hand?")
    why = check_plan([*units.values(), root_dec])
    if why is not None:
        raise AutoparError(why, "re-plan; a plan file was edited by hand?")
    if root_dec is not None and root_dec.engine == DDP_ZERO:
        return _zero1(model, dp_mesh, dict(units), root_dec, tp_styles)
    mods = dict(model.named_modules())
    from torch.distributed.fsdp import fully_shard
    replicate_mesh = None
    for path, s in units.items():
        m = mods.get(path)
        if m is None or path == "":
            raise AutoparError(f"unit {path!r} is not a sub-module of the model", "name units as named_modules() does")
        if s is None:
            if replicate_mesh is None:
                replicate_mesh = _replicate_mesh(dp_mesh)
            fully_shard(m, mesh=replicate_mesh)
            continue
        why = s.check(microbatches=2)
        if why is not None:
            raise AutoparError(f"unit {path}: {s}: {why}", "re-plan; a plan file was edited by hand?")
        if s.dp != dp_mesh.size():
            raise AutoparError(f"unit {path} is sharded over {s.dp} ranks, the mesh's data axis has {dp_mesh.size()}",
                               "execute the plan at the world size it was made for")
        if s.ac:
            checkpoint_unit(m)
        fully_shard(m, mesh=dp_mesh, reshard_after_forward=(s.level == 3 and s.reshard_after_forward))
    if root is None:
        fully_shard(model, mesh=replicate_mesh if replicate_mesh is not None else _replicate_mesh(dp_mesh))
    else:
        r = Sharded(3, True, dp_mesh.size()) if root == ZERO3 else root
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=(r.level == 3 and r.reshard_after_forward))
    model._autopar_units = dict(units)       # noqa: SLF001 - read by set_microbatch
    return model


def _zero1(model: nn.Module, dp_mesh, units, root: Sharded, tp_styles) -> nn.Module:
    """torch's ZeRO-1 (module docstring): DDP in place; ``make_optimizer`` builds the optimizer."""
    if tp_styles:
        raise AutoparError("ZeRO-1 on DDP with tensor-parallel styles", "use FSDP2 levels 2 or 3 with tensor parallelism")
    for path, s in [*units.items(), ("", root)]:
        why = s.check()
        if why is not None:
            raise AutoparError(f"unit {path or '<root>'}: {s}: {why}", "re-plan; a plan file was edited by hand?")
        if s.dp != dp_mesh.size():
            raise AutoparError(f"unit {path or '<root>'} is sharded over {s.dp} ranks, the mesh's data axis has "
                               f"{dp_mesh.size()}", "execute the plan at the world size it was made for")
    from torch.distributed._composable import replicate
    replicate(model, process_group=dp_mesh.get_group(), gradient_as_bucket_view=True)
    for p in model.parameters():
        p._autopar_zero1 = True              # noqa: SLF001 - read by the optimizer pre-hook
    model._autopar_units = {**units, "": root}   # noqa: SLF001
    model._autopar_zero1_group = dp_mesh.get_group()  # noqa: SLF001
    return model


class Zero1OptimizerError(AutoparError):
    """An optimizer over a ZeRO-1 model that is not its ``ZeroRedundancyOptimizer``: it would keep
    the whole optimizer state on every rank (the function is the same, the plan's memory is not)."""


def is_zero1(model: nn.Module) -> bool:
    """Whether ``model`` was parallelized as ZeRO-1 on DDP (module docstring)."""
    return getattr(model, "_autopar_zero1_group", None) is not None


def make_optimizer(model: nn.Module, optimizer_class, **defaults):
    """The optimizer the plan asks for over ``model.parameters()``: on a ZeRO-1 model torch's
    ``ZeroRedundancyOptimizer`` (its state partitioned over the data axis), else
    ``optimizer_class`` itself. Non-elementwise optimizers are refused (``check_optimizer``)."""
    _check_elementwise(optimizer_class.__name__)
    if not is_zero1(model):
        return optimizer_class(model.parameters(), **defaults)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class,
                                  process_group=model._autopar_zero1_group, **defaults)  # noqa: SLF001
    opt.optim._autopar_zero1_local = True       # noqa: SLF001 - its own partition: allowed by the hook
    return opt


def check_zero1_optimizer(optimizer) -> None:
    """Refuse (``Zero1OptimizerError``) a plain optimizer over a ZeRO-1 model's parameters."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer) or getattr(optimizer, "_autopar_zero1_local", False):
        return
    if any(getattr(p, "_autopar_zero1", False) for g in optimizer.param_groups for p in g["params"]):
        raise Zero1OptimizerError(f"{type(optimizer).__name__} over a ZeRO-1 model keeps the whole optimizer state "
                                  "on every rank: the plan shards it", "build the optimizer with "
                                  "autopar.runtime.fsdp.make_optimizer(model, torch.optim.AdamW, lr=...) "
                                  "(or model.make_optimizer(...) after autopar.parallelize)")


def _replicate_mesh(dp_mesh):
    """The HSDP mesh (dp, 1): FSDP2 replicates over the first axis and shards over a single rank,
    i.e. data parallelism (gradients all-reduced) inside a sharded plan."""
    ranks = tuple(int(r) for r in dp_mesh.mesh.reshape(-1).tolist())
    return device_mesh(Mesh(ranks, (len(ranks), 1), ("replicate", "shard")), dp_mesh.device_type)


def set_microbatch(model: nn.Module, last: bool) -> None:
    """Gradient accumulation by levels (module docstring): before each micro-batch's backward,
    ``last`` True for the final one of the step."""
    mods = dict(model.named_modules())
    for path, s in getattr(model, "_autopar_units", {}).items():
        if s is not None and s.level == 1 and s.engine != DDP_ZERO:
            mods[path].set_requires_gradient_sync(last, recurse=False)
            mods[path].set_reshard_after_backward(last, recurse=False)


def sharded_record(plan) -> dict[str, Any]:
    """plan.json's ``runtime.sharded`` (``planner.strategies.sharded``), checked before any
    process starts: a ``PlanFileError`` naming the field when absent or not runnable."""
    rt = plan.runtime
    if rt is None or rt.expected not in ("fsdp", "fsdp+traced"):
        raise PlanFileError("not a sharded plan (runtime.expected is not fsdp)", "plan with autopar plan")
    rec = dict(rt.extra).get("sharded")
    if not isinstance(rec, dict) or "units" not in rec:
        raise PlanFileError("plan.json runtime.sharded is missing or has no units", "re-plan with autopar plan")
    if rt.expected != "fsdp" or rec.get("base") != "native":
        raise PlanFileError("this plan shards the state of an op-by-op plan: priced, but not executable yet "
                            "(FSDP2 runs the user's module under data parallelism only)",
                            "raise --memory-limit so that a sharded plan over data parallelism fits, or add ranks")
    world = int(rec["mesh"]["dp"]) * int(rec["mesh"].get("tp", 1))
    if world != plan.world_size:
        raise PlanFileError(f"runtime.sharded is for {world} ranks, the plan for {plan.world_size}",
                            "re-plan: the file was edited by hand?")
    return rec


def mesh_of(rec: dict[str, Any]) -> tuple[int, dict[str, str]]:
    """The tensor axis (1: none) and the DTensor style per module of a ``runtime.sharded`` record."""
    return int(rec["mesh"].get("tp", 1)), dict(rec.get("tp_styles") or {})


def units_of(rec: dict[str, Any]) -> tuple[dict[str, Sharded | None], Sharded | None]:
    units = {k: (Sharded.from_json(v) if v is not None else None) for k, v in rec["units"].items()}
    units[""] = Sharded.from_json(rec["root"]) if rec.get("root") is not None else None
    return units, units[""]


# ---- measured memory ----------------------------------------------------------------------------

class LiveBytes:
    """Peak bytes of live tensor storage while active (a ``TorchDispatchMode``): every tensor an
    op returns is watched (weakly) together with ``also`` (parameters, gradients, optimizer
    state alive before the step); after each op the live storages' current sizes are summed, so
    that FSDP2's freeing of gathered parameters by ``untyped_storage().resize_(0)`` counts.
    Slow (a sum over the watched storages per op): for a measured step, not a timed one."""

    def __init__(self, also: Iterable[torch.Tensor] = ()) -> None:
        self._refs: dict[int, weakref.ref] = {}
        self.peak_bytes = 0
        self.start_bytes = 0
        for t in also:
            self._watch(t)

    def _watch(self, t: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor
        if isinstance(t, DTensor):
            t = t._local_tensor                # noqa: SLF001
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        r = self._refs.get(id(t))
        if r is not None and r() is t:
            return
        try:       # a new tensor at the id of a dead one (ids are reused): watch the new one
            self._refs[id(t)] = weakref.ref(t)
        except TypeError:
            pass

    def live_bytes(self) -> int:
        seen: dict[int, int] = {}
        dead = []
        for k, r in self._refs.items():
            t = r()
            if t is None:
                dead.append(k)
                continue
            try:       # a storage freed under a live wrapper (DTensor's redistribute on CPU) counts nothing
                st = t.untyped_storage()
                seen[st.data_ptr() or id(st)] = st.nbytes()
            except (RuntimeError, NotImplementedError):
                continue
        for k in dead:
            del self._refs[k]
        return sum(seen.values())

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        outer._watch(t)
                outer.peak_bytes = max(outer.peak_bytes, outer.live_bytes())
                return out

        self.start_bytes = self.live_bytes()
        self.peak_bytes = self.start_bytes
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())
        return False


def state_tensors(model: nn.Module, optimizer: Any = None) -> list[torch.Tensor]:
    """Every parameter, gradient, buffer and optimizer-state tensor (what ``LiveBytes`` watches
    from before the step)."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    out.extend(model.buffers())
    if optimizer is not None:
        for st in optimizer.state.values():
            out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on several meshes (tensor-parallel units
    on (dp, tp), the root on dp: torch's own stacks the norms and refuses mixed meshes): each
    gradient's norm made whole (``full_tensor``, one reduction per gradient), the global norm
    from them, then the same scale ``min(1, max_norm / (norm + 1e-6))`` on every gradient."""
    import math

    from torch.distributed.tensor import DTensor
    grads = [p.grad for p in parameters if p.grad is not None]
    norms = []
    for g in grads:
        n = torch.linalg.vector_norm(g, norm_type)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).to(torch.float64))
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    t = torch.stack(norms)
    total = t.max() if math.isinf(norm_type) else t.pow(norm_type).sum().pow(1.0 / norm_type)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype).item() if isinstance(g, DTensor) else coef.to(g.dtype))
    return total
