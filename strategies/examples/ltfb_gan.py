"""A small GAN for tournament training (LTFB): a generator and a discriminator in one module.

The real data are 4-D points on a noisy curve (a stand-in for scientific samples). One
training step updates both networks at once (simultaneous gradient descent on the minimax
game): the module's forward returns the discriminator's logits on real samples and on
generated ones, and the generated samples, side by side ``[B, 1 + 1 + 4]``; the loss is the
discriminator's cross-entropy, and the generated samples reach the discriminator through a
gradient reversal ``2 * g.detach() - g`` (the identity forward, the negated gradient
backward), so the generator ascends the loss the discriminator descends.

Tournament: both networks are exchanged (they are one module), and the metric is this file's
``tournament_metric``: how far the generated samples' mean and covariance are from the
held-out real samples' (lower is better), computed from the full output and targets.
"""

import torch
from torch import nn
import torch.nn.functional as F

DIM = 4
NOISE = 8
HIDDEN = 32
DEFAULT_BATCH_SIZE = 8


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(NOISE, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, DIM))
        self.discriminator = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))

    def forward(self, z, x_real):
        fake = self.generator(z)
        reversed_fake = 2 * fake.detach() - fake       # identity forward, -gradient backward
        return torch.cat([self.discriminator(x_real), self.discriminator(reversed_fake), fake], dim=1)


def build_model() -> nn.Module:
    return GAN()


def loss_fn(output, target=None):
    """Discriminator cross-entropy: real -> 1, generated -> 0 (per-sample mean)."""
    real, fake = output[:, 0], output[:, 1]
    return 0.5 * (F.binary_cross_entropy_with_logits(real, torch.ones_like(real))
                  + F.binary_cross_entropy_with_logits(fake, torch.zeros_like(fake)))


def real_samples(n: int, gen: torch.Generator) -> torch.Tensor:
    t = torch.rand(n, 1, generator=gen) * 6 - 3
    base = torch.cat([t, torch.sin(t), torch.cos(2 * t), 0.3 * t * t], dim=1)
    return base + 0.05 * torch.randn(n, DIM, generator=gen)


def make_dataset(n_samples: int, seed: int):
    """Inputs (noise, real samples); no targets (the loss needs none)."""
    gen = torch.Generator().manual_seed(seed)
    x = real_samples(n_samples, gen)
    z = torch.randn(n_samples, NOISE, generator=gen)
    return (z, x), None


def tournament_metric(output, inputs, target):
    """Moment distance between generated and real samples of the tournament set (lower wins)."""
    fake = output[:, 2:]
    real = inputs[1]
    dm = (fake.mean(0) - real.mean(0)).pow(2).sum()
    dc = (torch.cov(fake.T) - torch.cov(real.T)).pow(2).sum()
    return float(dm + dc)


def example_inputs(batch_size: int):
    return make_dataset(batch_size, 0)[0]


def example_targets(batch_size: int):
    return None
