"""Development-set CNN of the prediction benchmark (never measured into a profile, but its errors
chose methods and constants of the cost model, so it is not held out): a VGG-like plain
stack, 5x5 then 3x3 convolutions, channels 24 -> 96, 40x40 images, max pooling, batch norm."""

import torch
from torch import nn

DEFAULT_BATCH_SIZE = 16


def _stage(cin, cout, k, n):
    layers = []
    for i in range(n):
        layers += [nn.Conv2d(cin if i == 0 else cout, cout, k, padding=k // 2, bias=False),
                   nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*layers, nn.MaxPool2d(2))


def build_model():
    return nn.Sequential(_stage(3, 24, 5, 1), _stage(24, 48, 3, 2), _stage(48, 96, 3, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(96, 20))


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 40, 40),)


def example_targets(batch_size):
    return torch.randint(0, 20, (batch_size,))
