"""A Llama-style Hugging Face causal LM built from a small config (no weights, nothing
downloaded), untouched by autopar: RMSNorm, rotary position embeddings computed inside
``forward`` from ``torch.arange`` position ids, grouped-query attention (``num_key_value_heads``
below ``num_attention_heads``), SwiGLU feed-forward. It returns a ``CausalLMOutputWithPast``
holding the logits and a ``DynamicCache``; the loss reads ``output.logits``. Sizes are
environment-tunable (``AUTOPAR_HF_LAYERS``, ``AUTOPAR_HF_EMBED``, ``AUTOPAR_HF_HEADS``,
``AUTOPAR_HF_KV_HEADS``, ``AUTOPAR_HF_SEQ``, ``AUTOPAR_HF_VOCAB``)."""

import os

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

LAYERS = int(os.environ.get("AUTOPAR_HF_LAYERS", 2))
EMBED = int(os.environ.get("AUTOPAR_HF_EMBED", 32))
HEADS = int(os.environ.get("AUTOPAR_HF_HEADS", 4))
KV_HEADS = int(os.environ.get("AUTOPAR_HF_KV_HEADS", 2))
SEQ = int(os.environ.get("AUTOPAR_HF_SEQ", 16))
VOCAB = int(os.environ.get("AUTOPAR_HF_VOCAB", 64))
DEFAULT_BATCH_SIZE = 8


def build_model():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=EMBED, intermediate_size=2 * EMBED,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def example_inputs(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output, targets):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
