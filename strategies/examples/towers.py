"""A multi-tower model: ``TOWERS`` independent MLP towers read the same features and are
joined by a sum (``AUTOPAR_TOWERS_JOIN=sum``, default) or a concatenation (``cat``), then a
shared head. The towers are the parallel branches of one planning unit (``towers``), which
SUPER's sub-graph parallelism (``autopar.decomp.branch``) runs on disjoint process groups.
Sizes: ``AUTOPAR_TOWERS`` (4), ``AUTOPAR_TOWERS_WIDTH`` (32), ``AUTOPAR_TOWERS_IN`` (16).
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

TOWERS = int(os.environ.get("AUTOPAR_TOWERS", 4))
WIDTH = int(os.environ.get("AUTOPAR_TOWERS_WIDTH", 32))
IN = int(os.environ.get("AUTOPAR_TOWERS_IN", 16))
JOIN = os.environ.get("AUTOPAR_TOWERS_JOIN", "sum")
CLASSES = 5
DEFAULT_BATCH_SIZE = 8

PLANNING_UNITS = ["towers"]


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(Tower() for _ in range(TOWERS))

    def forward(self, x):
        ys = [t(x) for t in self.towers]
        if JOIN == "cat":
            return torch.cat(ys, dim=-1)
        out = ys[0]
        for y in ys[1:]:
            out = out + y
        return out


class TowerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(IN, IN)
        self.towers = Towers()
        width = WIDTH * TOWERS if JOIN == "cat" else WIDTH
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        return self.head(F.relu(self.towers(F.relu(self.stem(x)))))


def build_model():
    return TowerNet()


def example_inputs(batch_size):
    return (torch.randn(batch_size, IN),)


def example_targets(batch_size):
    return torch.randint(0, CLASSES, (batch_size,))


def loss_fn(logits, targets):
    return F.cross_entropy(logits, targets)
