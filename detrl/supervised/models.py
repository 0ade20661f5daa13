"""Models for the supervised recipes: small ones for tests and demos, ResNet-50 for benchmarks.

Attention is written with explicit matmuls and softmax rather than a fused kernel so that every reduction
is an aten op the hardware profiles and the rounding mode can see.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class DigitsCNN(nn.Module):
    """Conv-BN-ReLU x2, max-pool, dropout, linear. Input ``(N, 1, 8, 8)``, output logits ``(N, classes)``.

    ``dropout`` (default 0: none) drops features before the linear head, drawing from the ``dropout`` stream.
    """

    def __init__(self, channels: int = 16, classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.fc = nn.Linear(2 * channels * 4 * 4, classes)
        # No module at p=0: a run without dropout has exactly the op sequence it always had.
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.dropout(x.flatten(1)))


class MLPDropout(nn.Module):
    """Two hidden layers with dropout. Input ``(N, features)`` (images are flattened)."""

    def __init__(
        self, features: int = 64, hidden: int = 128, classes: int = 10, dropout: float = 0.2
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(F.relu(self.fc1(x.flatten(1))))
        x = self.dropout(F.relu(self.fc2(x)))
        return self.out(x)


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.dropout(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(n, t, d)
        x = x + self.dropout(self.proj(y))
        return x + self.dropout(self.mlp(self.ln2(x)))


class TinyTransformer(nn.Module):
    """A GPT-style character model. Input tokens ``(N, T)`` int64, output logits ``(N, T, vocab)``."""

    def __init__(
        self,
        vocab: int = 65,
        d_model: int = 32,
        heads: int = 2,
        layers: int = 1,
        seq_len: int = 32,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    """ResNet-50 (bottleneck blocks 3-4-6-3) in its CIFAR form: 3x3 stem, no max-pool. Input ``(N,3,32,32)``."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for width, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(x.mean(dim=(2, 3)))


MODELS = {
    "cnn_bn": DigitsCNN,
    "mlp_dropout": MLPDropout,
    "tiny_transformer": TinyTransformer,
    "resnet50": ResNet50,
}
