"""What the runtime reads off a model around its traced graph, shared by the op-by-op runtime
(``runtime.model``) and the native one (``runtime.native``): the structure of the model's output
(a tensor, or e.g. a Hugging Face ``ModelOutput``) and the parameter names as attribute names.
Below both, so that neither imports the other for them."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.func import functional_call

from ..decomp.ir import LayerGraphData
from ..modelfile import split_output


def _safe(name: str) -> str:
    """A parameter's qualified name as one attribute name (``a.b.w`` -> ``a__b__w``)."""
    return name.replace(".", "__")


def output_structure(model: nn.Module, graph: LayerGraphData):
    """(pytree spec, leaves, index of the traced output tensor among them) of what ``model``
    returns, found by running it on meta tensors (nothing is allocated), or None when the model
    returns a plain tensor (or its structure cannot be found: then the tensor is returned).
    Other tensors and non-constant objects (a key/value cache) are None in the rebuilt
    structure (``modelfile.split_output``): the planned training step computes only what the
    loss reads."""
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


def rebuild_output(structure, tensor: torch.Tensor):
    if structure is None:
        return tensor
    spec, leaves, i = structure
    leaves = list(leaves)
    leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec)


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
