"""A model file of blocks with batch norm that offers ``pipeline_parts()``: what the pipeline
tests plan and execute to check running statistics under data-parallel stages."""
import torch
import torch.nn.functional as F
from torch import nn

LAYERS = 4
DEFAULT_BATCH_SIZE = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        return x + torch.relu(self.bn(self.lin(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.blocks, self.post = nn.Linear(4, 6), nn.ModuleList(Block() for _ in range(LAYERS)), nn.Linear(6, 2)

    def pipeline_parts(self):
        return self.pre, list(self.blocks), self.post

    def forward(self, x):
        x = self.pre(x)
        for b in self.blocks:
            x = b(x)
        return self.post(x)


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 4),)


def example_targets(batch_size):
    return torch.randint(0, 2, (batch_size,))


def loss_fn(output, targets):
    return F.cross_entropy(output, targets)
