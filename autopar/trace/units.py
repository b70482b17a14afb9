"""Sub-graph planning units: merge the layers of one module (an attention block, a
message-passing step, a branch) into one unit with several inputs and outputs.

The tracer makes chain layers (an anchor op and the layout-transparent ops after it). A model
file may name modules whose whole sub-graph is decided as one unit (``planning_units`` in the
model file, module paths or ``fnmatch`` patterns such as ``"blocks.*.attn"``): every layer whose
module is the named one or inside it joins that unit. The unit's

* ``ops`` are its layers' ops in the traced order (a valid execution order);
* ``inputs`` are the values its ops read that it does not produce, in first-use order;
* ``outputs`` are the values it produces that an op outside it reads, or the graph's output
  (``Layer.output`` is the last of them, the others are ``side_outputs``).

A layer made from constants only (no input from another layer: an empty key/value cache tensor
lifted into an attention module) joins no unit: it is computed whole on every rank, and inside
a unit it would leave the unit no split but replication.

Merging must not create a cycle: when a layer outside the unit both reads from it and feeds
it (``u1 -> x -> u2``), the unit cannot run as one step and ``UnitError`` names the unit and
the layer in between. Units are placed in a topological order of the merged graph, and layers
are renumbered in it. Pure: no torch.
"""

from __future__ import annotations

import fnmatch
from typing import Sequence

from ..decomp.ir import Layer, LayerGraphData
from ..errors import AutoparError


class UnitError(AutoparError):
    """A declared planning unit cannot be one planning unit (the message says why)."""


def unit_of(module: str, patterns: Sequence[str]) -> str | None:
    """The first pattern naming ``module`` or a module above it (``a.b`` is inside ``a``)."""
    parts = module.split(".") if module else []
    for pat in patterns:
        for k in range(len(parts), 0, -1):
            prefix = ".".join(parts[:k])
            if prefix == pat or fnmatch.fnmatchcase(prefix, pat):
                return prefix
    return None


def merge_units(graph: LayerGraphData, patterns: Sequence[str]) -> LayerGraphData:
    """A copy of ``graph`` with the layers of every module matched by ``patterns`` merged into
    one unit each (see the module docstring); ``graph`` itself is unchanged."""
    if not patterns:
        return graph
    groups: dict[str, list[Layer]] = {}
    key_of: dict[int, str] = {}
    for lay in graph.layers:
        # a layer made from constants only (an empty cache tensor lifted into an attention
        # module) is computed whole on every rank: inside a unit it would make the unit's
        # every split illegal, so it stays a layer of its own
        const = not lay.inputs and any(op.attrs.get("constant") for op in lay.ops)
        u = None if const else unit_of(lay.module or lay.anchor.module, patterns)
        key = f"unit:{u}" if u is not None else f"layer:{lay.index}"
        groups.setdefault(key, []).append(lay)
        key_of[lay.index] = key
    if all(len(g) == 1 for g in groups.values()):
        return graph
    produced_in = {op.name: key_of[lay.index] for lay in graph.layers for op in lay.ops}
    readers: dict[str, set[str]] = {}
    for lay in graph.layers:
        for op in lay.ops:
            for v in op.inputs:
                readers.setdefault(v, set()).add(key_of[lay.index])
    # unit dependency graph, and the cycle check
    deps: dict[str, set[str]] = {k: set() for k in groups}
    for key, lays in groups.items():
        for lay in lays:
            for op in lay.ops:
                for v in op.inputs:
                    src = produced_in.get(v)
                    if src is not None and src != key:
                        deps[key].add(src)
    order = _topo(deps, [key_of[lay.index] for lay in graph.layers])
    layers: list[Layer] = []
    for key in order:
        lays = groups[key]
        if len(lays) == 1 and key.startswith("layer:"):
            lay = lays[0]
            layers.append(Layer(index=len(layers), name=lay.name, ops=list(lay.ops),
                                inputs=list(lay.inputs), output=lay.output, module=lay.module,
                                side_outputs=list(lay.side_outputs)))
            continue
        ops = [op for lay in sorted(lays, key=lambda x: x.index) for op in lay.ops]
        mine = {op.name for op in ops}
        inputs: list[str] = []
        for op in ops:
            for v in op.inputs:
                if v not in mine and v not in inputs:
                    inputs.append(v)
        leaving = [op.name for op in ops
                   if (readers.get(op.name, set()) - {key}) or op.name == graph.output]
        if not leaving:
            raise UnitError(f"planning unit {key[5:]} produces nothing used outside it",
                            "name a module whose result the model uses")
        layers.append(Layer(index=len(layers), name=ops[0].name, ops=ops, inputs=inputs,
                            output=leaving[-1], module=key[5:], side_outputs=leaving[:-1]))
    return LayerGraphData(layers=layers, inputs=list(graph.inputs), output=graph.output,
                          batch_size=graph.batch_size, model_name=graph.model_name,
                          buffer_updates=list(graph.buffer_updates), tracer=graph.tracer)


def _topo(deps: dict[str, set[str]], traced_order: list[str]) -> list[str]:
    """Kahn's algorithm, ties broken by first appearance in the traced order; a cycle through
    a unit raises ``UnitError`` naming it and a unit or layer on the cycle."""
    first: dict[str, int] = {}
    for i, k in enumerate(traced_order):
        first.setdefault(k, i)
    users: dict[str, set[str]] = {k: set() for k in deps}
    for k, ds in deps.items():
        for d in ds:
            users[d].add(k)
    missing = {k: len(ds) for k, ds in deps.items()}
    ready = sorted((k for k, n in missing.items() if n == 0), key=first.get)
    out: list[str] = []
    while ready:
        k = ready.pop(0)
        out.append(k)
        for u in users[k]:
            missing[u] -= 1
            if missing[u] == 0:
                ready.append(u)
        ready.sort(key=first.get)
    if len(out) < len(deps):
        stuck = sorted((k for k in deps if k not in out), key=first.get)
        unit = next((k for k in stuck if k.startswith("unit:")), stuck[0])
        other = next((k for k in stuck if k != unit), "?")
        raise UnitError(f"planning unit {unit[5:]} cannot be one unit: {other.replace('layer:', 'layer ')} "
                        f"both reads from it and feeds it",
                        "name a smaller module, or one that encloses both")
    return out
