"""Pins: the user fixes some layers' decompositions (``autopar plan --pin 'PATTERN=WANT'``,
``PlanOptions(pins=...)``) and the solver chooses the rest.

A pin is ``PATTERN=KIND`` or ``PATTERN=CHOICE``. PATTERN is an ``fnmatch`` glob (case
sensitive) over each layer's module path and its layer name (``layer1.0.conv1``, ``conv2d_1``;
``*`` matches every layer). A KIND (``sample``, ``head``...) pins every matching layer where
the kind has a legal candidate to that kind: the layer keeps only the kind's legal candidates,
and the solver takes the cheapest of them for the whole plan (its transitions and memory
counted), so ``*=sample`` is the data-parallel plan, sample over the whole world, not a mix of
each layer's locally cheapest sample split. A CHOICE (``head(2,2)``, the decomposition's string
as plans print it) pins every matching layer where that exact candidate is legal to it.
Matching layers where the pin is not legal are left to the solver. Legal means legal before
pruning to ``--max-candidates``: a candidate the table would drop for price is still pinnable
(``pin_table``). When several pins take a layer, the last one given wins.

Bad input is a ``PinError``: an unknown kind, a pattern that matches no layer (with the layer
names nearest to it), or a pin legal on none of the layers it matches (with the legal kinds
and choices of the first of them).

``graphs`` is plan-level (whole graphs per rank, the user's module run natively, no per-layer
choice): it can only be pinned on every layer and alone, ``*=graphs`` (what ``--kinds graphs``
asks for) or the exact ``*=graphs(P,G)`` the plan prints.

Pure (no torch): parsing and matching need nothing else; ``pin_table`` reads a cost table.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .errors import AutoparError

#: the plan-level kind (``decomp.graph.graphs``): pinnable only as ``*=graphs``
PLAN_LEVEL_KIND = "graphs"

_KIND = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CHOICE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\(([^()]*)\)$")


class PinError(AutoparError):
    """A ``--pin`` that cannot hold: malformed, an unknown kind, a pattern matching no layer, or
    a decomposition legal on none of the layers it matches (names the legal ones)."""


@dataclass(frozen=True)
class Pin:
    """One pin: layers whose module or name matches ``pattern`` take ``want``, a decomposition
    kind (``sample``) or an exact choice (``head(2,2)``). ``str(pin)`` is the CLI form."""
    pattern: str
    want: str

    def __post_init__(self) -> None:
        pat, want = str(self.pattern).strip(), re.sub(r"\s*([(),x])\s*", r"\1", str(self.want).strip())
        if not pat:
            raise PinError(f"pin {self.pattern!r}={self.want!r} has an empty pattern",
                           "give a glob over module or layer names, e.g. 'layer1.*=channel', or '*' for all")
        if not (_KIND.match(want) or _CHOICE.match(want)):
            raise PinError(f"pin {pat}={self.want!r}: {self.want!r} is neither a decomposition kind nor a choice",
                           "give a kind (e.g. sample, spatial, head) or a choice as plans print it (e.g. head(2,2))")
        object.__setattr__(self, "pattern", pat)
        object.__setattr__(self, "want", want)

    @property
    def is_kind(self) -> bool:
        """True for a kind (any of its choices), False for an exact choice."""
        return bool(_KIND.match(self.want))

    @property
    def kind(self) -> str:
        """The decomposition kind pinned (``head`` of ``head(2,2)``)."""
        return self.want if self.is_kind else self.want.split("(", 1)[0]

    def matches(self, layer: Any) -> bool:
        """Whether the glob matches the layer's module path or its layer name."""
        names = [n for n in (getattr(layer, "module", "") or "", getattr(layer, "name", "") or "") if n]
        return any(fnmatch.fnmatchcase(n, self.pattern) for n in names)

    def accepts(self, dec: Any) -> bool:
        """Whether decomposition ``dec`` is what this pin asks for."""
        return dec.kind == self.want if self.is_kind else str(dec) == self.want

    def __str__(self) -> str:
        return f"{self.pattern}={self.want}"

    def to_json(self) -> dict[str, str]:
        return {"pattern": self.pattern, "want": self.want}

    @staticmethod
    def parse(text: str) -> "Pin":
        """``'PATTERN=WANT'`` (the CLI form; split at the last ``=``)."""
        s = str(text)
        if "=" not in s:
            raise PinError(f"--pin {text!r} is not PATTERN=KIND or PATTERN=CHOICE",
                           "write e.g. --pin '*=sample', --pin 'layer1.*=channel' or --pin 'h.0.attn=head(2,2)'")
        pat, _, want = s.rpartition("=")
        return Pin(pat, want)

    @staticmethod
    def coerce(obj: Any) -> "Pin":
        """A ``Pin`` from a Pin, ``'PATTERN=WANT'``, ``{"pattern", "want"}`` or ``(pattern, want)``."""
        if isinstance(obj, Pin):
            return obj
        if isinstance(obj, str):
            return Pin.parse(obj)
        if isinstance(obj, Mapping):
            unknown = sorted(set(obj) - {"pattern", "want"})
            if unknown or "pattern" not in obj or "want" not in obj:
                raise PinError(f"pin {dict(obj)!r} is not {{'pattern': ..., 'want': ...}}",
                               "write a pin as 'PATTERN=WANT' or {'pattern': 'layer1.*', 'want': 'channel'}")
            return Pin(obj["pattern"], obj["want"])
        if isinstance(obj, (tuple, list)) and len(obj) == 2:
            return Pin(obj[0], obj[1])
        raise PinError(f"cannot read pin {obj!r}", "write a pin as 'PATTERN=WANT', e.g. '*=sample'")


