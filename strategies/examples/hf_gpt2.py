"""A Hugging Face GPT-2 causal LM built from a small config (no weights, nothing downloaded),
untouched by autopar: it returns a ``CausalLMOutputWithCrossAttentions`` holding the logits and
a ``DynamicCache``; the loss reads ``output.logits`` as a user's training loop does. Sizes are
environment-tunable (``AUTOPAR_HF_LAYERS``, ``AUTOPAR_HF_EMBED``, ``AUTOPAR_HF_HEADS``,
``AUTOPAR_HF_SEQ``, ``AUTOPAR_HF_VOCAB``). Dropout is off (as in ``hf_bert.py``): validation compares
bit for bit, and each block draws its own dropout mask."""

import os

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

LAYERS = int(os.environ.get("AUTOPAR_HF_LAYERS", 2))
EMBED = int(os.environ.get("AUTOPAR_HF_EMBED", 32))
HEADS = int(os.environ.get("AUTOPAR_HF_HEADS", 4))
SEQ = int(os.environ.get("AUTOPAR_HF_SEQ", 16))
VOCAB = int(os.environ.get("AUTOPAR_HF_VOCAB", 64))
DEFAULT_BATCH_SIZE = 8


def build_model():
    cfg = GPT2Config(n_layer=LAYERS, n_embd=EMBED, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def example_inputs(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output, targets):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
