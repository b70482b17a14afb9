"""Load a user's model file: ``build_model()``, ``example_inputs(batch_size)`` and optionally
``loss_fn(output, target)`` and ``example_targets(batch_size)``.

Default loss when the file defines none (documented in the README), on the output tensor (the
one tensor of a returned structure such as a ``ModelOutput``): with targets whose dtype is
integer and a 2-D output, cross-entropy (mean); with floating targets, mean squared error
(mean); with no targets, the mean of the squared output. All are per-sample means, which the
distributed loss share (``DistModel.local_loss``) requires.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from .errors import ModelFileError


@dataclass
class ModelFile:
    path: Path
    module: ModuleType

    @property
    def name(self) -> str:
        return self.path.stem

    def build_model(self):
        return self.module.build_model()

    def example_inputs(self, batch_size: int) -> tuple:
        xs = self.module.example_inputs(batch_size)
        return tuple(xs) if isinstance(xs, (tuple, list)) else (xs,)

    def example_targets(self, batch_size: int):
        fn = getattr(self.module, "example_targets", None)
        return fn(batch_size) if fn is not None else None

    @property
    def has_loss(self) -> bool:
        return hasattr(self.module, "loss_fn")

    def loss_fn(self) -> Callable[..., Any]:
        fn = getattr(self.module, "loss_fn", None)
        return fn if fn is not None else default_loss

    def default_batch_size(self) -> int | None:
        return getattr(self.module, "DEFAULT_BATCH_SIZE", None)

    def ddp_shard(self):
        """``ddp_shard(inputs, targets, rank, world) -> (inputs, targets, model)``, optional: how a
        data-parallel user splits a batch whose inputs are not samples along dim 0 (a PyG batch:
        graphs concatenated), and the model each rank then builds. The DDP baseline of
        ``autopar execute`` uses it; without it, such a batch has no DDP baseline."""
        return getattr(self.module, "ddp_shard", None)

    def planning_units(self) -> list[str]:
        """``PLANNING_UNITS``: module paths or fnmatch patterns whose whole sub-graph is planned
        as one unit (``autopar.trace.units``); none by default."""
        units = getattr(self.module, "PLANNING_UNITS", None) or []
        if isinstance(units, str) or not all(isinstance(u, str) for u in units):
            raise ModelFileError(f"PLANNING_UNITS in {self.path.name} must be a list of module paths",
                                 'write e.g. PLANNING_UNITS = ["blocks.*.attn"]')
        return list(units)


def default_loss(output, target=None):
    import torch
    import torch.nn.functional as F
    if not isinstance(output, torch.Tensor):   # a structure (ModelOutput): its one tensor
        tensors = [v for v in split_output(output)[1] if isinstance(v, torch.Tensor)]
        if len(tensors) != 1:
            raise ModelFileError(f"the model returns {type(output).__name__} holding {len(tensors)} tensors "
                                 "and the model file defines no loss_fn",
                                 "define loss_fn(output, target) reading the tensor to train (e.g. output.logits)")
        output = tensors[0]
    if target is None:
        out = output if output.is_floating_point() else output.float()
        return out.pow(2).mean()
    if not target.dtype.is_floating_point and output.dim() == 2:
        return F.cross_entropy(output, target)
    return F.mse_loss(output, target)


class _DeferredModule:
    """A model file not imported yet (``load_model_file(..., lazy=True)``): top-level names
    assigned a literal (``DEFAULT_BATCH_SIZE = 64``, ``PLANNING_UNITS = [...]``) are read from
    the source; a name the file never assigns is absent; anything else imports the file (and
    so torch) on first use. Re-planning from the trace cache then never imports torch."""

    def __init__(self, path: Path, literals: dict[str, Any], assigned: set[str]) -> None:
        self._path, self._literals, self._assigned, self._real = path, literals, assigned, None

    def _load(self) -> ModuleType:
        if self._real is None:
            self._real = load_model_file(self._path).module
        return self._real

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._real is None:
            if name in self._literals:
                return self._literals[name]
            if name not in self._assigned:
                raise AttributeError(name)
        return getattr(self._load(), name)


def _peek(path: Path) -> _DeferredModule | None:
    """The deferred module of ``path``, or None when its source cannot be read statically
    (star imports, syntax errors: the file is then imported as usual)."""
    import ast
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    literals: dict[str, Any] = {}
    assigned: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            assigned.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            assigned.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    assigned.add(t.id)
                    try:
                        literals[t.id] = ast.literal_eval(node.value) if node.value is not None else None
                    except ValueError:
                        literals.pop(t.id, None)
                else:
                    return None
        elif not isinstance(node, (ast.Expr, ast.Pass)):
            return None              # if/for/try at top level: names not known statically
    if not {"build_model", "example_inputs"} <= assigned:
        return None                  # the import path names what is missing
    return _DeferredModule(path, literals, assigned)


@contextlib.contextmanager
def model_env(env: dict[str, Any] | None):
    """Environment variables a model file reads (its sizes: ``Plan.model_env``, a benchmark's
    variant) set for the ``with`` block, then restored as they were; processes started
    inside it inherit them."""
    import os
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_model_file(path: str | Path, lazy: bool = False, env: dict[str, str] | None = None) -> ModelFile:
    """Import ``path`` as a module and check its entry points (ModelFileError otherwise).
    ``lazy``: defer the import until something beyond literal top-level names is needed
    (``_DeferredModule``; the planner re-planning from the trace cache needs none). ``env``:
    environment variables set while the file is imported, then restored (a padded GNN plan's
    sizes, ``Plan.model_env``; ignored with ``lazy``)."""
    if env and not lazy:
        with model_env(env):
            return load_model_file(path)
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}",
                             "give the path of a .py file that defines build_model() and example_inputs(batch_size)")
    if lazy:
        deferred = _peek(path)
        if deferred is not None:
            return ModelFile(path, deferred)  # type: ignore[arg-type]
    name = f"autopar_user_model_{abs(hash(str(path.resolve()))) % 10**8}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"cannot import {path}: not a Python file", "give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code failed: say where
        import traceback
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb)
                      if Path(f.filename).resolve() == path.resolve()), str(path))
        sys.modules.pop(name, None)
        raise ModelFileError(f"model file {path} does not import: {e.__class__.__name__}: {e} (at {where})",
                             "fix the error in the model file") from None
    missing = [f for f in ("build_model", "example_inputs") if not callable(getattr(module, f, None))]
    if missing:
        raise ModelFileError(f"model file {path} lacks {', '.join(m + '()' for m in missing)}",
                             "define build_model() -> nn.Module and example_inputs(batch_size) -> tuple of tensors")
    return ModelFile(path, module)


# ---- what a model returns: a tensor, or a structure holding one (a Hugging Face ModelOutput) ----

_CONSTANT_LEAF = (type(None), bool, int, float, str)


def split_output(out) -> tuple[Any, list[Any], list[str]]:
    """(pytree spec, leaves, leaf paths) of a model's output. Tensors and plain constants are
    kept; any other object (a key/value cache such as ``DynamicCache``) becomes None: the
    training step is traced with the loss fed this structure, so a loss that reads a dropped
    part fails at plan time, on its own line, and the distributed model returns the same
    structure (``rebuild_output``)."""
    import torch
    import torch.utils._pytree as pytree
    flat, spec = pytree.tree_flatten_with_path(out)
    leaves = [v if isinstance(v, (torch.Tensor, *_CONSTANT_LEAF)) else None for _, v in flat]
    return spec, leaves, [pytree.keystr(p) or "output" for p, _ in flat]


def output_structure(model, graph):
    """(pytree spec, leaves, index of the traced output tensor among them) of what ``model``
    returns, found by running it on meta tensors (nothing is allocated), or None when the model
    returns a plain tensor (or its structure cannot be found: then the tensor is returned).
    Other tensors and non-constant objects (a key/value cache) are None in the rebuilt
    structure (``split_output``): the planned training step computes only what the loss reads.
    ``graph``: the traced ``LayerGraphData``. Here, beside ``split_output``, because the planner
    (the loss fed to the trace) and the runtime (the distributed model's output) both read it;
    torch is imported on first use."""
    import torch
    from torch.func import functional_call
    try:
        meta = {k: torch.empty_like(v, device="meta") for k, v in
                list(model.named_parameters()) + list(model.named_buffers())}
        xs = [torch.empty(gi.shape, dtype=getattr(torch, gi.dtype, torch.float32), device="meta")
              for gi in graph.inputs]
        with torch.no_grad():
            out = functional_call(model, meta, tuple(xs), strict=False)
    except Exception:
        return None
    if isinstance(out, torch.Tensor):
        return None
    spec, leaves, _ = split_output(out)   # a cache object (DynamicCache) becomes None, as traced
    idx = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    if len(idx) > 1:                      # several tensors: the one of the traced output's shape
        want = tuple(graph.value_shape(graph.output))
        idx = [i for i in idx if tuple(leaves[i].shape) == want]
    if len(idx) != 1:
        return None
    return spec, [None if isinstance(v, torch.Tensor) else v for v in leaves], idx[0]


def rebuild_output(structure, tensor):
    """``tensor`` in the structure ``output_structure`` found (itself when that is None)."""
    if structure is None:
        return tensor
    import torch.utils._pytree as pytree
    spec, leaves, i = structure
    leaves = list(leaves)
    leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec)
