"""Sharding ops: views and reshapes, permutations, (un)squeeze, expand, slices, concatenation
and stacking; ``split``/``chunk``/``unbind`` are read as their slices.

Views (every kind here but ``cat`` and ``stack``) cost nothing and save nothing.
"""

from __future__ import annotations

import math

from .registry import (OpFamily, arg, kept_view_dims, numel, register_family,
                       register_multi_output, same_index_dims)


class _View(OpFamily):
    """No compute, no saved tensors."""

    free = True
    exact_measured = False

    def flops(self, op):
        return 0.0, 0.0

    def local_flops(self, op, in_shapes, out_shape, w_shape=None):
        return 0.0

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return 0.0


@register_family
class Flatten(_View):
    """``aten.flatten(x, start_dim, end_dim)``: independent along the dims it keeps."""

    kind = "flatten"
    aten = frozenset({"flatten"})

    def attrs(self, op):
        a = op.args
        return {"start_dim": int(a[1]) if len(a) > 1 else 0, "end_dim": int(a[2]) if len(a) > 2 else -1}

    def independent_dims(self, op):
        return kept_view_dims(op.in_shapes[0], op.out_shape) & same_index_dims(op, range(len(op.out_shape)))


@register_family
class View(_View):
    """``aten.view/reshape(x, sizes)``: independent along the dims the reshape keeps
    (``kept_view_dims``); ``runtime.ops.call_local`` rewrites the sizes for a local block."""

    kind = "view"
    aten = frozenset({"view", "reshape", "_unsafe_view"})

    def independent_dims(self, op):
        dims = kept_view_dims(op.in_shapes[0], op.out_shape) & same_index_dims(op, range(len(op.out_shape)))
        if _merges_into_dim0(op.in_shapes[0], op.out_shape) or _merges_into_dim0(op.out_shape, op.in_shapes[0]):
            dims = dims | {0}
        return dims


def _merges_into_dim0(a, b) -> bool:
    """Whether ``b`` is ``a`` with its leading dims merged into dim 0 (``(N, S, E) -> (N S, E)``,
    Hugging Face's Conv1D): a block of rows of ``b`` whose size is a multiple of ``prod(a[1:j])``
    is the view of a block of ``a`` along dim 0, so the view runs unchanged on such blocks (the
    decompositions that accept it check the alignment: ``decomp.common.batch_dim_ok``)."""
    a, b = [int(n) for n in a], [int(n) for n in b]
    if not a or not b or a[0] == b[0]:
        return False
    for j in range(2, len(a) + 1):
        if math.prod(a[:j]) == b[0] and a[j:] == b[1:]:
            return True
    return False


@register_family
class Unflatten(_View):
    """``aten.unflatten(x, dim, sizes)`` (``nn.MultiheadAttention`` splits its packed
    projection with it): one dim becomes several. Independent along the dims it keeps; its
    sizes name only the unflattened dim, so a block split along a kept dim runs it unchanged."""

    kind = "unflatten"
    aten = frozenset({"unflatten"})

    def attrs(self, op):
        return {"dim": int(op.args[1]), "sizes": [int(n) for n in op.args[2]]}

    def independent_dims(self, op):
        return kept_view_dims(op.in_shapes[0], op.out_shape) & same_index_dims(op, range(len(op.out_shape)))


@register_family
class Permute(_View):
    """``aten.permute(x, dims)``, ``transpose(x, a, b)``, ``t(x)``: output dim d is input dim
    ``perm[d]``; independent along the dims the permutation fixes."""

    kind = "permute"
    aten = frozenset({"permute", "transpose", "t", "swapaxes", "swapdims"})
    n_act = (1,)

    def attrs(self, op):
        rank = len(op.out_shape)
        base = op.target.split(".")[1]
        perm = list(range(rank))
        if base == "permute":
            perm = [int(d) % rank for d in op.args[1]]
        elif base == "t":
            perm = perm[::-1]
        else:
            a, b = int(op.args[1]) % rank, int(op.args[2]) % rank
            perm[a], perm[b] = perm[b], perm[a]
        return {"perm": perm}

    def independent_dims(self, op):
        perm = op.attrs.get("perm", [])
        return same_index_dims(op, [d for d, p in enumerate(perm) if d == p])


@register_family
class Squeeze(_View):
    """``aten.unsqueeze(x, d)``, ``squeeze(x, d | dims)``: independent along the dims before
    the first inserted or removed one. ``squeeze(x)`` of every unit dim is independent
    nowhere (a block of extent 1 would be squeezed too)."""

    kind = "squeeze"
    aten = frozenset({"squeeze", "unsqueeze"})
    n_act = (1,)

    def attrs(self, op):
        unsq = op.target.startswith("aten.unsqueeze")
        rank = len(op.out_shape) if unsq else len(op.in_shapes[0])
        d = arg(op, 1, "dim")
        dims = None if d is None else sorted(int(x) % max(1, rank) for x in (d if isinstance(d, (list, tuple)) else [d]))
        return {"dims": dims, "unsqueeze": unsq}

    def independent_dims(self, op):
        dims = op.attrs.get("dims")
        if dims is None:
            return frozenset()
        return same_index_dims(op, range(min(dims, default=len(op.out_shape))))


