"""What the runtime reads off a model around its traced graph, shared by the op-by-op runtime
(``runtime.model``) and the native one (``runtime.native``): the structure of the model's output
(a tensor, or e.g. a Hugging Face ``ModelOutput``) and the parameter names as attribute names.
Below both, so that neither imports the other for them. ``output_structure`` / ``rebuild_output``
live in ``autopar.modelfile`` (the planner reads them too, and never imports the runtime)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ..modelfile import output_structure, rebuild_output  # noqa: F401  (re-exported)


def _safe(name: str) -> str:
    """A parameter's qualified name as one attribute name (``a.b.w`` -> ``a__b__w``)."""
    return name.replace(".", "__")


def map_output_tensor(out, fn):
    """``out`` with its one tensor (``output_tensor``) replaced by ``fn(tensor)``, in the same
    structure (a tensor, tuple, dict or ``ModelOutput``)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    t = output_tensor(out)
    return pytree.tree_map(lambda v: fn(v) if v is t else v, out)


def output_tensor(out):
    """The one tensor of a model's output (itself for a tensor; the single tensor leaf of a
    structure such as a Hugging Face ``ModelOutput``)."""
    if isinstance(out, torch.Tensor):
        return out
    ts = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
    if len(ts) != 1:
        raise ValueError(f"the model's output holds {len(ts)} tensors; autopar plans models with one")
    return ts[0]
