"""A wide residual CNN for 32x32 images (WRN-10-8 by default), written with torch.nn only.

Wide ResNets (Zagoruyko & Komodakis, BMVC 2016) widen ResNet's three stages from 16/32/64 to
16k/32k/64k channels; with k = 8 the stages hold 128/256/512 channels, the regime where channel
and filter parallelism (Dryden et al., SC 2019) pay: the weights, hence the data-parallel
gradient allreduce, grow as k^2 while a small batch keeps activations small.

Differences from the paper's WRN, chosen so that autopar sees one layer per conv:
* post-activation basic blocks (conv -> BN -> ReLU, as ResNet v1) instead of pre-activation,
  so every conv is followed by its own batch norm and ReLU (one anchor + transparent ops);
* no dropout inside blocks;
* a wide MLP head (linear -> BN -> ReLU -> linear) after global pooling, so that linear
  layers take part in channel/filter decisions too.

At batch 8 one training step is ~1.3 GFLOP per sample forward (~30 GFLOP per step with
backward): about a second on two CPU cores. The module defines the interface autopar's model
files follow: ``build_model``, ``example_inputs``, ``example_targets``, ``loss_fn``.

Shape legend: x_N3HW input images, N batch, C channels, H, W = 32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 10
IMAGE = 32


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU, conv3x3-BN, + shortcut (1x1 conv when the shape changes), ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (nn.Conv2d(c_in, c_out, 1, stride, 0, bias=False)
                         if stride != 1 or c_in != c_out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = x if self.shortcut is None else self.shortcut(x)
        return F.relu(out + skip)


class WideResNet(nn.Module):
    def __init__(self, depth: int = 10, width: int = 8, head: int = 1024,
                 num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"WRN depth must be 6n + 4, got {depth}")
        n = (depth - 4) // 6
        widths = [16, 16 * width, 32 * width, 64 * width]
        self.conv = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        blocks = []
        c_in = widths[0]
        for stage, c_out in enumerate(widths[1:]):
            for i in range(n):
                blocks.append(BasicBlock(c_in, c_out, 2 if (stage > 0 and i == 0) else 1))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc1 = nn.Linear(c_in, head, bias=False)
        self.bn_fc = nn.BatchNorm1d(head)
        self.fc2 = nn.Linear(head, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn(self.conv(x)))
        out = self.blocks(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        out = F.relu(self.bn_fc(self.fc1(out)))
        return self.fc2(out)


def build_model() -> nn.Module:
    """WRN-10-8 with a 1024-wide head: ~5.3 M parameters (seed torch before calling)."""
    return WideResNet()


def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    """Random images, identical on every rank (fixed generator)."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, IMAGE, IMAGE, generator=g),)


def example_targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the batch (a per-sample mean, as DistModel's loss share needs)."""
    return F.cross_entropy(output, target)
