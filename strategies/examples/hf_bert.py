"""A Hugging Face BERT encoder with a masked-LM head, built from a small config (no weights,
nothing downloaded), untouched by autopar. It returns a ``MaskedLMOutput``; the loss reads
``output.logits``. ``AUTOPAR_BERT_HEAD=classification`` builds ``BertForSequenceClassification``
instead (logits per sequence, integer class targets). Sizes are environment-tunable
(``AUTOPAR_HF_LAYERS``, ``AUTOPAR_HF_EMBED``, ``AUTOPAR_HF_HEADS``, ``AUTOPAR_HF_SEQ``,
``AUTOPAR_HF_VOCAB``). Dropout is off: a dropout mask is drawn per block, so with it a
distributed run equals one process in distribution only, and validation compares bit for bit."""

import os

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

LAYERS = int(os.environ.get("AUTOPAR_HF_LAYERS", 2))
EMBED = int(os.environ.get("AUTOPAR_HF_EMBED", 32))
HEADS = int(os.environ.get("AUTOPAR_HF_HEADS", 4))
SEQ = int(os.environ.get("AUTOPAR_HF_SEQ", 16))
VOCAB = int(os.environ.get("AUTOPAR_HF_VOCAB", 64))
HEAD = os.environ.get("AUTOPAR_BERT_HEAD", "masked_lm")
LABELS = 3
DEFAULT_BATCH_SIZE = 8


def build_model():
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=EMBED, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, intermediate_size=4 * EMBED,
                     max_position_embeddings=SEQ, num_labels=LABELS, pad_token_id=0,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg) if HEAD == "classification" else BertForMaskedLM(cfg)


def example_inputs(batch_size):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def example_targets(batch_size):
    if HEAD == "classification":
        return torch.randint(0, LABELS, (batch_size,))
    return torch.randint(0, VOCAB, (batch_size, SEQ))


def loss_fn(output, targets):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