def parse_pins(items: Iterable[Any] | None) -> tuple[Pin, ...]:
    """Pins from the CLI's repeated ``--pin`` texts (or any form ``Pin.coerce`` reads)."""
    if items is None:
        return ()
    if isinstance(items, (str, Pin, Mapping)):
        items = [items]
    return tuple(Pin.coerce(p) for p in items)


def plan_level(pins: Sequence[Pin], world: int) -> bool:
    """True when the pins ask for the plan-level ``graphs`` decomposition (``*=graphs``, or an
    exact ``*=graphs(P,G)`` with P the world, which ``check_plan_level`` holds the plan to),
    alone; a graphs pin otherwise is a ``PinError``."""
    g = [p for p in pins if p.kind == PLAN_LEVEL_KIND]
    if not g:
        return False
    bad = [p for p in g if p.pattern != "*" or
           (not p.is_kind and p.want.split("(", 1)[1].split(",")[0].rstrip(")") != str(world))]
    if bad or len(g) != len(pins):
        raise PinError(f"--pin {bad[0] if bad else g[0]}: {PLAN_LEVEL_KIND} is a plan-level decomposition "
                       f"(whole graphs per rank, over all {world} ranks): it pins every layer or none",
                       f"pin it alone as '*={PLAN_LEVEL_KIND}' (what --kinds {PLAN_LEVEL_KIND} asks for)")
    return True


def check_plan_level(pin: Pin, choices: Sequence[str]) -> None:
    """An exact plan-level pin (``*=graphs(P,G)``) against the plan's choices: ``PinError`` when
    the graph-parallel plan made is another."""
    if not pin.is_kind and set(choices) != {pin.want}:
        raise PinError(f"--pin {pin}: the graph-parallel plan here is {', '.join(sorted(set(choices)))}, "
                       f"not {pin.want}", f"pin '*={PLAN_LEVEL_KIND}' or the choice named")


def near_names(pattern: str, layers: Sequence[Any], n: int = 6) -> list[str]:
    """Module / layer names closest to ``pattern`` (for the error of a pattern matching nothing)."""
    names: list[str] = []
    for lay in layers:
        for s in (getattr(lay, "module", "") or "", getattr(lay, "name", "") or ""):
            if s and s not in names:
                names.append(s)
    core = pattern.replace("*", "").replace("?", "")
    close = difflib.get_close_matches(core or pattern, names, n=n, cutoff=0.3)
    return close or names[:n]


