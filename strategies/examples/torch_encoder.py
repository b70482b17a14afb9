"""``torch.nn.TransformerEncoder`` as people use it (a token embedding, learned positions, a
stack of ``nn.TransformerEncoderLayer`` with ``batch_first=True`` and pre-norm, a pooled
classification head), untouched by autopar. The encoder layer's fused fast path runs only in
evaluation without gradients; training (what is planned) takes its ordinary path (linear,
``scaled_dot_product_attention``, layer norm). Dropout is 0 so that validation compares bit
for bit. ``AUTOPAR_ENC_CAUSAL=1`` adds a causal mask built inside ``forward``
(``nn.Transformer.generate_square_subsequent_mask``). Sizes: ``AUTOPAR_ENC_LAYERS``, ``AUTOPAR_ENC_EMBED``, ``AUTOPAR_ENC_HEADS``,
``AUTOPAR_ENC_SEQ``, ``AUTOPAR_ENC_VOCAB``."""

import os

import torch
import torch.nn.functional as F
from torch import nn

LAYERS = int(os.environ.get("AUTOPAR_ENC_LAYERS", 2))
EMBED = int(os.environ.get("AUTOPAR_ENC_EMBED", 32))
HEADS = int(os.environ.get("AUTOPAR_ENC_HEADS", 4))
SEQ = int(os.environ.get("AUTOPAR_ENC_SEQ", 16))
VOCAB = int(os.environ.get("AUTOPAR_ENC_VOCAB", 64))
CLASSES = 5
CAUSAL = os.environ.get("AUTOPAR_ENC_CAUSAL", "0") == "1"
DEFAULT_BATCH_SIZE = 8


class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, EMBED)
        self.pos = nn.Parameter(torch.zeros(1, SEQ, EMBED).normal_(std=0.02))
        layer = nn.TransformerEncoderLayer(EMBED, HEADS, dim_feedforward=4 * EMBED, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, norm=nn.LayerNorm(EMBED),
                                             enable_nested_tensor=False)
        self.head = nn.Linear(EMBED, CLASSES)

    def forward(self, idx):
        mask = None
        if CAUSAL:   # a causal mask made inside forward from constants, as nn.Transformer users write it
            mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        x = self.encoder(self.tok(idx) + self.pos, mask=mask, is_causal=CAUSAL)
        return self.head(x.mean(dim=1))


def build_model():
    return EncoderClassifier()


def example_inputs(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size):
    return torch.randint(0, CLASSES, (batch_size,))


def loss_fn(logits, targets):
    return F.cross_entropy(logits, targets)
