"""Development-set CNN of the prediction benchmark (never measured into a profile, but its errors
chose methods and constants of the cost model, so it is not held out): a ResNet-like
network of bottleneck blocks (1x1 -> 3x3 -> 1x1) with odd widths (20, 40, 80), stride-2
stages and 36x36 images."""

import torch
from torch import nn
import torch.nn.functional as F

DEFAULT_BATCH_SIZE = 16


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, cout, stride):
        super().__init__()
        self.a = nn.Conv2d(cin, mid, 1, bias=False)
        self.na = nn.BatchNorm2d(mid)
        self.b = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False)
        self.nb = nn.BatchNorm2d(mid)
        self.c = nn.Conv2d(mid, cout, 1, bias=False)
        self.nc = nn.BatchNorm2d(cout)
        self.skip = (nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
                     if stride != 1 or cin != cout else None)

    def forward(self, x):
        y = F.relu(self.na(self.a(x)))
        y = F.relu(self.nb(self.b(y)))
        y = self.nc(self.c(y))
        return F.relu(y + (x if self.skip is None else self.skip(x)))


def build_model():
    return nn.Sequential(nn.Conv2d(3, 20, 3, padding=1, bias=False), nn.BatchNorm2d(20), nn.ReLU(),
                         Bottleneck(20, 10, 40, 1), Bottleneck(40, 20, 80, 2), Bottleneck(80, 20, 80, 1),
                         Bottleneck(80, 40, 160, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(160, 12))


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 36, 36),)


def example_targets(batch_size):
    return torch.randint(0, 12, (batch_size,))
