"""Development-set CNN of the prediction benchmark (never measured into a profile, but its errors
chose methods and constants of the cost model, so it is not held out): a small 3-D CNN,
3x3x3 convolutions with 6 -> 24 channels on 20^3 volumes, one stride-2 stage, regression
output."""

import torch
from torch import nn

DEFAULT_BATCH_SIZE = 4


def build_model():
    return nn.Sequential(
        nn.Conv3d(1, 6, 3, padding=1), nn.ReLU(),
        nn.Conv3d(6, 12, 3, padding=1), nn.BatchNorm3d(12), nn.ReLU(),
        nn.Conv3d(12, 24, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv3d(24, 24, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(24, 3))


def example_inputs(batch_size):
    return (torch.randn(batch_size, 1, 20, 20, 20),)


def example_targets(batch_size):
    return torch.randn(batch_size, 3)
