"""Run-time half of the vocabulary-parallel cross-entropy (``autopar.decomp.tensor_parallel.
cross_entropy``: the math, the cost and the planner's check ``loss_is_cross_entropy``): the
autograd function over the tensor group and ``VocabLoss``, the context in which the model file's
``F.cross_entropy`` on this rank's vocabulary block runs as ``vocab_parallel_cross_entropy``."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def _function():
    import torch
    import torch.distributed as dist

    class _VocabParallelCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, target, v0, group, ignore_index):
            n_local = x.shape[-1]
            m = x.detach().max(dim=-1).values
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            e = torch.exp(x.detach() - m.unsqueeze(-1))
            z = e.sum(-1)
            dist.all_reduce(z, group=group)
            valid = target != ignore_index
            mine = valid & (target >= v0) & (target < v0 + n_local)
            local_t = torch.where(mine, target - v0, torch.zeros_like(target))
            xt = torch.gather(x.detach(), -1, local_t.unsqueeze(-1)).squeeze(-1) * mine.to(x.dtype)
            dist.all_reduce(xt, group=group)
            loss = (torch.log(z) + m - xt) * valid.to(x.dtype)
            ctx.save_for_backward(e / z.unsqueeze(-1), local_t, mine, valid)
            ctx.group = group
            return loss

        @staticmethod
        def backward(ctx, g):
            soft, local_t, mine, valid = ctx.saved_tensors
            g = g.contiguous().clone()
            dist.all_reduce(g, group=ctx.group)         # adjoint of the forward all-reduces
            grad = soft.clone()
            grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(soft.dtype).unsqueeze(-1))
            grad = grad * (g * valid.to(g.dtype)).unsqueeze(-1)
            return grad, None, None, None, None

    return _VocabParallelCE


def vocab_parallel_cross_entropy(x_local, target, v0: int, group=None, ignore_index: int = -100,
                                 reduction: str = "mean"):
    """Cross-entropy of logits whose last dim is this rank's vocabulary block starting at global
    column ``v0`` (module docstring). ``target`` holds global ids, the same on every rank of
    ``group``. Every rank returns the same loss."""
    flat = x_local.reshape(-1, x_local.shape[-1])
    t = target.reshape(-1)
    per = _function().apply(flat, t, int(v0), group, int(ignore_index))
    if reduction == "none":
        return per.reshape(target.shape)
    if reduction == "sum":
        return per.sum()
    return per.sum() / (t != ignore_index).sum().clamp(min=1).to(per.dtype)


class VocabLoss:
    """Context manager: inside it, ``F.cross_entropy(x, t, ...)`` on this rank's vocabulary block
    ``x`` (global columns from ``v0``) runs as ``vocab_parallel_cross_entropy`` over ``group``."""

    def __init__(self, v0: int, group) -> None:
        from torch.overrides import TorchFunctionMode

        outer = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if getattr(func, "__name__", "") == "cross_entropy":
                    x, t = args[0], args[1] if len(args) > 1 else kwargs["target"]
                    return vocab_parallel_cross_entropy(
                        x, t, outer.v0, outer.group,
                        ignore_index=int(kwargs.get("ignore_index", args[3] if len(args) > 3 else -100)),
                        reduction=kwargs.get("reduction", args[5] if len(args) > 5 else "mean"))
                return func(*args, **kwargs)

        self.v0, self.group, self._mode = int(v0), group, _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)
