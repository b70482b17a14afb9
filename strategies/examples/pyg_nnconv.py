"""An edge-conditioned GNN written as a PyTorch Geometric user writes it: ``NNConv`` with an
edge MLP, ``global_add_pool``, the usual PyG batch (``x``, ``edge_index``, ``edge_attr``,
``batch`` concatenated over the graphs of a mini-batch), mean absolute error loss. The model
code is plain PyG; autopar traces and splits it unchanged.

Sizes follow LBANN's PCQM4M model (CCGrid 2022) like ``gnn_pcqm4m.py``: 9 node and 3 edge
features, node / edge embeddings 100 / 16, edge MLP 16 -> 64 -> 32 -> F_in * F_out, NNConv
output 32, fully connected 256-128-32-8-1. ``global_add_pool`` needs the number of graphs as a
constant (``size=``): it is the batch size the model is built for (``AUTOPAR_GNN_GRAPHS``,
else ``DEFAULT_BATCH_SIZE``). ``AUTOPAR_GNN_NODES`` / ``_EDGES`` (the largest graph),
``AUTOPAR_GNN_NODE_EMBED``, ``AUTOPAR_GNN_OUT``, ``AUTOPAR_GNN_LAYERS`` shrink it for tests.
"""

import os
import random

import torch
import torch.nn.functional as F
from torch import nn
from torch_geometric.nn import NNConv, global_add_pool

NODES = int(os.environ.get("AUTOPAR_GNN_NODES", 51))
EDGES = int(os.environ.get("AUTOPAR_GNN_EDGES", 118))
NODE_FEATURES = 9
EDGE_FEATURES = 3
NODE_EMBED = int(os.environ.get("AUTOPAR_GNN_NODE_EMBED", 100))
EDGE_EMBED = 16
CONV_OUT = int(os.environ.get("AUTOPAR_GNN_OUT", 32))
LAYERS = int(os.environ.get("AUTOPAR_GNN_LAYERS", 1))
DEFAULT_BATCH_SIZE = 8
GRAPHS = int(os.environ.get("AUTOPAR_GNN_GRAPHS", DEFAULT_BATCH_SIZE))


def edge_mlp(f_in, f_out):
    return nn.Sequential(nn.Linear(EDGE_EMBED, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
                         nn.Linear(32, f_in * f_out))


class Net(nn.Module):
    def __init__(self, num_graphs=GRAPHS):
        super().__init__()
        self.num_graphs = num_graphs
        self.node_embed = nn.Linear(NODE_FEATURES, NODE_EMBED)
        self.edge_embed = nn.Linear(EDGE_FEATURES, EDGE_EMBED)
        convs = [NNConv(NODE_EMBED, CONV_OUT, edge_mlp(NODE_EMBED, CONV_OUT), aggr="add")]
        convs += [NNConv(CONV_OUT, CONV_OUT, edge_mlp(CONV_OUT, CONV_OUT), aggr="add")
                  for _ in range(LAYERS - 1)]
        self.convs = nn.ModuleList(convs)
        self.head = nn.Sequential(nn.Linear(CONV_OUT, 256), nn.ReLU(), nn.Linear(256, 128),
                                  nn.ReLU(), nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 8),
                                  nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x, edge_index, edge_attr, batch):
        h = F.relu(self.node_embed(x))
        e = F.relu(self.edge_embed(edge_attr))
        for conv in self.convs:
            h = F.relu(conv(h, edge_index, e))
        pooled = global_add_pool(h, batch, size=self.num_graphs)
        return self.head(pooled).squeeze(-1)


def build_model():
    return Net()


def graph_sizes(batch_size, seed=0):
    """Node and edge counts of ``batch_size`` molecule-like graphs (the same rule as the padded
    example; plain Python, so meta and real runs see the same sizes)."""
    rng = random.Random(seed)
    nodes = [rng.randint(max(2, NODES // 3), NODES) for _ in range(batch_size)]
    edges = [max(1, min(EDGES, 2 * n + rng.randint(-4, 4))) for n in nodes]
    return nodes, edges


def example_inputs(batch_size):
    """A PyG mini-batch of ``batch_size`` graphs concatenated: ``x [N, 9]``, ``edge_index
    [2, E]`` (global node ids, each edge inside its graph), ``edge_attr [E, 3]``, ``batch [N]``
    (graph id of each node). Built without reading tensor values (works on meta)."""
    if batch_size != GRAPHS:
        raise ValueError(f"pyg_nnconv is built for {GRAPHS} graphs per batch (global_add_pool "
                         f"size=); set AUTOPAR_GNN_GRAPHS={batch_size}")
    nodes, edges = graph_sizes(batch_size)
    n_tot, e_tot = sum(nodes), sum(edges)
    offsets = [sum(nodes[:g]) for g in range(batch_size)]
    n_of_edge = torch.tensor([n for n, e in zip(nodes, edges) for _ in range(e)], dtype=torch.long)
    off_of_edge = torch.tensor([o for o, e in zip(offsets, edges) for _ in range(e)], dtype=torch.long)
    src = (torch.rand(e_tot) * n_of_edge).long().clamp(max=n_of_edge - 1) + off_of_edge
    dst = (torch.rand(e_tot) * n_of_edge).long().clamp(max=n_of_edge - 1) + off_of_edge
    batch = torch.tensor([g for g, n in enumerate(nodes) for _ in range(n)], dtype=torch.long)
    return (torch.randn(n_tot, NODE_FEATURES), torch.stack([src, dst]),
            torch.randn(e_tot, EDGE_FEATURES), batch)


def example_targets(batch_size):
    return torch.randn(batch_size)


def ddp_shard(inputs, targets, rank, world):
    """What a data-parallel PyG user does (a DistributedSampler over graphs): rank ``rank``
    takes graphs ``[rank G / world, (rank + 1) G / world)`` of the batch, its nodes, its edges
    re-indexed to its own nodes, and builds the model for G / world graphs. With the same
    number of graphs per rank, DDP's mean of the ranks' mean losses is the batch's mean loss:
    the same function as the plan (autopar's DDP baseline uses this). Optional: without it the
    baseline splits whole graphs itself, from the trace's node / edge marks
    (``autopar.runtime.graphs.split_graph_batch``, also what the graph-parallel plan runs);
    ``tests/test_pyg_graphs.py`` checks the two splits are equal."""
    x, edge_index, edge_attr, batch = inputs
    g = int(targets.shape[0])
    if g % world:
        raise ValueError(f"{g} graphs do not split evenly over {world} ranks")
    g0, g1 = rank * g // world, (rank + 1) * g // world
    node = (batch >= g0) & (batch < g1)
    first = int(node.nonzero()[0, 0])
    edge = node[edge_index[0]]
    local = (x[node], edge_index[:, edge] - first, edge_attr[edge], batch[node] - g0)
    return local, targets[g0:g1], Net(num_graphs=g1 - g0)


def loss_fn(pred, target):
    return F.l1_loss(pred, target)
