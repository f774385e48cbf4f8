"""The zoo's MLP and transformer (``torch_zoo.py``) in flax.nnx: the same tensors, for the JAX rows of the bench.

* ``mlp``: 12 x Linear(1024, 1024) + ReLU, then Linear(1024, 10): 12.6M parameters in 26 leaves.
* ``transformer``: the 12-layer pre-LayerNorm decoder with the token embedding tied to the output
  head (vocabulary 8192, width 256, 4 heads, MLP 1024): 11.6M parameters in 148 leaves.

``build(name)`` gives the pure params pytree and ``apply(params, x)``;
``batch(name, rank)`` one fixed batch per rank, of the torch zoo's shapes.
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


def build(name: str, seed: int = 0):
    """``(params, apply)``: the model's params as a plain pytree of arrays and ``apply(params, x) -> logits``."""
    graphdef, state = nnx.split({"mlp": MLP, "transformer": Transformer}[name](nnx.Rngs(seed)))
    return nnx.to_pure_dict(state), lambda params, x: nnx.merge(graphdef, params)(x)


def batch(name: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """One fixed batch per rank: inputs and class targets (per token for the transformer)."""
    rng = np.random.default_rng(rank)
    if name == "mlp":
        return (rng.standard_normal((MLP_BATCH, MLP_WIDTH), np.float32),
                rng.integers(0, MLP_CLASSES, MLP_BATCH).astype(np.int32))
    tokens = rng.integers(0, VOCAB, (TRANSFORMER_BATCH, SEQ + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:].reshape(-1)
