"""What edge and node splitting share: blocks of graph items (edges or nodes) along the item
dim ``d`` (1 in the dense padded form, whose dim 0 holds the graphs; 0 in PyTorch Geometric's
concatenated batch), with an optional graph (sample) axis outside.

Legend: ``s`` graph (sample) parts, ``p`` item parts, world ``P = s * p``; ``d`` the item dim
of the layer's values (marked by the tracer, ``autopar.trace.graph_items``: ``op.attrs
["items"] = {value: [dim, "edge" | "node"]}``). A value of the split kind (edge for ``Edges``,
node for ``Nodes``) has layout ``((0, s), (d, p))`` (``((d, p),)`` in the PyG form, where
``s == 1``); every other value of the layer is whole along ``d`` and split only by graphs,
``((0, s),)``, on the ``p`` ranks of a graph group alike. Rank = ``c_s * p + c_p`` (the
graph axis outermost), so the node values of a sample-split neighbour (``N<s>``, replicated
over the ``p`` inner ranks) are exactly what a gather of a block of edges reads: no traffic.

A reduction of items into whole values -- a scatter-add of messages into the node tensor, a
sum pooling of nodes into graphs -- leaves each rank with the sum over its own block only:
its output is ``Partial(sum)`` over the ``p`` item ranks, ``((0, s),)`` with ``partial = p``
(``autopar.decomp.sharding``). The consumer's transition resolves it (all-reduce to a whole
tensor, reduce-scatter to a split one), priced by the redistribution pricing
(``autopar.decomp.transition``). The scatter's own input (``self``: the zero buffer) is added
by partial index 0 only, so the partial addends still sum to the single-process result. A
partial value must leave the layer: no op of the layer may read it.

Weights are whole on every rank and their gradients are summed over the world, as under
sample parallelism. Pure at plan time; ``run`` imports the runtime lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..base import CostContext, Decomposition, LayerCost, divisors
from ..common import price_replicated_weights
from ..ir import REGISTERED, Layer, OpSpec
from ..sharding import Partial, Shard, Sharding
from ...ops import family_of

EDGE, NODE = "edge", "node"
#: op kinds with a literal size list naming global extents (rewritten to local ones at run time)
SIZED = ("view", "expand", "new_tensor")


def layer_items(layer: Layer) -> dict[str, tuple[int, str]]:
    """value -> (item dim, "edge" | "node") of every marked value the layer reads or writes."""
    out: dict[str, tuple[int, str]] = {}
    for op in layer.ops:
        for v, (d, kind) in (op.attrs.get("items") or {}).items():
            out[v] = (int(d), str(kind))
    return out


def _act(a: Any) -> str | None:
    return a["v"] if isinstance(a, dict) and len(a) == 1 and "v" in a else None


@dataclass(frozen=True)
class ItemSplit(Decomposition):
    """Base of ``Edges`` and ``Nodes`` (see the module docstring); ``axis`` says which items."""

    sample: int = 1
    parts: int = 2
    axis: ClassVar[str] = ""
    supported_ops = REGISTERED

    # ---- layouts ---------------------------------------------------------------------------
    def _graphs(self) -> tuple[tuple, ...]:
        """The graph axis, (placement, size): samples (whole graphs) split ``sample`` ways."""
        return ((Shard(0), self.sample),)

    def value_layouts(self, layer: Layer) -> dict[str, Sharding]:
        """Sharding of every value of the layer: split along its item dim when it is of this
        decomposition's kind, ``Partial`` when a reducing op (``reduces``) made it, else whole
        along the items (split by graphs only)."""
        return _value_layouts(self, layer)

    def _value_layouts(self, layer: Layer) -> dict[str, Sharding]:
        items = layer_items(layer)
        whole = Sharding.of(*self._graphs())
        out: dict[str, Sharding] = {}
        for op in layer.ops:
            for v in list(op.inputs) + [op.name]:
                it = items.get(v)
                if it is not None and it[1] == self.axis and not (v == op.name and self.reduces(op, items)):
                    out[v] = Sharding.of(*self._graphs(), (Shard(it[0]), self.parts))
                elif v == op.name and self.reduces(op, items):
                    out[v] = Sharding.of(*self._graphs(), (Partial(), self.parts))
                else:
                    out.setdefault(v, whole)
        return out

    def in_placement(self, layer: Layer, value: str) -> Sharding:
        return self.value_layouts(layer).get(value, Sharding.of(*self._graphs()))

    def out_placement(self, layer: Layer, value: str | None = None) -> Sharding:
        return self.value_layouts(layer)[value or layer.output]

    def reduces(self, op: OpSpec, items: dict) -> bool:
        """Whether ``op`` sums items of this kind into a value that is not (a scatter whose
        source is of this kind; a sum over the item dim)."""
        mine = lambda v: v in items and items[v][1] == self.axis   # noqa: E731
        if op.kind == "scatter":
            # only a sum splits into addends: scatter_add / index_add, or scatter_reduce "sum"
            # that includes its own input (include_self=False keeps self only where no
            # index hits, which a rank holding some of the edges cannot know)
            if op.attrs.get("reduce") not in (None, "sum") or \
                    ("scatter_reduce" in op.target and len(op.args) > 5 and op.args[5] is False):
                return False
            src = _act(op.args[3]) if len(op.args) > 3 else None
            return bool(src) and mine(src) and not mine(op.name)
        if op.kind == "sum":
            x = op.inputs[0] if op.inputs else None
            return bool(x) and mine(x) and items[x][0] in (op.attrs.get("dims") or []) and not mine(op.name)
        return False

    # ---- legality --------------------------------------------------------------------------
    @classmethod
    def candidates(cls, layer: Layer, ctx: CostContext) -> list[Decomposition]:
        """(world / p, p) for every divisor p > 1 of the world when the layer holds values of
        this kind along dim 1 (dense form: graphs x items, the 2-D grid when both > 1);
        (1, world) along dim 0 (PyG form: no graph axis)."""
        dims = {d for d, k in layer_items(layer).values() if k == cls.axis}
        if not dims:
            return []
        if 0 in dims:
            return [cls(1, ctx.world)] if ctx.world > 1 else []
        return [cls(ctx.world // p, p) for p in divisors(ctx.world) if p > 1]

    def check(self, layer: Layer, ctx: CostContext) -> str | None:
        where = layer.module or layer.name
        why = super().check(layer, ctx)
        if why:
            return f"{where}: {why}"
        if self.sample < 1 or self.parts < 2 or self.sample * self.parts != ctx.world:
            return f"{where}: {self.sample} graph parts x {self.parts} {self.axis} parts != world size {ctx.world}"
        items = layer_items(layer)
        mine = {v: d for v, (d, k) in items.items() if k == self.axis}
        if not mine:
            return f"{where}: no {self.axis}-indexed value"
        if self.sample > 1 and 0 in mine.values():
            return f"{where}: {self.axis}s along dim 0 (no graph dim to split as well)"
        lays = self.value_layouts(layer)
        for op in layer.ops:
            why = self._check_op(op, items, mine, lays)
            if why:
                return f"{op.module or where}: {op.name}: {why}"
        for v, lay in lays.items():
            if lay.is_partial and (v not in layer.outputs or
                                    any(v in op.inputs for op in layer.ops)):
                return f"partial sum {v} is read inside the layer (it must leave it)"
            shape = layer.value_shape(v)
            problem = lay.fits(shape, ctx.world)
            if problem:
                return f"{where}: {v}: {problem}"
        return None

    def _check_op(self, op: OpSpec, items: dict, mine: dict, lays: dict) -> str | None:
        fam = family_of(op.kind)
        ind = fam.independent_dims(op)
        if self.sample > 1 and op.inputs and 0 not in ind and op.kind not in ("expand", "new_tensor"):
            return f"{op.kind} does not run on blocks of graphs (dim 0)"
        acts = [v for v in op.inputs if v in mine]
        out_mine = op.name in mine and not self.reduces(op, items)
        if not acts and not out_mine:
            return None                                       # whole values only
        if op.kind == "gather":
            src, idx = _act(op.args[0]), _act(op.args[2])
            d = int(op.attrs.get("dim", 0))
            if src in mine or idx not in mine or not out_mine or mine[idx] != d or mine[op.name] != d:
                return f"a gather of {self.axis}s must read a whole source along the split index"
            return None
        if op.kind == "scatter":
            d = int(op.attrs.get("dim", 0))
            base = _act(op.args[0])
            idx, src = _act(op.args[2]), _act(op.args[3])
            if base in mine or idx not in mine or src not in mine or mine[src] != d or mine[idx] != d \
                    or not self.reduces(op, items):
                return f"a scatter of {self.axis}s must add a split source into a whole tensor"
            return None
        if self.reduces(op, items):                           # sum over the item dim
            return None
        if op.kind == "new_tensor":
            return None if not out_mine else "a new tensor of split size"
        if not out_mine:
            return f"turns {self.axis}-indexed values into whole ones"
        d = mine[op.name]
        if op.kind == "slice" and op.attrs.get("select"):
            (x,) = op.inputs
            dx = mine.get(x)
            sel = int(op.attrs.get("dim", 0))
            if dx is None or sel == dx or dx - (1 if sel < dx else 0) != d:
                return f"select along the {self.axis} dim"
            return None
        for v in op.inputs:
            if v not in mine:
                shape = _shape_of(op, v)
                if d < len(shape) and int(shape[d]) > 1:
                    return f"reads {v}, whole along the {self.axis} dim"
            elif mine[v] != d:
                return f"moves the {self.axis} dim ({mine[v]} -> {d})"
        if op.kind == "expand":
            x = _shape_of(op, op.inputs[0])
            if int(x[d]) != int(op.out_shape[d]) or (self.sample > 1 and int(x[0]) != int(op.out_shape[0])):
                return "expands along a split dim"
            return None
        if d not in ind:
            return f"{op.kind} does not run unchanged on blocks of dim {d}"
        return None

    # ---- cost ------------------------------------------------------------------------------
    def cost(self, layer: Layer, ctx: CostContext) -> LayerCost:
        """``price_replicated_weights`` on each op's largest local block (block 0 of every
        value's layout, partial values whole):

        compute = sum over ops of op_compute_s(local shapes): a gather of a block of E/p
                  edges moves |y|/p elements (``gather_scatter`` class), a scatter |src|/p,
                  the edge MLP's linears and the batched matmul of the messages work on E/p
                  rows (``matmul`` class)
        comm    = none inside the layer; resolving a partial output (all-reduce or
                  reduce-scatter over the p item ranks) is the outgoing edge's transition,
                  priced by the redistribution pricing
        grad    = all-reduce of the whole parameters over the world
        memory  = whole parameters, gradients, optimizer state + saved local activations
        """
        lays = self.value_layouts(layer)

        def local(op, ins, out):
            return ([lays[v].max_local_shape(s) for v, s in zip(op.inputs, op.in_shapes)],
                    lays[op.name].max_local_shape(op.out_shape))

        return price_replicated_weights(layer, Sharding(), ctx, compute_shapes=local)


def _shape_of(op: OpSpec, v: str) -> list[int]:
    return op.in_shapes[op.inputs.index(v)]


def _value_layouts(dec: ItemSplit, layer: Layer) -> dict[str, Sharding]:
    """``dec._value_layouts(layer)``, kept per (decomposition, layer object): the runtime asks
    for it on every op of every step."""
    key = (dec, id(layer))
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is layer:
        return hit[1]
    if len(_CACHE) > 4096:
        _CACHE.clear()
    lays = dec._value_layouts(layer)
    _CACHE[key] = (layer, lays)
    return lays


_CACHE: dict = {}