@register_family
class Expand(_View):
    """``aten.expand(x, sizes)``: independent along dims it does not broadcast: size -1, or
    the input's own extent (``src.unsqueeze(-1).expand(b, e, f)`` keeps b and e). A literal
    size names the global extent: the runtime rewrites it to the block's (``call_local`` with
    the local output shape, as for views)."""

    kind = "expand"
    aten = frozenset({"expand"})
    n_act = (1,)

    def independent_dims(self, op):
        sizes = op.args[1] if len(op.args) > 1 else []
        x = op.in_shapes[0] if op.in_shapes else []
        if len(sizes) != len(x):
            return frozenset()
        return same_index_dims(op, [d for d, s in enumerate(sizes)
                                    if s == -1 or (isinstance(s, int) and int(s) == int(x[d]))])


@register_family
class Slice(_View):
    """``aten.slice(x, dim, start, end, step)``, ``narrow(x, dim, start, length)``,
    ``select(x, dim, index)``: independent along every other dim (select: those before it)."""

    kind = "slice"
    aten = frozenset({"slice", "narrow", "select"})
    n_act = (1,)

    def attrs(self, op):
        rank = len(op.in_shapes[0])
        return {"dim": int(arg(op, 1, "dim", 0)) % max(1, rank),
                "select": op.target.startswith("aten.select")}

    def independent_dims(self, op):
        d = op.attrs.get("dim", 0)
        if op.attrs.get("select"):
            return same_index_dims(op, range(d))
        return same_index_dims(op, [i for i in range(len(op.out_shape)) if i != d])


@register_family
class Cat(OpFamily):
    """``aten.cat(tensors, dim)``: trace FLOPs 0; priced as a copy (``elementwise`` at
    ``|y|``, bytes in + out). Saves its inputs (as counted so far). Independent along every
    dim but ``dim``."""

    kind = "cat"
    aten = frozenset({"cat", "concat", "concatenate"})

    def attrs(self, op):
        return {"dim": int(op.args[1]) if len(op.args) > 1 else 0}

    def flops(self, op):
        return 0.0, 0.0

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return sum(numel(s) for s in in_shapes) * itemsize

    def independent_dims(self, op):
        """Empty operands (a legacy empty cache, ``torch.cat([tensor([]), k])``) add nothing
        and are ignored; the others must line up with the output's blocks."""
        out = [int(n) for n in op.out_shape]
        d = op.attrs.get("dim", 0) % max(1, len(out))
        full = [s for s in op.in_shapes if math.prod(int(n) for n in s) != 0]
        return frozenset(i for i in range(len(out)) if i != d
                         and all(i < len(s) and int(s[i]) == out[i] for s in full))


@register_family
class Stack(OpFamily):
    """``aten.stack(tensors, dim)``: trace FLOPs 0; priced as a copy. Saves nothing.
    Independent along the dims before ``dim``."""

    kind = "stack"
    aten = frozenset({"stack"})

    def attrs(self, op):
        d = int(op.args[1]) if len(op.args) > 1 else 0
        return {"dim": d % max(1, len(op.out_shape))}

    def flops(self, op):
        return 0.0, 0.0

    def saved_bytes(self, op, in_shapes, out_shape, itemsize=4):
        return 0.0

    def independent_dims(self, op):
        return same_index_dims(op, range(op.attrs.get("dim", 0)))


@register_multi_output("split", "split_with_sizes", "chunk", "unbind")
class Split(OpFamily):
    """``split(x, size, dim)``, ``split_with_sizes(x, sizes, dim)``, ``chunk(x, n, dim)``:
    piece i is ``slice(x, dim, start_i, end_i)``; ``unbind(x, dim)``: ``select(x, dim, i)``."""

    def getitem(self, base, args, kwargs, index, x_shape):
        x = args[0]
        if base == "unbind":
            dim = int(args[1]) if len(args) > 1 else 0
            return "aten.select.int", [x, dim, index], {}
        dim = int(args[2]) if len(args) > 2 else 0
        n = int(x_shape[dim])
        if base == "split_with_sizes":
            sizes = [int(s) for s in args[1]]
        else:
            size = int(args[1]) if base == "split" else -(-n // int(args[1]))
            sizes = [min(size, n - s) for s in range(0, n, size)] if size > 0 else [n]
        if index >= len(sizes):
            return None
        start = sum(sizes[:index])
        return "aten.slice.Tensor", [x, dim, start, start + sizes[index], 1], {}
