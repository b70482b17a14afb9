"""The small MLP model file the toy decomposition and toy strategy tests plan."""
import torch
from torch import nn
import torch.nn.functional as F

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 12)
        self.fc3 = nn.Linear(12, 4)
    def forward(self, x):
        return self.fc3(self.fc2(F.relu(self.fc1(x))))

def build_model():
    return MLP()

def example_inputs(batch_size):
    return (torch.randn(batch_size, 8),)
