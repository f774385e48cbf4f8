"""The benchmark model zoo: three shapes of model that stress data-parallel training differently.

* ``mlp``: 12 x Linear(1024, 1024) + ReLU, then Linear(1024, 10) -- 12.6M parameters in
  only 26 large tensors (what bagua_x was first tuned on).
* ``transformer``: a 12-layer pre-LayerNorm decoder with a tied token embedding/output head
  (vocabulary 8192, width 256, 4 heads, MLP 1024) -- 11.6M parameters in 148 tensors, most of
  them small (LayerNorm, biases): per-tensor overheads in the gradient hooks show here.
* ``resnet``: a CIFAR-shaped ResNet (width 32..256, 2 basic blocks per stage, BatchNorm,
  projection shortcuts) -- 2.8M parameters in 62 tensors, compute-heavy convolutions, and
  BatchNorm buffers broadcast before every forward.

In all three, gradients become ready in reverse registration order up to a layer's weight
and bias swapping places, so rebuilding buckets in ready order (bagua_x.torch.engine.ready_order,
DDP's rebuild) moves no tensor to another bucket here; tests/torch/test_torch_bucket_order.py
has a model where it does.

Each model is built from ``torch.nn`` primitives, so every tensor is visible to the hooks
(``nn.Transformer`` would hide attention's weights in fused parameters).  ``batch(model, rank)``
gives one fixed batch per rank and the loss takes ``(output, target)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .shared import (HEADS, LAYERS, MLP_BATCH, MLP_CLASSES, MLP_LAYERS, MLP_WIDTH, SEQ, TRANSFORMER_BATCH, VOCAB,
                     WIDTH)


def mlp() -> nn.Module:
    layers = []
    for _ in range(MLP_LAYERS):
        layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(MLP_WIDTH, MLP_CLASSES))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(WIDTH // HEADS)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, WIDTH))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(WIDTH)

    def forward(self, idx):
        x = self.ln(self.blocks(self.tok(idx) + self.pos[: idx.shape[1]]))
        return (x @ self.tok.weight.t()).reshape(-1, VOCAB)  # output head tied to the embedding


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + self.short(x))


def resnet() -> nn.Module:
    widths, layers, cin = (32, 64, 128, 256), [], 32
    for i, w in enumerate(widths):
        layers += [BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)]
        cin = w
    return nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), *layers,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))


def build(name: str) -> nn.Module:
    return {"mlp": mlp, "transformer": Transformer, "resnet": resnet}[name]()


def batch(name: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch per rank: inputs and class targets (per token for the transformer)."""
    g = torch.Generator().manual_seed(rank)
    if name == "mlp":
        return (torch.randn(MLP_BATCH, MLP_WIDTH, generator=g),
                torch.randint(0, MLP_CLASSES, (MLP_BATCH,), generator=g))
    if name == "transformer":
        tokens = torch.randint(0, VOCAB, (TRANSFORMER_BATCH, SEQ + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
