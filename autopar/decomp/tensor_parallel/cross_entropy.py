"""Vocabulary-parallel cross-entropy (Megatron-LM): the loss of logits split along the vocabulary
over a tensor group, without any rank holding the full logits.

Legend: x_MV logits (M = tokens, V vocabulary), rank c of the group holds columns
[v0, v0 + V_c) (the ``tensor_split`` rule: uneven blocks are exact), t_M target ids.

    forward   m_i = max_c (max_j x_ij)              all-reduce MAX of M floats
              z_i = sum_c sum_j exp(x_ij - m_i)     all-reduce SUM of M floats
              x_i,t = sum_c (x_i,t_i if t_i is in c's columns else 0)
                                                    all-reduce SUM of M floats
              loss_i = log z_i + m_i - x_i,t        (ignore_index rows: 0, not counted)
              loss   = sum_i loss_i / (rows counted)     (reduction "mean", as F.cross_entropy)
    backward  dL/dx_ij = (exp(x_ij - m_i) / z_i - [j == t_i]) * g_i on the local columns, with
              g_i the SUM over the group of the incoming gradient of loss_i: the exact adjoint of
              the forward all-reduces (each rank's loss is a function of every rank's shard).
              Nothing of size V moves.

    cost      3 all-reduces of M floats forward (the max is not differentiated), 1 backward;
              memory: the local softmax M x V_c (saved for backward) instead of M x V.

``vocab_parallel_cross_entropy`` is the runtime half; it is validated against
``torch.nn.functional.cross_entropy`` in float64 (tests/test_tensor_parallel.py). The planner does
not use it yet: the loss is computed outside the traced graph, by the model file's own
``loss_fn`` on the output gathered to a sample layout (``runtime.model.DistModel.local_loss``).
"""

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
