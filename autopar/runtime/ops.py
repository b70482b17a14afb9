"""Local execution of one traced op, and batch normalisation with statistics over a group.

``call_local`` runs an op exactly as traced, on local tensors, after substituting references
(``{"v"}``, ``{"p"}``, ``{"b"}``) and, for ops whose arguments name sizes (view/reshape), the
local extents. Decompositions use it for every op whose mathematics is unchanged by their split
(e.g. any elementwise op, or a convolution under sample parallelism).

``sync_batch_norm`` computes the batch statistics over every rank of ``ranks`` (two passes:
mean, then the centred sum of squares, for the same rounding behaviour as one process), so that
a batch norm over split samples or split spatial extents computes the single-process function.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .comm import Comm, all_reduce_sum


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
    if isinstance(template, dict):
        if "v" in template and len(template) == 1:
            return values[template["v"]]
        if "p" in template and len(template) == 1:
            return params[template["p"]]
        if "b" in template and len(template) == 1:
            return buffers[template["b"]]
        if "dtype" in template and len(template) == 1:
            return getattr(torch, template["dtype"])
        return {k: substitute(v, values, params, buffers) for k, v in template.items()}
    if isinstance(template, list):
        return [substitute(v, values, params, buffers) for v in template]
    return template


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
    args = substitute(op.args, values, params, buffers)
    kwargs = substitute(op.kwargs, values, params, buffers)
    if op.kind == "view" and local_out_shape is not None and len(args) >= 2 and isinstance(args[1], list):
        args[1] = local_sizes(args[1], op.out_shape, local_out_shape)
    return resolve_target(op.target)(*args, **kwargs)


def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    training: bool, momentum: float, eps: float, comm: Comm,
                    ranks: Sequence[int], global_count: int) -> torch.Tensor:
    """Batch norm whose statistics cover every rank of ``ranks`` (differentiable).

    mean = sum_g(sum x) / n;  var = sum_g(sum (x - mean)^2) / n  (n = ``global_count``, the
    number of elements per channel in the single-process tensor); running_var is updated with
    the unbiased var * n / (n - 1), as torch does. Autograd differentiates through the two
    ``all_reduce_sum`` calls, whose backward is again a sum: the gradient matches one process.
    """
    if not training or len(ranks) <= 1:
        return torch.nn.functional.batch_norm(x, running_mean, running_var, weight, bias,
                                              training, momentum, eps)
    dims = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    n = float(global_count)
    s1 = all_reduce_sum(x.sum(dims), comm, ranks)
    mean = s1 / n
    xc = x - mean.reshape(shape)
    s2 = all_reduce_sum((xc * xc).sum(dims), comm, ranks)
    var = s2 / n
    y = xc * torch.rsqrt(var + eps).reshape(shape)
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            m = 0.1 if momentum is None else momentum
            running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            running_var.mul_(1 - m).add_(var.detach() * (n / max(n - 1.0, 1.0)), alpha=m)
    return y
