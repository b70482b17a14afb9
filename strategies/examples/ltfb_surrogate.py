"""A small surrogate regressor on a synthetic scientific data set, for tournament training (LTFB).

As in the LTFB paper's inertial-confinement-fusion surrogate: each sample has a few input
parameters and, as outputs, multi-variate scalars and small images. Here the simulator is a
cheap closed form: 5 input parameters -> 15 scalars (smooth functions of the parameters) and one
8x8 image (a Gaussian blob whose centre, width and brightness the parameters set). The model
maps the parameters to the scalars and the flattened image (mean squared error).

autopar model file: ``build_model()``, ``example_inputs``, ``example_targets``; for tournament
training also ``make_dataset(n_samples, seed)`` (the whole data set) and the default shard
(trainer t keeps the t-th contiguous block) and metric (loss on the held-out tournament set).
"""

import math
import os

import torch
from torch import nn

N_PARAMS = 5
N_SCALARS = 15
# sizes: small by default (2 CPU cores); AUTOPAR_SURROGATE_HIDDEN / _IMAGE scale it up for
# planning a cluster (benchmarks/ltfb_a100_simulation.py)
IMAGE = int(os.environ.get("AUTOPAR_SURROGATE_IMAGE", 8))
N_OUT = N_SCALARS + IMAGE * IMAGE
HIDDEN = int(os.environ.get("AUTOPAR_SURROGATE_HIDDEN", 32))
DEFAULT_BATCH_SIZE = 8


class Surrogate(nn.Module):
    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_PARAMS, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, N_OUT)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        return self.out(h)


def build_model() -> nn.Module:
    return Surrogate()


def simulate(params: torch.Tensor) -> torch.Tensor:
    """The synthetic 'simulator': (n, 5) parameters in [-1, 1] -> (n, 15 + 64) outputs."""
    p = params
    k = torch.arange(1, N_SCALARS + 1, dtype=p.dtype)
    scalars = torch.sin(k * p[:, :1] + p[:, 1:2]) * (1 + 0.5 * p[:, 2:3]) + 0.1 * k * p[:, 3:4] * p[:, 4:5]
    g = torch.linspace(-1, 1, IMAGE, dtype=p.dtype)
    yy, xx = torch.meshgrid(g, g, indexing="ij")
    cx, cy = 0.6 * p[:, 0, None, None], 0.6 * p[:, 1, None, None]
    width = 0.3 + 0.15 * (p[:, 2, None, None] + 1)
    bright = 1 + 0.5 * p[:, 3, None, None]
    img = bright * torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * width ** 2))
    return torch.cat([scalars, img.reshape(len(p), -1)], dim=1)


def make_dataset(n_samples: int, seed: int):
    """(inputs, targets) of ``n_samples`` samples, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    params = torch.rand(n_samples, N_PARAMS, generator=gen) * 2 - 1
    return (params,), simulate(params)


def example_inputs(batch_size: int):
    return make_dataset(batch_size, 0)[0]


def example_targets(batch_size: int):
    return make_dataset(batch_size, 0)[1]


#: bytes of one sample in storage (5 inputs + 79 outputs, float32): used by the ingestion model
SAMPLE_BYTES = 4 * (N_PARAMS + N_OUT)
assert math.isfinite(SAMPLE_BYTES)
