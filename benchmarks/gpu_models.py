"""The two models of the GPU step benchmark (benchmarks/gpu_step.py), written here in plain
torch (the device image has no torchvision): ResNet-50 (He et al. 2016, the bottleneck
ResNet of torchvision's ``resnet50``: 25.6 M parameters at 1000 classes) and a transformer
language model the size of GPT-2 small (Radford et al. 2019: 12 layers, 768 wide, 12 heads,
a 50,257-token vocabulary, 1,024 positions, tied embeddings: 124 M parameters).

``tiny=True`` gives each a small version of the same structure, for the CPU check of the
script (tests/test_gpu_step.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)
        self.down = None
        if stride != 1 or inputs != out:
            self.down = nn.Sequential(nn.Conv2d(inputs, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000, tiny: bool = False) -> None:
        super().__init__()
        base, blocks = (8, (1, 1, 1, 1)) if tiny else (64, (3, 4, 6, 3))
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, inputs = [], base
        for stage, count in enumerate(blocks):
            width = base * 2 ** stage
            for i in range(count):
                layers.append(Bottleneck(inputs, width, 2 if i == 0 and stage > 0 else 1))
                inputs = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(inputs, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2Small(nn.Module):
    """Logits flattened to (tokens, vocabulary): the loop's ``cross_entropy(net(x), y)``."""

    def __init__(self, tiny: bool = False) -> None:
        super().__init__()
        self.vocabulary, self.context, width, layers, heads = (512, 64, 64, 2, 4) if tiny else (50257, 1024, 768, 12, 12)
        self.tokens, self.positions = nn.Embedding(self.vocabulary, width), nn.Embedding(self.context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)

    def forward(self, tokens):
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.tokens.weight).reshape(-1, self.vocabulary)  # tied to the embedding
