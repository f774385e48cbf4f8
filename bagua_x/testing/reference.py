"""numpy building blocks for references of gradient algorithms: every rank simulated, in plain numpy.

A test runs an algorithm on :func:`~bagua_x.testing.run`'s simulated ranks and compares each rank's
result with a reference written from the algorithm's formula with these functions.  They share no
code with ``bagua_x.algorithms``, so such a test catches a wrong formula on either side.  ``xs`` is a
list with one flat float32 array per rank.

Example:
    ```python
    from typing import Sequence

import numpy as np
    from bagua_x.testing import reference

    xs = [np.random.default_rng(r).standard_normal(8).astype(np.float32) for r in range(4)]
    want = reference.allreduce(xs)  # every rank's result: the mean of the four
    code, low, high = reference.quantize(xs[0])  # Bagua's MinMaxUInt8 of one chunk
    ```
"""

from __future__ import annotations

import numpy as np

__all__ = ["EPS", "allreduce", "quantize", "dequantize", "roundtrip", "step_size"]

#: Bagua's MinMaxUInt8 keeps the scale finite on a constant chunk: 255 / (max - min + EPS).
EPS = 1e-7


def allreduce(xs: Sequence[np.ndarray], average: bool = True) -> list[np.ndarray]:
    """Every rank's result of an allreduce (sum in float64, then float32).

    Args:
      xs: one array per rank, all of one shape.
      average: the mean of the ranks' arrays (else their sum).

    Returns:
      one float32 array per rank (all equal).
    """
    total = np.sum(np.stack(xs).astype(np.float64), axis=0)
    out = total / len(xs) if average else total
    return [out.astype(np.float32) for _ in xs]


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.float32, np.float32]:
    """Bagua's MinMaxUInt8 of one chunk: 256 levels between its min and max, in float32 as Bagua computes them.

    Args:
      x: the chunk (converted to float32).

    Returns:
      ``(codes, min, max)``: uint8 codes of ``x``'s shape and the two float32 bounds.
    """
    x = np.asarray(x, np.float32)
    mn, mx = np.float32(x.min()), np.float32(x.max())
    scale = np.float32(255.0) / (mx - mn + np.float32(EPS))
    upper = np.rint(mx * scale)
    lower = upper - np.float32(255.0)
    q = (np.clip(np.rint(x * scale), lower, upper) - lower).astype(np.uint8)
    return q, mn, mx


def dequantize(q, mn, mx):
    """The float32 values of :func:`quantize`'s ``(codes, min, max)``."""
    scale = np.float32(255.0) / (np.float32(mx) - np.float32(mn) + np.float32(EPS))
    upper = np.rint(np.float32(mx) * scale)
    lower = upper - np.float32(255.0)
    return (q.astype(np.float32) + lower) / scale


def roundtrip(x):
    """``x`` quantised and dequantised: what a receiver of its MinMaxUInt8 codes sees."""
    return dequantize(*quantize(x))


def step_size(x):
    """One quantization step of chunk ``x``: (max - min) / 255, the tolerance a compressed result is held to."""
    return (float(np.max(x)) - float(np.min(x)) + EPS) / 255.0
