"""The zoo (``torch_zoo.py``) in flax.nnx: the same tensors, for the JAX rows of the bench.

* ``mlp``: 12 x Linear(1024, 1024) + ReLU, then Linear(1024, 10): 12.6M parameters in 26 leaves.
* ``transformer``: the 12-layer pre-LayerNorm decoder with the token embedding tied to the output
  head (vocabulary 8192, width 256, 4 heads, MLP 1024): 11.6M parameters in 148 leaves.
* ``resnet``: the CIFAR-shaped ResNet (widths 32..256, 2 basic blocks per stage, projection
  shortcuts) with BatchNorm, whose batch statistics are state beside the params: 2.8M parameters
  in 62 leaves, images channels-last.

``build(name)`` gives the pure params pytree, the pure non-parameter state (the ResNet's batch
statistics; empty for the others) and ``apply(params, stats, x) -> (logits, stats)`` in
training mode; ``batch(name, rank)`` one fixed batch per rank, of the torch zoo's shapes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .shared import (HEADS, LAYERS, MLP_BATCH, MLP_CLASSES, MLP_LAYERS, MLP_WIDTH, SEQ, TRANSFORMER_BATCH, VOCAB,
                     WIDTH)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.List([nnx.Linear(MLP_WIDTH, MLP_WIDTH, rngs=rngs) for _ in range(MLP_LAYERS)])
        self.out = nnx.Linear(MLP_WIDTH, MLP_CLASSES, rngs=rngs)

    def __call__(self, x):
        for layer in self.hidden:
            x = jax.nn.relu(layer(x))
        return self.out(x)


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.qkv, self.proj = nnx.Linear(WIDTH, 3 * WIDTH, rngs=rngs), nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jnp.moveaxis(self.qkv(x).reshape(b, t, 3, HEADS, WIDTH // HEADS), 2, 0)
        att = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(WIDTH // HEADS)
        att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf), axis=-1)
        return self.proj(jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, WIDTH))


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.ln1, self.attn = nnx.LayerNorm(WIDTH, rngs=rngs), Attention(rngs)
        self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs), nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)), approximate=False))


class Transformer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.tok = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (SEQ, WIDTH)) * 0.02)
        self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
        self.ln = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.tok.attend(self.ln(x)).reshape(-1, VOCAB)  # output head tied to the embedding


class BasicBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, stride: int, rngs: nnx.Rngs):
        def conv(cin, cout, kernel, stride):
            return nnx.Conv(cin, cout, (kernel, kernel), strides=stride, padding=kernel // 2, use_bias=False,
                            rngs=rngs)

        self.conv1, self.bn1 = conv(cin, cout, 3, stride), nnx.BatchNorm(cout, rngs=rngs)
        self.conv2, self.bn2 = conv(cout, cout, 3, 1), nnx.BatchNorm(cout, rngs=rngs)
        self.short = (nnx.Sequential(conv(cin, cout, 1, stride), nnx.BatchNorm(cout, rngs=rngs))
                      if stride != 1 or cin != cout else None)

    def __call__(self, x):
        out = self.bn2(self.conv2(jax.nn.relu(self.bn1(self.conv1(x)))))
        return jax.nn.relu(out + (self.short(x) if self.short is not None else x))


class ResNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.stem = nnx.Conv(3, 32, (3, 3), padding=1, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        blocks, cin = [], 32
        for i, width in enumerate((32, 64, 128, 256)):
            blocks += [BasicBlock(cin, width, 1 if i == 0 else 2, rngs), BasicBlock(width, width, 1, rngs)]
            cin = width
        self.blocks, self.head = nnx.List(blocks), nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))


def build(name: str, seed: int = 0):
    """``(params, stats, apply)``: the params and the other state (batch statistics) as plain pytrees of arrays,
    and ``apply(params, stats, x) -> (logits, stats)``, BatchNorm normalising by the batch's statistics and
    updating the running ones."""
    graphdef, params, stats = nnx.split({"mlp": MLP, "transformer": Transformer, "resnet": ResNet}[name](
        nnx.Rngs(seed)), nnx.Param, ...)

    def apply(params, stats, x):
        model = nnx.merge(graphdef, params, stats)
        return model(x), nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))

    return nnx.to_pure_dict(params), nnx.to_pure_dict(stats), apply


def batch(name: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """One fixed batch per rank: inputs and class targets (per token for the transformer)."""
    rng = np.random.default_rng(rank)
    if name == "mlp":
        return (rng.standard_normal((MLP_BATCH, MLP_WIDTH), np.float32),
                rng.integers(0, MLP_CLASSES, MLP_BATCH).astype(np.int32))
    if name == "transformer":
        tokens = rng.integers(0, VOCAB, (TRANSFORMER_BATCH, SEQ + 1)).astype(np.int32)
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)
    return rng.standard_normal((8, 32, 32, 3), np.float32), rng.integers(0, 10, 8).astype(np.int32)
