"""The traced program of a plan as steps: one ``OpStep`` per traced op and one ``MoveStep`` per
layout transition, layer by layer -- what the generated module writes out as ``self.op`` /
``self.move`` lines (``codegen.generate_module``) and what a pipeline stage running a plan on its
sub-mesh interprets over its own layers (``runtime.stage_program``). Written once here, so the two
cannot disagree. Pure: no torch.

A value is named in the steps by a *variable*: ``var(value)`` for the value as its producer left
it (or as a graph input arrives), ``var(value)__k`` for its k-th move to another layout; a move
of one value to one layout is made once and reused by every later layer reading it there (a
halo layout is its layer's own exchange: no move). The variables a layer range reads that it
does not make are its inputs (``program_inputs``).
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import PipelineError
from .sharding import Sharding, loss_sharding_for


def var(name: str) -> str:
    """A Python identifier for value ``name``."""
    v = name if name.isidentifier() and not keyword.iskeyword(name) else f"v_{name}"
    return v.replace(".", "_")


@dataclass(frozen=True)
class MoveStep:
    """``out = move(src_var)`` of ``value`` from ``src`` to ``dst`` on the way into ``layer``."""

    out: str
    src_var: str
    value: str
    src: Sharding
    dst: Sharding
    layer: int | None


@dataclass(frozen=True)
class OpStep:
    """``out = op(name, *args)`` of traced op ``name`` in ``layer`` (``args``: variables)."""

    out: str
    name: str
    args: tuple[str, ...]
    layer: int


@dataclass(frozen=True)
class LayerHeader:
    """Where layer ``layer`` starts (a comment in generated code)."""

    layer: int


def input_layout(graph, decs, name: str) -> Sharding:
    """The blocks graph input ``name`` is fed in: its first consumer's ``in_placement``, owned
    blocks only (a halo'd input is fed its Shard; the layer exchanges the halo)."""
    for lay in graph.layers:
        if name in lay.inputs:
            return decs[lay.index].in_placement(lay, name).owned()
    return Sharding()


def value_layout(graph, decs, value: str, producer: dict[str, int] | None = None) -> Sharding:
    """Where ``value`` lives as its producer leaves it (a graph input: ``input_layout``)."""
    prod = producer if producer is not None else graph.producer()
    if value in prod:
        li = prod[value]
        return decs[li].out_placement(graph.layers[li], value)
    return input_layout(graph, decs, value)


def program(graph, decs, layers: Iterable[int] | None = None) -> list:
    """The steps of ``layers`` (default: every layer, in graph order): per layer a
    ``LayerHeader``, the moves of its inputs into its layout, then its ops."""
    prod = graph.producer()
    keep = None if layers is None else set(int(i) for i in layers)
    moved: dict[tuple[str, Sharding], str] = {}
    steps: list = []
    for lay in graph.layers:
        if keep is not None and lay.index not in keep:
            continue
        dec = decs[lay.index]
        steps.append(LayerHeader(lay.index))
        local: dict[str, str] = {}
        for v in lay.inputs:
            src = value_layout(graph, decs, v, prod)
            dst = dec.in_placement(lay, v)
            if src.owned() == dst.owned():    # a halo (HaloShard) is the layer's own exchange
                local[v] = var(v)
                continue
            key = (v, dst)
            if key not in moved:
                moved[key] = f"{var(v)}__{len(moved)}"
                steps.append(MoveStep(moved[key], var(v), v, src, dst, lay.index))
            local[v] = moved[key]
        for op in lay.ops:
            steps.append(OpStep(var(op.name), op.name, tuple(local.get(v, var(v)) for v in op.inputs), lay.index))
    return steps


def loss_move(graph, decs, world: int) -> MoveStep | None:
    """The move of the graph's output into the layout the loss reads it in (samples split:
    ``loss_sharding_for``; the output's own layout when its producer computes the loss in place,
    a vocabulary-parallel head), or None when it is there already."""
    out = graph.output
    li = graph.producer()[out]
    here = decs[li].out_placement(graph.layers[li], out)
    there = (here if getattr(decs[li], "loss_in_place", False)
             else loss_sharding_for(here, graph.value_shape(out)[0], world))
    return None if there == here else MoveStep(var(out), var(out), out, here, there, None)


def program_inputs(steps: Sequence) -> list[str]:
    """The variables ``steps`` read before (or without) making them, in first-read order."""
    made: set[str] = set()
    out: list[str] = []
    for st in steps:
        reads = (st.src_var,) if isinstance(st, MoveStep) else st.args if isinstance(st, OpStep) else ()
        for r in reads:
            if r not in made and r not in out:
                out.append(r)
        if isinstance(st, (MoveStep, OpStep)):
            made.add(st.out)
    return out


def crossing(graph, decs, chunks: dict[int, list[int]]) -> dict[int, list[str]]:
    """{cut c (after chunk c): the values it carries}: every value made by chunk <= c (a graph
    input counts as made before chunk 0) that a chunk > c reads, in the order the graph makes
    them. A value read by an earlier chunk than the one making it is refused, naming it."""
    made_in: dict[str, int] = {gi.name: -1 for gi in graph.inputs}
    for c, layers in chunks.items():
        for li in layers:
            for op in graph.layers[li].ops:
                made_in[op.name] = c
    order = {v: k for k, v in enumerate(made_in)}
    by_var = {var(v): v for v in made_in}
    last = max(chunks)
    out: dict[int, set[str]] = {c: set() for c in chunks if c < last}
    for c, layers in chunks.items():
        reads = [by_var[r] for r in program_inputs(program(graph, decs, layers)) if r in by_var]
        if c == last:
            reads.append(graph.output)
        for v in reads:
            src = made_in[v]
            if src > c:
                raise PipelineError(f"value {v} (made in chunk {src}) is read by chunk {c}: it would cross a "
                                    "stage cut backwards", "plan with --pipeline off")
            for k in range(max(src, 0), c):
                out[k].add(v)
    return {c: sorted(vs, key=order.get) for c, vs in out.items()}


__all__ = ["crossing", "LayerHeader", "MoveStep", "OpStep", "input_layout", "loss_move", "program", "program_inputs",
           "value_layout", "var"]
