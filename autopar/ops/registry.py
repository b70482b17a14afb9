"""The op-family protocol and its one table.

An *op family* (a convolution, a layer norm, attention...) says, in one module, everything the
planner needs to know about the aten ops it matches:

* matching: ``aten`` (base names such as ``"conv2d"``) and ``matches(base, n_act, node)``;
* the traced op: ``attrs(op)`` (normalised attributes) and ``flops(op) -> (fwd, bwd)`` on global
  shapes;
* pricing a local block: ``kernel_class`` (the calibration class, ``fallback_class`` when the
  profile lacks it), ``local_flops`` and ``local_bytes`` in that class's conventions
  (``calibrate/kernels.py``), ``saved_bytes`` (what autograd keeps), ``shape_spec`` (exact-shape
  measurements of ``kernels.measure_exact``), ``exact_measured`` (exact measurements of
  ``calibrate.exact_ops``), ``free`` (views: no compute at all);
* how placements run it: ``independent_dims(op)``, the output dims along which the op runs
  unchanged on blocks (every activation input split along the same dim index), and
  ``synced_dims(op)``, dims a decomposition may split only through the family's synchronised
  runtime (batch-norm statistics);
* layer grouping: ``transparent`` (folds into its producer's layer), ``parametric`` (owns
  parameters whose gradients are synchronised);
* several outputs: a family registered with ``@register_multi_output(base, ...)`` rewrites
  ``getitem(op(...), i)`` into one single-output call (``getitem``; a split piece is a slice).

Ops are duck-typed ``decomp.ir.OpSpec`` values (``kind``, ``target``, ``args``, ``kwargs``,
``inputs``, ``in_shapes``, ``out_shape``, ``params``, ``attrs``); shapes are lists of ints.
``args`` are JSON-able: ``{"v": name}`` an activation, ``{"p": qualname}`` a parameter,
``{"b": qualname}`` a buffer, anything else a literal.

Families register with ``@register_family`` into ``FAMILIES`` (kind -> family instance);
``autopar/ops/__init__.py`` imports every family module explicitly. No torch import here or in
any family module (the planner runs without it).
"""

from __future__ import annotations

import math
from collections.abc import Set
from typing import Any, Callable, ClassVar, Iterator, Sequence

Shape = Sequence[int]

#: The kind of ops that match no family: they run replicated (``unregistered`` lists them).
OTHER = "other"
#: The kind of buffer-only in-place ops (batch-norm counters): not planned, replayed.
BUFFER_UPDATE = "buffer_update"


class RegistryError(Exception):
    """A family is declared wrongly (no kind, a kind registered twice, two families match)."""


def numel(shape: Shape) -> int:
    return math.prod(int(s) for s in shape) if shape else 1


def is_act(a: Any) -> bool:
    """An activation reference ``{"v": name}`` in traced args."""
    return isinstance(a, dict) and len(a) == 1 and "v" in a


def arg(op, i: int, name: str | None = None, default: Any = None) -> Any:
    """Positional argument ``i`` of the traced call, else keyword ``name``, else ``default``."""
    if i < len(op.args) and op.args[i] is not None:
        return op.args[i]
    if name is not None and name in (op.kwargs or {}):
        return op.kwargs[name]
    return default


def dims_list(d: Any, rank: int) -> list[int]:
    """A dim or list of dims, non-negative; None or [] -> every dim."""
    if d is None or (isinstance(d, (list, tuple)) and len(d) == 0):
        return list(range(rank))
    d = d if isinstance(d, (list, tuple)) else [d]
    return sorted({int(x) % max(1, rank) for x in d})


def base_name(target: str) -> str:
    """'aten.conv2d.default' -> 'conv2d'."""
    name = target.split(".", 1)[1] if target.startswith("aten.") else target
    return name.split(".")[0]


