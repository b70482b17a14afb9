"""Held-out CNN (never used to choose a method or a constant; see README.md here): a small
DenseNet-style network. Each dense layer is batch norm -> ReLU -> 1x1 convolution -> batch norm
-> ReLU -> 3x3 convolution with growth 12, its output concatenated to its input; transitions
are a 1x1 convolution and a 2x2 average pool. 40x40 images, 7 classes."""

import torch
from torch import nn
import torch.nn.functional as F

DEFAULT_BATCH_SIZE = 12
GROWTH = 12


class DenseLayer(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.n1 = nn.BatchNorm2d(cin)
        self.c1 = nn.Conv2d(cin, 4 * GROWTH, 1, bias=False)
        self.n2 = nn.BatchNorm2d(4 * GROWTH)
        self.c2 = nn.Conv2d(4 * GROWTH, GROWTH, 3, padding=1, bias=False)

    def forward(self, x):
        y = self.c1(F.relu(self.n1(x)))
        y = self.c2(F.relu(self.n2(y)))
        return torch.cat([x, y], dim=1)


class Transition(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.n = nn.BatchNorm2d(cin)
        self.c = nn.Conv2d(cin, cout, 1, bias=False)

    def forward(self, x):
        return F.avg_pool2d(self.c(F.relu(self.n(x))), 2)


class DenseCNN(nn.Module):
    def __init__(self, classes=7):
        super().__init__()
        self.stem = nn.Conv2d(3, 2 * GROWTH, 3, padding=1, bias=False)
        layers, c = [], 2 * GROWTH
        for block, n in enumerate((3, 3, 3)):
            for _ in range(n):
                layers.append(DenseLayer(c))
                c += GROWTH
            if block < 2:
                layers.append(Transition(c, c // 2))
                c //= 2
        self.features = nn.Sequential(*layers)
        self.norm = nn.BatchNorm2d(c)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = F.relu(self.norm(self.features(self.stem(x))))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model():
    return DenseCNN()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 40, 40),)


def example_targets(batch_size):
    return torch.randint(0, 7, (batch_size,))
