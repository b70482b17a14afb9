"""Hugging Face ResNet-50 (transformers' ``ResNetModel`` built from its default config, no
weights, nothing changed) with an ImageNet head: the "untouched Hugging Face model" of the
planning benchmark. Only the logits are returned (the model's output object is not a tensor)."""

import torch
from torch import nn

DEFAULT_BATCH_SIZE = 256


class HFResNet50(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification
        self.net = ResNetForImageClassification(ResNetConfig(num_labels=1000))

    def forward(self, x):
        return self.net(pixel_values=x).logits


def build_model():
    return HFResNet50()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 224, 224),)


def example_targets(batch_size):
    return torch.randint(0, 1000, (batch_size,))
