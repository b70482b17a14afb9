"""Held-out Transformer (never used to choose a method or a constant; see README.md here): a
small vision Transformer. 8x8 patches of a 48x48 image embedded by a strided convolution, a
learned position embedding, 3 pre-norm encoder blocks (6 heads over 96 features, attention
written with scaled_dot_product_attention, a GELU MLP of 4x width), mean pooling over the
patches and a linear head of 5 classes."""

import torch
from torch import nn
import torch.nn.functional as F

DEFAULT_BATCH_SIZE = 8
EMBED, HEADS, DEPTH, PATCH, IMAGE = 96, 6, 3, 8, 48


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(EMBED)
        self.qkv = nn.Linear(EMBED, 3 * EMBED)
        self.out = nn.Linear(EMBED, EMBED)
        self.ln2 = nn.LayerNorm(EMBED)
        self.fc1 = nn.Linear(EMBED, 4 * EMBED)
        self.fc2 = nn.Linear(4 * EMBED, EMBED)

    def forward(self, x):
        b, s, e = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(e, dim=-1)
        q, k, v = (t.view(b, s, HEADS, e // HEADS).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, e))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.patch = nn.Conv2d(3, EMBED, PATCH, stride=PATCH)
        self.pos = nn.Parameter(torch.zeros(1, (IMAGE // PATCH) ** 2, EMBED))
        self.blocks = nn.Sequential(*(Block() for _ in range(DEPTH)))
        self.ln = nn.LayerNorm(EMBED)
        self.head = nn.Linear(EMBED, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2) + self.pos
        x = self.ln(self.blocks(x))
        return self.head(x.mean(dim=1))


def build_model():
    return ViT()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, IMAGE, IMAGE),)


def example_targets(batch_size):
    return torch.randint(0, 5, (batch_size,))
