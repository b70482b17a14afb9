"""A small hand-written Llama-style decoder for the tensor-parallel tests: RMSNorm, rotary
position embeddings, grouped-query attention (separate q/k/v projections, ``enable_gqa``), a
SwiGLU MLP, untied embedding and head. Sizes from ``AUTOPAR_LLAMA_*`` variables (heads, KV
heads, width, layers, sequence, vocabulary) so the same file serves the legality tests."""

import os

import torch
import torch.nn.functional as F
from torch import nn

LAYERS = int(os.environ.get("AUTOPAR_LLAMA_LAYERS", 1))
EMBED = int(os.environ.get("AUTOPAR_LLAMA_EMBED", 32))
HEADS = int(os.environ.get("AUTOPAR_LLAMA_HEADS", 4))
KV_HEADS = int(os.environ.get("AUTOPAR_LLAMA_KV_HEADS", 2))
SEQ = int(os.environ.get("AUTOPAR_LLAMA_SEQ", 8))
VOCAB = int(os.environ.get("AUTOPAR_LLAMA_VOCAB", 50))
HEAD_DIM = EMBED // HEADS
DEFAULT_BATCH_SIZE = 4


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(EMBED, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(EMBED, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(EMBED, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, EMBED, bias=False)

    def forward(self, x, cos, sin):
        n, s, _ = x.shape
        q = self.q_proj(x).view(n, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(n, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(n, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(n, s, HEADS * HEAD_DIM))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.RMSNorm(EMBED, eps=1e-6)
        self.attn = Attention()
        self.norm2 = nn.RMSNorm(EMBED, eps=1e-6)
        self.gate = nn.Linear(EMBED, 2 * EMBED, bias=False)
        self.up = nn.Linear(EMBED, 2 * EMBED, bias=False)
        self.down = nn.Linear(2 * EMBED, EMBED, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, EMBED)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(EMBED, eps=1e-6)
        self.head = nn.Linear(EMBED, VOCAB, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, idx):
        n, s = idx.shape
        pos = torch.arange(s, device=idx.device, dtype=self.inv_freq.dtype)
        emb = torch.cat([torch.outer(pos, self.inv_freq)] * 2, dim=-1)
        cos = emb.cos()[None, None].expand(n, 1, s, HEAD_DIM)
        sin = emb.sin()[None, None].expand(n, 1, s, HEAD_DIM)
        x = self.tok(idx)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(self.norm(x))


def build_model():
    return Llama()


def example_inputs(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
