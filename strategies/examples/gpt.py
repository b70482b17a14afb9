"""A small hand-written GPT (decoder-only Transformer), untouched by autopar.

Position ids come from ``torch.arange`` inside ``forward`` and the causal mask from
``scaled_dot_product_attention(is_causal=True)``: ordinary tensors made from constants, which
autopar computes whole on every rank and slices where a consumer needs a block. Sizes are
environment-tunable (``AUTOPAR_GPT_LAYERS``, ``AUTOPAR_GPT_EMBED``, ``AUTOPAR_GPT_HEADS``,
``AUTOPAR_GPT_SEQ``, ``AUTOPAR_GPT_VOCAB``) so the same file serves tests and studies.
"""

import os

import torch
import torch.nn.functional as F
from torch import nn

LAYERS = int(os.environ.get("AUTOPAR_GPT_LAYERS", 2))
EMBED = int(os.environ.get("AUTOPAR_GPT_EMBED", 32))
HEADS = int(os.environ.get("AUTOPAR_GPT_HEADS", 4))
SEQ = int(os.environ.get("AUTOPAR_GPT_SEQ", 16))
VOCAB = int(os.environ.get("AUTOPAR_GPT_VOCAB", 64))
DEFAULT_BATCH_SIZE = 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(EMBED, 3 * EMBED)
        self.proj = nn.Linear(EMBED, EMBED)

    def forward(self, x):
        n, s, e = x.shape
        q, k, v = self.qkv(x).split(e, dim=-1)
        q, k, v = (t.view(n, s, HEADS, e // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(n, s, e))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(EMBED)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(EMBED)
        self.fc = nn.Linear(EMBED, 4 * EMBED)
        self.out = nn.Linear(4 * EMBED, EMBED)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, EMBED)
        self.pos = nn.Embedding(SEQ, EMBED)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(EMBED)
        self.head = nn.Linear(EMBED, VOCAB, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln(self.blocks(x)))


def build_model():
    return GPT()


def example_inputs(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
