"""The demo's dataset: scikit-learn's bundled handwritten digits (no download)."""

from __future__ import annotations

import numpy as np


def load_digits_split(seed: int = 0):
    """Standardised 8x8 digits as float32, 75/25 train/held-out split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0 - 0.5).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y.astype(np.int64), test_size=0.25, random_state=seed, stratify=y)
    return x_tr, y_tr, x_te, y_te


def rank_batches(x, y, rank: int, world: int, batch: int, steps: int, seed: int = 0):
    """This rank's shard, sampled in a per-rank random order: ``steps`` batches."""
    shard = np.arange(rank, len(x), world)
    rng = np.random.default_rng(seed + 1000 * rank)
    for _ in range(steps):
        idx = rng.choice(shard, size=batch, replace=False)
        yield x[idx], y[idx]
