"""The ResNet-style example without batch norm: torch DDP computes exactly the single-process
function on it, so it is the fair model for the data-parallel vs DDP benchmark."""

import torch
from torch import nn
import torch.nn.functional as F

WIDTH = 32
NUM_CLASSES = 10
IMAGE = 32
DEFAULT_BATCH_SIZE = 32


class Block(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.down = nn.Conv2d(cin, cout, 1, stride=stride) if (stride != 1 or cin != cout) else None

    def forward(self, x):
        out = self.conv2(F.relu(self.conv1(x)))
        return F.relu(out + (x if self.down is None else self.down(x)))


class Net(nn.Module):
    def __init__(self, w=WIDTH):
        super().__init__()
        self.stem = nn.Conv2d(3, w, 3, padding=1)
        self.layer1 = Block(w, w)
        self.layer2 = Block(w, 2 * w, 2)
        self.layer3 = Block(2 * w, 4 * w, 2)
        self.head = nn.Linear(4 * w, NUM_CLASSES)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, IMAGE, IMAGE),)


def example_targets(batch_size):
    return torch.randint(0, NUM_CLASSES, (batch_size,))


def loss_fn(output, target):
    return F.cross_entropy(output, target)
