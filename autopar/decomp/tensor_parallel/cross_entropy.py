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

The loss is the model file's own ``loss_fn``, run outside the traced graph
(``runtime.model.DistModel.local_loss``). When the plan splits the language-model head with
``vocab_head`` (``tensor_parallel.vocab``), the logits stay split and the loss runs inside
``VocabLoss`` (the run-time half, ``autopar.runtime.layers.cross_entropy``): its
``F.cross_entropy`` call on this rank's block becomes ``vocab_parallel_cross_entropy``. The planner offers ``vocab_head`` only when
``loss_is_cross_entropy`` finds, on meta tensors, that ``loss_fn`` is one cross-entropy of the
logits (reshapes keeping the vocabulary last; no class weights, no label smoothing).
Validated against ``torch.nn.functional.cross_entropy`` in float64 (tests/test_tensor_parallel.py).
"""

from __future__ import annotations


#: Torch functions a loss may apply to the logits before its cross-entropy (shape access and
#: reshapes that keep the vocabulary the last dim, dtype casts).
_PASSTHROUGH = frozenset({"__get__", "reshape", "view", "flatten", "contiguous", "size", "dim", "float",
                          "double", "to", "type_as"})


def loss_is_cross_entropy(loss_fn, out_shape, target) -> str | None:
    """None when ``loss_fn(logits, target)`` is one ``F.cross_entropy`` over the last dim of the
    logits (after reshapes that keep that dim last), without class weights or label smoothing:
    then it can run vocabulary-parallel. Otherwise the reason. Runs ``loss_fn`` once on meta
    tensors under a recording torch-function mode (nothing is allocated)."""
    import torch
    from torch.overrides import TorchFunctionMode

    vocab = int(out_shape[-1])
    seen: list[str] = []

    derived: set[int] = set()          # ids of the logits and of tensors made from them

    def _touches(args, kwargs) -> bool:
        import torch.utils._pytree as pytree
        return any(isinstance(a, torch.Tensor) and id(a) in derived
                   for a in pytree.tree_leaves((args, kwargs)))

    class _Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", str(func))
            if not _touches(args, kwargs):
                return func(*args, **kwargs)
            if name == "cross_entropy":
                x = args[0]
                if id(x) not in derived or x.dim() != 2 or x.shape[-1] != vocab:
                    seen.append(f"cross_entropy on a {tuple(x.shape)} input (not the logits as (tokens, {vocab}))")
                elif kwargs.get("weight") is not None or (len(args) > 2 and args[2] is not None):
                    seen.append("cross_entropy with class weights")
                elif float(kwargs.get("label_smoothing", 0.0) or 0.0) != 0.0:
                    seen.append("cross_entropy with label smoothing")
                else:
                    seen.append("ce")
                return func(*args, **kwargs)
            if name not in _PASSTHROUGH:
                seen.append(name)
                return func(*args, **kwargs)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                if out.dim() and out.shape[-1] != vocab:
                    seen.append(f"{name} that moves the vocabulary dim")
                derived.add(id(out))
                keep.append(out)
            return out

    keep: list = []                    # keeps derived tensors alive (their ids stay unique)
    x = torch.empty(tuple(int(n) for n in out_shape), device="meta")
    derived.add(id(x))
    t = torch.empty(tuple(target.shape), dtype=target.dtype, device="meta") if target is not None else None
    try:
        with _Record():
            loss_fn(x, t) if t is not None else loss_fn(x)
    except Exception as e:            # a loss that meta tensors cannot run is not one we can split
        return f"the loss does not run on meta tensors ({e.__class__.__name__})"
    other = [s for s in seen if s != "ce"]
    if other:
        return f"the loss applies {other[0]} to the logits"
    if seen.count("ce") != 1:
        return "the loss is not one cross_entropy of the logits"
    return None
