"""A small residual CNN of convolution blocks (``blocks.i``) for pipeline stages that run the
solver's plan (``--stage-data plan``): spatial or channel splits inside a stage, halos exchanged
on each stage's own ranks. Sizes: ``AUTOPAR_CONV_LAYERS`` blocks (4), ``AUTOPAR_CONV_CH``
channels (8), ``AUTOPAR_CONV_SIDE`` pixels a side (16). ``AUTOPAR_CONV_BN=1`` adds batch norm;
``AUTOPAR_CONV_SKIP=1`` a long skip from the stem to the head, so that two values cross every
stage cut (the residual stream, and the stem's output passed on by the stages between)."""
import os

import torch
import torch.nn.functional as F
from torch import nn

LAYERS = int(os.environ.get("AUTOPAR_CONV_LAYERS", 4))
DEFAULT_BATCH_SIZE = 8
CH = int(os.environ.get("AUTOPAR_CONV_CH", 8))
SIDE = int(os.environ.get("AUTOPAR_CONV_SIDE", 16))


class Block(nn.Module):
    def __init__(self, bn: bool):
        super().__init__()
        self.conv = nn.Conv2d(CH, CH, 3, padding=1)
        self.bn = nn.BatchNorm2d(CH) if bn else None

    def forward(self, x):
        y = self.conv(x)
        if self.bn is not None:
            y = self.bn(y)
        return x + torch.relu(y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        bn = os.environ.get("AUTOPAR_CONV_BN") == "1"
        self.skip = os.environ.get("AUTOPAR_CONV_SKIP") == "1"
        self.stem = nn.Conv2d(3, CH, 3, padding=1)
        self.blocks = nn.ModuleList(Block(bn) for _ in range(LAYERS))
        self.head = nn.Linear(CH, 5)

    def forward(self, x):
        x = s = self.stem(x)
        for b in self.blocks:
            x = b(x)
        pooled = x.mean(dim=(2, 3))
        return self.head(pooled + s.mean(dim=(2, 3)) if self.skip else pooled)


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, SIDE, SIDE),)


def example_targets(batch_size):
    return torch.randint(0, 5, (batch_size,))


def loss_fn(output, targets):
    return F.cross_entropy(output, targets)
