"""An edge-conditioned GNN (NNConv) on molecule graphs padded to fixed sizes, as in LBANN's
PCQM4M model (CCGrid 2022): every graph padded to ``NODES`` nodes and ``EDGES`` edges, so a
mini-batch is a dense tensor and the gather / scatter work of message passing splits evenly.

Padding is exact. The model appends one zero node (index ``NODES``) to every graph; a padded
edge has source and destination ``NODES``: it gathers zeros, its message is scattered into that
extra node, and the extra node is dropped after the scatter. Padded nodes are zero and are
masked out of the sum pooling by ``node_mask``.

Sizes (LBANN's PCQM4M): 51 nodes, 118 edges, 9 node and 3 edge features; node / edge
embeddings 100 / 16; edge MLP 16 -> 64 -> 32 -> F_in * F_out; NNConv output 32; fully
connected 256-128-32-8-1; mean absolute error loss. ``AUTOPAR_GNN_NODE_EMBED``,
``AUTOPAR_GNN_OUT``, ``AUTOPAR_GNN_LAYERS`` shrink the model for tests.
"""

import os
import random

import torch
import torch.nn.functional as F
from torch import nn

NODES = int(os.environ.get("AUTOPAR_GNN_NODES", 51))
EDGES = int(os.environ.get("AUTOPAR_GNN_EDGES", 118))
NODE_FEATURES = 9
EDGE_FEATURES = 3
NODE_EMBED = int(os.environ.get("AUTOPAR_GNN_NODE_EMBED", 100))
EDGE_EMBED = 16
CONV_OUT = int(os.environ.get("AUTOPAR_GNN_OUT", 32))
LAYERS = int(os.environ.get("AUTOPAR_GNN_LAYERS", 1))
DEFAULT_BATCH_SIZE = 8


class DenseNNConv(nn.Module):
    """NNConv (Gilmer et al.) on padded graphs: ``x'_i = Theta x_i + sum_{j -> i} x_j W(e_ji)``,
    ``W(e) = MLP(e)`` reshaped to ``[F_in, F_out]``, aggregated with a sum."""

    def __init__(self, f_in, f_out):
        super().__init__()
        self.f_in, self.f_out = f_in, f_out
        self.edge_mlp = nn.Sequential(nn.Linear(EDGE_EMBED, 64), nn.ReLU(), nn.Linear(64, 32),
                                      nn.ReLU(), nn.Linear(32, f_in * f_out))
        self.root = nn.Linear(f_in, f_out)

    def forward(self, x, e, src, dst):
        b, n, f = x.shape
        e_count = src.shape[1]
        x_pad = F.pad(x, (0, 0, 0, 1))                                   # [B, N+1, F_in]
        x_src = torch.gather(x_pad, 1, src.unsqueeze(-1).expand(b, e_count, f))
        w = self.edge_mlp(e).view(b, e_count, self.f_in, self.f_out)     # [B, E, F_in, F_out]
        msg = torch.matmul(x_src.unsqueeze(2), w).squeeze(2)             # [B, E, F_out]
        agg = torch.zeros(b, n + 1, self.f_out, dtype=x.dtype, device=x.device)
        agg = agg.scatter_add(1, dst.unsqueeze(-1).expand(b, e_count, self.f_out), msg)
        return self.root(x) + agg[:, :n]


class PaddedNNConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.node_embed = nn.Linear(NODE_FEATURES, NODE_EMBED)
        self.edge_embed = nn.Linear(EDGE_FEATURES, EDGE_EMBED)
        convs = [DenseNNConv(NODE_EMBED, CONV_OUT)]
        convs += [DenseNNConv(CONV_OUT, CONV_OUT) for _ in range(LAYERS - 1)]
        self.convs = nn.ModuleList(convs)
        self.head = nn.Sequential(nn.Linear(CONV_OUT, 256), nn.ReLU(), nn.Linear(256, 128),
                                  nn.ReLU(), nn.Linear(128, 32), nn.ReLU(), nn.Linear(32, 8),
                                  nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x, e, src, dst, node_mask):
        h = F.relu(self.node_embed(x))
        ee = F.relu(self.edge_embed(e))
        for conv in self.convs:
            h = F.relu(conv(h, ee, src, dst))
        pooled = (h * node_mask.unsqueeze(-1)).sum(dim=1)               # global add pool
        return self.head(pooled).squeeze(-1)


def build_model():
    return PaddedNNConvNet()


def graph_sizes(batch_size, seed=0):
    """Node and edge counts of ``batch_size`` molecule-like graphs (at most NODES / EDGES):
    plain Python, so the same sizes come out on the meta device and on a real one."""
    rng = random.Random(seed)
    nodes = [rng.randint(max(2, NODES // 3), NODES) for _ in range(batch_size)]
    edges = [max(1, min(EDGES, 2 * n + rng.randint(-4, 4))) for n in nodes]
    return nodes, edges


def example_inputs(batch_size):
    """A padded batch: features of padded nodes / edges are zero, padded edges point at the
    extra node ``NODES`` (source and destination), ``node_mask`` marks real nodes. Built
    without reading tensor values, so it also works on the meta device."""
    nodes, edges = graph_sizes(batch_size)
    n_t = torch.tensor(nodes, dtype=torch.long).unsqueeze(1)
    e_t = torch.tensor(edges, dtype=torch.long).unsqueeze(1)
    node_mask = (torch.arange(NODES).unsqueeze(0) < n_t).to(torch.float32)      # [B, N]
    edge_mask = torch.arange(EDGES).unsqueeze(0) < e_t                          # [B, E]
    x = torch.randn(batch_size, NODES, NODE_FEATURES) * node_mask.unsqueeze(-1)
    e = torch.randn(batch_size, EDGES, EDGE_FEATURES) * edge_mask.unsqueeze(-1).to(torch.float32)
    src = (torch.rand(batch_size, EDGES) * n_t).long().clamp(max=NODES - 1)
    dst = (torch.rand(batch_size, EDGES) * n_t).long().clamp(max=NODES - 1)
    pad = torch.full_like(src, NODES)
    return x, e, torch.where(edge_mask, src, pad), torch.where(edge_mask, dst, pad), node_mask


def example_targets(batch_size):
    return torch.randn(batch_size)


def loss_fn(pred, target):
    return F.l1_loss(pred, target)
