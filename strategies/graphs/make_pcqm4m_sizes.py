"""Write ``pcqm4m_sizes.csv``: a SYNTHETIC graph-size distribution shaped like PCQM4M-LSC (v2),
for ``autopar plan --graph-sizes``. It is not the data set's real size list (that needs the
data set, which is not downloaded here); it matches the published summary figures:

* 3,746,620 graphs (OGB PCQM4Mv2);
* mean 14.1 nodes (heavy atoms) and 14.6 bonds per graph (OGB's table), a bond being two
  directed edges as a PyG ``edge_index`` holds it (mean ~29 edges);
* at most 51 nodes and 118 edges (LBANN's padded sizes for PCQM4M, CCGrid 2022).

Stated distribution (seeded, deterministic): nodes = round(Normal(14.1, 3.4)) clipped to
[2, 30] for 99.9 % of graphs and uniform on [20, 51] for a 0.1 % tail; bonds = nodes - 1 +
rings, rings ~ Poisson(1.5) capped so that bonds <= nodes * (nodes - 1) / 2 and bonds <= 59;
edges = 2 * bonds; one graph of 51 nodes and 118 edges is included (the published maxima).

    python strategies/graphs/make_pcqm4m_sizes.py      # writes pcqm4m_sizes.csv beside itself
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

GRAPHS = 3_746_620
SEED = 0


def sizes(graphs: int = GRAPHS, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = np.clip(np.rint(rng.normal(14.1, 3.4, graphs)), 2, 30).astype(np.int64)
    tail = rng.random(graphs) < 1e-3
    n[tail] = rng.integers(20, 52, int(tail.sum()))
    rings = rng.poisson(1.5, graphs)
    bonds = np.minimum(np.minimum(n - 1 + rings, n * (n - 1) // 2), 59)
    e = 2 * bonds
    n[-1], e[-1] = 51, 118
    return n, e


def main() -> int:
    n, e = sizes()
    pairs, counts = np.unique(np.stack([n, e], 1), axis=0, return_counts=True)
    out = Path(__file__).with_name("pcqm4m_sizes.csv")
    lines = ["# SYNTHETIC PCQM4M-like graph sizes (not the real data set), written by",
             "# strategies/graphs/make_pcqm4m_sizes.py (distribution stated there).",
             f"# {GRAPHS} graphs; mean {n.mean():.2f} nodes, {e.mean():.2f} edges ({e.mean() / 2:.2f} bonds); "
             f"max {n.max()} nodes, {e.max()} edges",
             "nodes,edges,count"]
    lines += [f"{a},{b},{c}" for (a, b), c in zip(pairs.tolist(), counts.tolist())]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}: {len(pairs)} distinct sizes; mean {n.mean():.2f} nodes, {e.mean():.2f} edges")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