class OpFamily:
    """Base of every op family: the defaults describe a one-output elementwise-priced op that
    runs only replicated (the behaviour of an unregistered op)."""

    kind: ClassVar[str] = ""
    aten: ClassVar[frozenset[str]] = frozenset()
    #: activation-input counts the family accepts (None: any)
    n_act: ClassVar[tuple[int, ...] | None] = None
    kernel_class: ClassVar[str] = "elementwise"
    fallback_class: ClassVar[str] = "elementwise"
    #: extra kernel classes of the backward phases (conv: bwd_data, bwd_filter); empty: the
    #: backward is priced as twice the forward's class
    bwd_classes: ClassVar[tuple[str, ...]] = ()
    #: the kernel class's sweep times this family's own backward (``calibrate.kernels.
    #: BACKWARD_CLASSES``): priced by the class's fitted ``bwd_model`` where the profile has
    #: one, else (and for every other family of the class) at twice the forward
    sweep_backward: ClassVar[bool] = False
    transparent: ClassVar[bool] = False
    parametric: ClassVar[bool] = False
    free: ClassVar[bool] = False
    exact_measured: ClassVar[bool] = True
    #: operands broadcast against the output by torch's rules (trailing dims aligned, extent 1
    #: stretched): an operand without the output's dim 0 is then used whole on every block of
    #: samples (``batch_free_operand``)
    broadcasts: ClassVar[bool] = False

    # ---- matching -----------------------------------------------------------------------
    def matches(self, base: str, n_act: int, node: Any = None) -> bool:
        return base in self.aten and (self.n_act is None or n_act in self.n_act)

    # ---- the traced op (global shapes) --------------------------------------------------
    def attrs(self, op) -> dict[str, Any]:
        return {}

    def flops(self, op) -> tuple[float, float]:
        """Default: ``out_numel`` forward, twice that backward."""
        n = float(numel(op.out_shape))
        return n, 2.0 * n

    # ---- pricing a local block ----------------------------------------------------------
    def local_flops(self, op, in_shapes: Sequence[Shape], out_shape: Shape,
                    w_shape: Shape | None = None) -> float:
        """FLOPs in the kernel class's convention; default ``out_numel`` (elementwise)."""
        return float(numel(out_shape))

    def local_bytes(self, op, in_shapes: Sequence[Shape], out_shape: Shape,
                    w_shape: Shape | None = None, itemsize: int = 4) -> float:
        """Bytes read and written: activation inputs and the output."""
        return float((sum(numel(s) for s in in_shapes) + numel(out_shape)) * itemsize)

    def saved_bytes(self, op, in_shapes: Sequence[Shape], out_shape: Shape, itemsize: int = 4) -> float:
        """Default: the first activation input is kept."""
        return numel(in_shapes[0]) * itemsize if in_shapes else 0.0

    def shape_spec(self, op, in_shapes: Sequence[Shape], w_shape: Shape | None = None) -> dict | None:
        """A ``kernels.measure_exact`` shape spec (conv, linear), None for other families."""
        return None

    def local_params(self, op, in_shapes: Sequence[Shape]) -> dict[str, list[int]]:
        """Parameter shapes on a local block (for exact measurements); default: whole."""
        return {r: list(s) for r, s in op.params.items()}

    # ---- placements ---------------------------------------------------------------------
    def independent_dims(self, op) -> frozenset[int]:
        """Output dims along which the op runs unchanged on blocks (none by default)."""
        return frozenset()

    def synced_dims(self, op) -> frozenset[int]:
        """Dims splittable only through the family's synchronised runtime (none by default)."""
        return frozenset()

    # ---- grouping -----------------------------------------------------------------------
    def is_transparent(self, op) -> bool:
        """Whether ``op`` may fold into its producer's layer."""
        return self.transparent and len(op.inputs) == 1

    # ---- several outputs ----------------------------------------------------------------
    def getitem(self, base: str, args: list[Any], kwargs: dict[str, Any], index: int,
                x_shape: Shape) -> tuple[str, list[Any], dict[str, Any]] | None:
        """For an op returning several tensors (``MULTI_OUTPUT``), ``out[index]`` as one
        single-output aten call ``(target, args, kwargs)`` built from the op's own arguments
        (``x_shape``: the shape of its first argument); None when not expressible."""
        return None

    def __repr__(self) -> str:
        return f"<op family {self.kind}>"


