"""Llama 3 8B's shape (Meta's config: hidden 4096, 32 layers, 32 heads, 8 KV heads, SwiGLU 14336,
vocabulary 128256) as a Hugging Face ``LlamaForCausalLM`` built from a config (no weights),
in bfloat16, sequence ``AUTOPAR_LLAMA_SEQ`` (default 8192): for datasheet simulations only
(``benchmarks/fsdp_llama_simulation.py``); tracing happens on meta tensors."""

import os

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

SEQ = int(os.environ.get("AUTOPAR_LLAMA_SEQ", 8192))
VOCAB = 128256
DEFAULT_BATCH_SIZE = 8


def build_model():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=SEQ,
                      rope_theta=500000.0, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def example_inputs(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size):
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output, targets):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