def _legal_text(o: Any) -> str:
    """The legal kinds and choices of one layer's (unpruned) options."""
    kinds: list[str] = []
    for d in o.choices:
        if d.kind not in kinds:
            kinds.append(d.kind)
    return f"kinds {', '.join(kinds)}; choices {', '.join(str(d) for d in o.choices)}"


def _layer_label(lay: Any) -> str:
    return f"layer {lay.index} ({getattr(lay, 'module', '') or lay.name})"


def resolve(pins: Sequence[Pin], full: Any, registry: Mapping[str, Any],
            kinds: Sequence[str] | None = None) -> dict[int, tuple[list[int], Pin]]:
    """{table position: (the indices in ``full`` of the choices the pin leaves, the pin)} for
    ``full``, a cost table of every legal candidate (not pruned); the last pin taking a layer
    wins. ``PinError`` for an unknown kind, a pattern that matches nothing, a pin legal on
    none of the layers it matches, or a kind that ``kinds`` (``--kinds``) leaves out."""
    out: dict[int, tuple[list[int], Pin]] = {}
    layers = [o.layer for o in full.layers]
    for pin in pins:
        matched = [k for k, lay in enumerate(layers) if pin.matches(lay)]
        if not matched:
            raise PinError(f"--pin {pin}: the pattern {pin.pattern!r} matches no module or layer name of "
                           f"{len(layers)} layers; nearest names: {', '.join(near_names(pin.pattern, layers))}",
                           "fix the glob (fnmatch over module paths such as layer1.0.conv1 and layer names "
                           "such as conv2d_1; '*' for every layer)")
        first = full.layers[matched[0]]
        if pin.kind not in registry:
            raise PinError(f"--pin {pin}: unknown decomposition kind {pin.kind!r} (known: {', '.join(sorted(registry))}); "
                           f"{_layer_label(first.layer)}, the first layer it matches, takes {_legal_text(first)}",
                           "pin one of the kinds or choices listed")
        if kinds is not None and pin.kind not in kinds:
            raise PinError(f"--pin {pin}: kind {pin.kind!r} is not among the kinds planned with ({', '.join(kinds)})",
                           f"add {pin.kind} to --kinds, or drop --kinds")
        hit = 0
        for k in matched:
            idx = [i for i, d in enumerate(full.layers[k].choices) if pin.accepts(d)]
            if idx:
                out[k] = (idx, pin)
                hit += 1
        if not hit:
            why = (first.illegal or {}).get(pin.want) if not pin.is_kind else None
            raise PinError(f"--pin {pin}: {pin.want} is legal on none of the {len(matched)} layer(s) "
                           f"{pin.pattern!r} matches" + (f" ({why})" if why else "")
                           + f"; {_layer_label(first.layer)}, the first of them, takes {_legal_text(first)}",
                           "pin one of the kinds or choices listed, or a pattern over layers that take it")
    return out


def pin_table(table: Any, full: Any, resolved: Mapping[int, tuple[list[int], Pin]]) -> dict[int, str]:
    """``table`` with each pinned layer's options replaced by the choices its pin leaves, taken
    with their prices from ``full`` (the same table, unpruned); before the transitions are
    priced, so that they are priced for those choices only. Returns {layer index: the pin's
    text}."""
    if table.edges is not None:
        raise ValueError("pin_table pins a table before its transitions are priced (edges=False)")
    marks: dict[int, str] = {}
    layers = list(table.layers)
    for k, (idx, pin) in resolved.items():
        f = full.layers[k]
        layers[k] = dataclasses.replace(f, choices=[f.choices[i] for i in idx], costs=[f.costs[i] for i in idx],
                                        exact_keys=[f.exact_keys[i] for i in idx] if f.exact_keys else [])
        marks[f.layer.index] = str(pin)
    table.layers = layers
    return marks
