"""A ResNet-style 2-D CNN (residual basic blocks, batch norm, max pooling, a linear head).

autopar model file: ``build_model()``, ``example_inputs(batch_size)``, ``example_targets``,
``loss_fn``. Small enough to train a few steps on 2 CPU cores; widen ``WIDTH`` for real use.
"""

import torch
from torch import nn
import torch.nn.functional as F

WIDTH = 16
NUM_CLASSES = 10
IMAGE = 32
DEFAULT_BATCH_SIZE = 16


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.down is None else self.down(x)
        return F.relu(out + identity)


class ResNet2d(nn.Module):
    def __init__(self, width: int = WIDTH, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.layer3 = nn.Sequential(BasicBlock(2 * width, 4 * width, 2), BasicBlock(4 * width, 4 * width))
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        x = self.pool(self.stem(x))
        x = self.layer3(self.layer2(self.layer1(x)))
        x = F.adaptive_avg_pool2d(x, 1)
        return self.head(torch.flatten(x, 1))


def build_model() -> nn.Module:
    return ResNet2d()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 3, IMAGE, IMAGE),)


def example_targets(batch_size: int):
    return torch.randint(0, NUM_CLASSES, (batch_size,))


def loss_fn(output, target):
    return F.cross_entropy(output, target)
