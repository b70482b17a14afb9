"""A 3-D CNN for very large samples (volumes such as CT scans or cosmology cubes).

One sample is large (``SIZE``^3 voxels), the batch is small: the regime where one sample's
activations may not fit on one rank and spatial decomposition pays. ``SIZE`` defaults to 32
so that a CPU run takes seconds; set the environment variable AUTOPAR_CNN3D_SIZE (e.g. 128 or
512) to plan for real sizes: planning allocates nothing.
"""

import os

import torch
from torch import nn
import torch.nn.functional as F

SIZE = int(os.environ.get("AUTOPAR_CNN3D_SIZE", "32"))
CHANNELS = 8
NUM_OUTPUTS = 4
DEFAULT_BATCH_SIZE = 4


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm3d(cout)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class CNN3d(nn.Module):
    def __init__(self, c: int = CHANNELS) -> None:
        super().__init__()
        self.block1 = ConvBlock(1, c)
        self.block2 = ConvBlock(c, c)
        self.pool1 = nn.MaxPool3d(2)
        self.block3 = ConvBlock(c, 2 * c)
        self.block4 = ConvBlock(2 * c, 2 * c)
        self.pool2 = nn.MaxPool3d(2)
        self.block5 = ConvBlock(2 * c, 4 * c)
        self.head = nn.Linear(4 * c, NUM_OUTPUTS)

    def forward(self, x):
        x = self.block2(self.block1(x))
        x = self.pool1(x)
        y = self.block3(x)
        x = self.block4(y) + y          # a residual connection
        x = self.block5(self.pool2(x))
        x = torch.flatten(F.adaptive_avg_pool3d(x, 1), 1)
        return self.head(x)


def build_model() -> nn.Module:
    return CNN3d()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 1, SIZE, SIZE, SIZE),)


def example_targets(batch_size: int):
    return torch.randn(batch_size, NUM_OUTPUTS)


def loss_fn(output, target):
    return F.mse_loss(output, target)
