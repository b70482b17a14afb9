"""Graph-size files (``autopar plan --graph-sizes FILE``): node and edge counts of the graphs of
a data set, read into a ``GraphSizes`` value. Pure Python (no torch).

Format (text; comma, tab or blank separated)::

    # comment lines and blank lines are ignored
    nodes,edges[,count]          <- an optional header line, exactly these names
    14,30                        <- one graph: 14 nodes, 30 edges
    15,32,1200                   <- 1200 graphs of 15 nodes and 32 edges (a histogram row)

``nodes`` >= 1, ``edges`` >= 0 and ``count`` >= 1 are integers. Edges are counted as the model
sees them (a PyG ``edge_index`` column each: an undirected bond is usually two edges). A
malformed line is a ``GraphSizesError`` naming the file and the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import AutoparError

FORMAT_HINT = ("write one graph per line as 'nodes,edges' or a histogram row 'nodes,edges,count' "
               "(integers; '#' starts a comment; see autopar/cost/graph_sizes.py)")


class GraphSizesError(AutoparError):
    """A ``--graph-sizes`` file that cannot be read; names the file and the line."""


@dataclass(frozen=True)
class GraphSizes:
    """Node and edge counts of a data set's graphs, as distinct (nodes, edges) rows with the
    number of graphs of each (``counts``). ``source``: where they came from (a file name)."""
    nodes: tuple[int, ...]
    edges: tuple[int, ...]
    counts: tuple[int, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not (len(self.nodes) == len(self.edges) == len(self.counts)) or not self.nodes:
            raise GraphSizesError(f"graph sizes {self.source or ''}: no graphs, or rows of unequal length",
                                  FORMAT_HINT)

    @property
    def graphs(self) -> int:
        return int(sum(self.counts))

    @property
    def max_nodes(self) -> int:
        return max(self.nodes)

    @property
    def max_edges(self) -> int:
        return max(self.edges)

    def mean_nodes(self) -> float:
        return sum(n * c for n, c in zip(self.nodes, self.counts)) / self.graphs

    def mean_edges(self) -> float:
        return sum(e * c for e, c in zip(self.edges, self.counts)) / self.graphs

    @staticmethod
    def from_pairs(pairs, source: str = "in memory") -> "GraphSizes":
        """From (nodes, edges) pairs, one per graph (equal pairs are merged into counts)."""
        hist: dict[tuple[int, int], int] = {}
        for n, e in pairs:
            hist[(int(n), int(e))] = hist.get((int(n), int(e)), 0) + 1
        keys = sorted(hist)
        return GraphSizes(tuple(k[0] for k in keys), tuple(k[1] for k in keys),
                          tuple(hist[k] for k in keys), source)


_SPLIT = re.compile(r"[,\s]+")


def parse_graph_sizes(text: str, source: str = "graph sizes") -> GraphSizes:
    """Parse the text of a graph-size file (format in the module docstring)."""
    hist: dict[tuple[int, int], int] = {}
    header_seen = False
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        cols = [c for c in _SPLIT.split(line) if c]
        where = f"{source}, line {lineno}"
        if not header_seen and not hist and [c.lower() for c in cols] in (["nodes", "edges"],
                                                                          ["nodes", "edges", "count"]):
            header_seen = True
            continue
        if len(cols) not in (2, 3):
            raise GraphSizesError(f"{where}: {len(cols)} columns in {raw.strip()!r} (want nodes, edges "
                                  f"and optionally count)", FORMAT_HINT)
        try:
            vals = [int(c) for c in cols]
        except ValueError:
            raise GraphSizesError(f"{where}: not an integer in {raw.strip()!r}", FORMAT_HINT) from None
        n, e = vals[0], vals[1]
        c = vals[2] if len(vals) == 3 else 1
        if n < 1:
            raise GraphSizesError(f"{where}: {n} nodes (a graph has at least one node)", FORMAT_HINT)
        if e < 0:
            raise GraphSizesError(f"{where}: {e} edges (must be >= 0)", FORMAT_HINT)
        if c < 1:
            raise GraphSizesError(f"{where}: count {c} (must be >= 1)", FORMAT_HINT)
        hist[(n, e)] = hist.get((n, e), 0) + c
    if not hist:
        raise GraphSizesError(f"{source}: no graph sizes in the file", FORMAT_HINT)
    keys = sorted(hist)
    return GraphSizes(tuple(k[0] for k in keys), tuple(k[1] for k in keys),
                      tuple(hist[k] for k in keys), source)


def load_graph_sizes(path: str | Path) -> GraphSizes:
    """Read a graph-size file (``GraphSizesError`` if missing or malformed)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GraphSizesError(f"graph-size file not found: {p}", FORMAT_HINT) from None
    except (OSError, UnicodeDecodeError) as e:
        raise GraphSizesError(f"cannot read graph-size file {p}: {e}", FORMAT_HINT) from None
    return parse_graph_sizes(text, str(p))
