"""A 2-D CNN for very large samples, in the spirit of the mesh-tangling model of Dryden et al.
(IPDPS 2019): few samples of 1024^2 (or more) pixels, a deep stack of 3x3 convolutions with
batch norm at full resolution and a few strided stages, predicting a per-sample target.

``SIZE`` defaults to 1024 for planning; set the environment variable AUTOPAR_MESH_SIZE (e.g. 128)
for a CPU run. Planning allocates nothing.
"""

import os

import torch
from torch import nn
import torch.nn.functional as F

SIZE = int(os.environ.get("AUTOPAR_MESH_SIZE", "1024"))
IN_CHANNELS = 18      # per-pixel mesh quality features
WIDTH = 32
NUM_OUTPUTS = 8
DEFAULT_BATCH_SIZE = 4


class Stage(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + y)


class MeshTangle2d(nn.Module):
    def __init__(self, w: int = WIDTH) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(IN_CHANNELS, w, 5, padding=2, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        self.s1 = Stage(w, w, 1)
        self.s2 = Stage(w, 2 * w, 2)
        self.s3 = Stage(2 * w, 4 * w, 2)
        self.s4 = Stage(4 * w, 4 * w, 2)
        self.head = nn.Linear(4 * w, NUM_OUTPUTS)

    def forward(self, x):
        x = self.s4(self.s3(self.s2(self.s1(self.stem(x)))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model() -> nn.Module:
    return MeshTangle2d()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, IN_CHANNELS, SIZE, SIZE),)


def example_targets(batch_size: int):
    return torch.randn(batch_size, NUM_OUTPUTS)


def loss_fn(output, target):
    return F.mse_loss(output, target)