class Unregistered(OpFamily):
    """Ops no family matches: kind ``other``, replicated, priced as elementwise."""

    kind = OTHER
    exact_measured = False


#: kind -> family instance; filled by ``register_family`` (module imports in ``__init__``)
FAMILIES: dict[str, OpFamily] = {}
#: the families of ops returning several tensors (matched by base name before ``getitem``)
MULTI_OUTPUT: dict[str, OpFamily] = {}
UNREGISTERED = Unregistered()
_BUFFER = Unregistered()


def register_family(cls: type[OpFamily]) -> type[OpFamily]:
    """Class decorator: add one instance of ``cls`` to ``FAMILIES`` under ``cls.kind``."""
    if not cls.kind or cls.kind in (OTHER, BUFFER_UPDATE):
        raise RegistryError(f"{cls.__name__} needs a kind of its own (got {cls.kind!r})")
    old = FAMILIES.get(cls.kind)
    if old is not None and type(old).__qualname__ != cls.__qualname__:
        raise RegistryError(f"op kind {cls.kind!r} registered twice ({type(old).__name__}, {cls.__name__})")
    FAMILIES[cls.kind] = cls()
    return cls


def register_multi_output(*bases: str) -> Callable[[type[OpFamily]], type[OpFamily]]:
    """Class decorator: ``cls().getitem`` rewrites ``getitem(base(...), i)`` of these ops."""
    def deco(cls: type[OpFamily]) -> type[OpFamily]:
        inst = cls()
        for b in bases:
            MULTI_OUTPUT[b] = inst
        return cls
    return deco


def unregister_family(kind: str) -> None:
    """Remove a family (tests that register a toy family clean up with this)."""
    FAMILIES.pop(kind, None)


def family_of(kind: str) -> OpFamily:
    """The family of an op kind; unregistered kinds (``other``, ``buffer_update``) get the
    replicated, elementwise-priced default."""
    return FAMILIES.get(kind) or (_BUFFER if kind == BUFFER_UPDATE else UNREGISTERED)


def matching(target: str, n_act: int, node: Any = None) -> list[OpFamily]:
    """Every family matching ``target`` (an aten name such as ``aten.conv2d.default``)."""
    base = base_name(str(target))
    return [f for f in FAMILIES.values() if f.matches(base, n_act, node)]


def classify(target: str, n_act: int, node: Any = None) -> OpFamily | None:
    """The one family matching ``target`` with ``n_act`` activation inputs; None when none
    does (the op is ``other``). Two matching families are a declaration error."""
    found = matching(target, n_act, node)
    if len(found) > 1:
        raise RegistryError(f"{target} matches several op families: {[f.kind for f in found]}")
    return found[0] if found else None


class KindSet(Set):
    """A live, read-only set of the registered kinds whose family satisfies ``pred`` (so a
    family registered later is in ``TRANSPARENT``/``PARAMETRIC`` too)."""

    def __init__(self, pred: Callable[[OpFamily], bool]) -> None:
        self._pred = pred

    @classmethod
    def _from_iterable(cls, it):
        return frozenset(it)          # set algebra (``|``, ``&``, ``-``) gives plain frozensets

    def _kinds(self) -> frozenset[str]:
        return frozenset(k for k, f in FAMILIES.items() if self._pred(f))

    def __contains__(self, kind: object) -> bool:
        f = FAMILIES.get(kind) if isinstance(kind, str) else None
        return f is not None and bool(self._pred(f))

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._kinds()))

    def __len__(self) -> int:
        return len(self._kinds())

    def __repr__(self) -> str:
        return f"KindSet({sorted(self._kinds())})"


def kernel_class_for(family: OpFamily, available: Any) -> str:
    """The family's calibration class if the profile has it (``available``: its kernel
    table), else its fallback class."""
    if available is None or family.kernel_class in available:
        return family.kernel_class
    return family.fallback_class


