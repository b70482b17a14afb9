"""A GPT with parallel blocks (GPT-J / PaLM): attention and MLP read the same normed input and
their results are added to the residual, ``x + attn(ln(x)) + mlp(ln(x))``.

The two branches of each block are independent, so SUPER's sub-graph parallelism can run them
on disjoint groups of processes (``autopar.decomp.branch``); ``PLANNING_UNITS`` makes each
block one planning unit (``blocks.{i}``, with ``blocks.{i}.attn`` and ``blocks.{i}.mlp`` its
branches). Position ids come from ``torch.arange`` and the causal mask from SDPA's
``is_causal``. Sizes are environment-tunable (``AUTOPAR_PGPT_LAYERS``, ``_EMBED``, ``_HEADS``,
``_SEQ``, ``_VOCAB``) so the same file serves tests and studies.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

LAYERS = int(os.environ.get("AUTOPAR_PGPT_LAYERS", 2))
EMBED = int(os.environ.get("AUTOPAR_PGPT_EMBED", 32))
HEADS = int(os.environ.get("AUTOPAR_PGPT_HEADS", 4))
SEQ = int(os.environ.get("AUTOPAR_PGPT_SEQ", 16))
VOCAB = int(os.environ.get("AUTOPAR_PGPT_VOCAB", 64))
DEFAULT_BATCH_SIZE = 8

# each parallel block is one unit (not "blocks.*", which would also match blocks.0.attn alone)
# (AUTOPAR_PGPT_UNITS=0: no units, every layer planned alone, e.g. for tensor-only plans)
PLANNING_UNITS = ([f"blocks.{i}" for i in range(LAYERS)]
                  if os.environ.get("AUTOPAR_PGPT_UNITS", "1") != "0" else [])


class Attention(nn.Module):
    """Separate q, k, v projections (as Llama-style models write them): a group of heads is a
    contiguous block of each projection's rows."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(EMBED, EMBED)
        self.k = nn.Linear(EMBED, EMBED)
        self.v = nn.Linear(EMBED, EMBED)
        self.proj = nn.Linear(EMBED, EMBED)

    def forward(self, x):
        n, s, e = x.shape
        q, k, v = (t(x).view(n, s, HEADS, e // HEADS).transpose(1, 2) for t in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(n, s, e))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(EMBED, 4 * EMBED)
        self.out = nn.Linear(4 * EMBED, EMBED)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class ParallelBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(EMBED)
        self.attn = Attention()
        self.mlp = MLP()

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h) + self.mlp(h)


class ParallelGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, EMBED)
        self.pos = nn.Embedding(SEQ, EMBED)
        self.blocks = nn.Sequential(*[ParallelBlock() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(EMBED)
        self.head = nn.Linear(EMBED, VOCAB, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln(self.blocks(x)))


def build_model():
    return ParallelGPT()


def example_inputs(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