def kernel_classes() -> dict[str, tuple[str, str]]:
    """kind -> (kernel class, fallback class) of every registered family."""
    return {k: (f.kernel_class, f.fallback_class) for k, f in sorted(FAMILIES.items())}


# ---- shared helpers for families ------------------------------------------------------------

def same_index_dims(op, candidates) -> frozenset[int]:
    """Of ``candidates`` (output dims), those every activation input also has at the same
    index with the output's extent (the blocks then line up)."""
    out = list(op.out_shape)
    keep = set()
    for d in candidates:
        if not 0 <= d < len(out):
            continue
        if all(d < len(s) and int(s[d]) == int(out[d]) for s in op.in_shapes):
            keep.add(d)
    return frozenset(keep)


def batch_free_operand(op, shape: Shape) -> bool:
    """True when ``op`` broadcasts (``OpFamily.broadcasts``) and its operand of ``shape`` has no
    extent along the output's dim 0: fewer dims than the output (aligned to its trailing dims),
    or extent 1 where the output has more. Every block of samples then reads the whole operand
    (a position embedding added to token embeddings, a ``[1, 1, S, S]`` mask), and its gradient
    on a rank is that block's share, summed over the ranks like a weight's."""
    out = list(op.out_shape)
    if not out or not family_of(op.kind).broadcasts:
        return False
    s = list(shape)
    return len(s) < len(out) or (len(s) == len(out) and int(s[0]) == 1 and int(out[0]) != 1)


def all_dims(op) -> range:
    return range(len(op.out_shape))


def kept_view_dims(in_shape: Shape, out_shape: Shape) -> frozenset[int]:
    """Output dims a reshape keeps: d with ``in[d] == out[d]`` and equal products before it
    (a block along d of the input reshapes into the block along d of the output)."""
    keep, p_in, p_out = set(), 1, 1
    for d in range(min(len(in_shape), len(out_shape))):
        if p_in == p_out and int(in_shape[d]) == int(out_shape[d]):
            keep.add(d)
        p_in *= int(in_shape[d])
        p_out *= int(out_shape[d])
    return frozenset(keep)


def expand_ints(v: Any, n: int) -> list[int] | None:
    """An int or list for ``n`` spatial dims (``[k]`` -> ``[k] * n``; ``[]`` -> None)."""
    if isinstance(v, (list, tuple)):
        v = list(v)
        if len(v) == 1:
            return [int(v[0])] * n
        if len(v) == 0:
            return None
        return [int(x) for x in v]
    return [int(v)] * n


def operand_shapes(op, in_shapes: Sequence[Shape] | None = None) -> list[list[int] | None]:
    """The shape of each positional argument of ``op`` (None for literals and buffers):
    activations from ``in_shapes`` (default ``op.in_shapes``; pass local shapes to price a
    block), parameters from ``op.params``."""
    in_shapes = op.in_shapes if in_shapes is None else in_shapes
    act = {v: list(s) for v, s in zip(op.inputs, in_shapes)}
    par = {q: list(op.params[r]) for r, q in op.param_names.items() if r in op.params}

    def shape(a):
        if isinstance(a, dict) and len(a) == 1:
            if "v" in a:
                return act.get(a["v"])
            if "p" in a:
                return par.get(a["p"])
        return None
    return [shape(a) for a in op.args]


def describe_unregistered(targets: Sequence[str]) -> str:
    """The line ``autopar plan`` prints for ``LayerGraphData.unregistered``:
    ``replicated because not registered: aten.logit.default (x2), aten.foo.default``;
    "" when every op matched a family."""
    if not targets:
        return ""
    counts: dict[str, int] = {}
    for t in targets:
        counts[t] = counts.get(t, 0) + 1
    parts = [f"{t} (x{n})" if n > 1 else t for t, n in sorted(counts.items())]
    return "replicated because not registered: " + ", ".join(parts)
