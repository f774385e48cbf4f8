"""numpy building blocks for references of gradient algorithms: every rank simulated, in plain numpy.

A test runs an algorithm on :func:`~bagua_x.testing.run`'s simulated ranks and compares each rank's
result with a reference written from the algorithm's formula with these functions.  They share no
code with ``bagua_x.algorithms``, so such a test catches a wrong formula on either side.  ``xs`` is a
list with one flat float32 array per rank.

Example:
    ```python
    import numpy as np
    from bagua_x.testing import reference

    xs = [np.random.default_rng(r).standard_normal(8).astype(np.float32) for r in range(4)]
    want = reference.allreduce(xs)  # every rank's result: the mean of the four
    code, low, high = reference.quantize(xs[0])  # Bagua's MinMaxUInt8 of one chunk
    ```
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["EPS", "allreduce", "quantize", "dequantize", "roundtrip", "step_size", "quantized_average", "topk_sent",
           "DiLoCoWorkers"]

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


def quantize(x: np.ndarray, levels: int = 255) -> tuple[np.ndarray, np.float32, np.float32]:
    """Bagua's MinMaxUInt8 of one chunk: 256 levels between its min and max, in float32 as Bagua computes them
    (``levels=15``: the 4-bit form, 16 levels).

    Args:
      x: the chunk (converted to float32).
      levels: the largest code (255: 8 bits, 15: 4 bits).

    Returns:
      ``(codes, min, max)``: uint8 codes of ``x``'s shape and the two float32 bounds.
    """
    x = np.asarray(x, np.float32)
    mn, mx = np.float32(x.min()), np.float32(x.max())
    scale = np.float32(levels) / (mx - mn + np.float32(EPS))
    upper = np.rint(mx * scale)
    lower = upper - np.float32(levels)
    q = (np.clip(np.rint(x * scale), lower, upper) - lower).astype(np.uint8)
    return q, mn, mx


def dequantize(q, mn, mx, levels: int = 255):
    """The float32 values of :func:`quantize`'s ``(codes, min, max)``."""
    scale = np.float32(levels) / (np.float32(mx) - np.float32(mn) + np.float32(EPS))
    upper = np.rint(np.float32(mx) * scale)
    lower = upper - np.float32(levels)
    return (q.astype(np.float32) + lower) / scale


def roundtrip(x, levels: int = 255):
    """``x`` quantised and dequantised: what a receiver of its MinMaxUInt8 codes sees."""
    return dequantize(*quantize(x, levels), levels)


def step_size(x, levels: int = 255):
    """One quantization step of chunk ``x``: (max - min) / levels, the tolerance a compressed result is held to."""
    return (float(np.max(x)) - float(np.min(x)) + EPS) / levels


def quantized_average(xs: Sequence[np.ndarray], bits: int) -> np.ndarray:
    """ByteGrad's compressed average of one array per rank (``bits`` 8 or 4): each rank's array, zero-padded
    to a multiple of N (2N for 4 bits), cut in N chunks; chunk r of every rank quantised, averaged by rank r,
    quantised again; every rank gets the same result (padding dropped)."""
    levels, n = (255 if bits == 8 else 15), len(xs)
    numel = xs[0].size
    pad = -numel % (n * (2 if bits == 4 else 1))
    chunks = [np.split(np.concatenate([np.asarray(x, np.float32), np.zeros(pad, np.float32)]), n) for x in xs]
    mine = []
    for r in range(n):
        total = roundtrip(chunks[0][r], levels)
        for src in range(1, n):
            total = total + roundtrip(chunks[src][r], levels)
        mine.append(roundtrip(total / np.float32(n), levels))
    return np.concatenate(mine)[:numel]


def topk_sent(x: np.ndarray, fraction: float, bits: int, chunk: int) -> np.ndarray:
    """What a SparseLoCo worker sends of ``x``, dense: per chunk of ``chunk`` elements (the last one may be
    shorter), the ``round(fraction * chunk)`` entries largest in magnitude (ties: the lower position), each
    sent as its sign and the nearest of ``2**(bits-1)`` magnitudes spread evenly from the smallest magnitude
    sent to the largest (1 bit: their midpoint); zeros elsewhere.

    Raises:
      ValueError: ``x`` holds a NaN or an infinity (it would never be sent, nor leave the error buffer).
    """
    x = np.asarray(x, np.float32)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"a NaN or infinity at positions {np.flatnonzero(~np.isfinite(x))[:10].tolist()}")
    k = min(chunk, max(1, round(fraction * chunk)))
    steps = max(1, 2 ** (bits - 1) - 1)
    out = np.zeros_like(x)
    for start in range(0, x.size, chunk):
        part = x[start:start + chunk]
        chosen = np.argsort(-np.abs(part), kind="stable")[:k]
        size = np.abs(part[chosen])
        lo, hi = size.min(), size.max()
        if bits == 1:
            lo = hi = (lo + hi) * np.float32(0.5)
        level = np.zeros_like(size) if hi == lo else np.clip(np.rint((size - lo) / (hi - lo) * steps), 0, steps)
        out[start + chosen] = np.where(part[chosen] < 0, -1, 1) * (lo + level * (hi - lo) / steps)
    return out


class DiLoCoWorkers:
    """N DiLoCo workers in numpy, written from the papers' formulas (torchft's keywords and schedule).

    Call :meth:`after_step` with every worker's weights after each inner optimizer step; it returns the
    weights each worker continues from.  Fragment i of P (an element range) launches at steps
    ``floor(H (i + 1) / P) + k H`` (1-based): its pseudo-gradient ``global - local`` is averaged then (in
    float64, or quantised with ``bits`` 8/4) and lands ``delay`` steps later: an outer SGD step with Nesterov
    momentum on the global copy, then ``local = global + alpha (local - global)``.

    Example:
        ```python
        import numpy as np
        from bagua_x.testing.reference import DiLoCoWorkers

        workers = DiLoCoWorkers(np.zeros(4, np.float32), n=2, sync_every=2)
        xs = workers.after_step([np.full(4, 1.0, np.float32), np.full(4, 3.0, np.float32)])  # step 1: unchanged
        xs = workers.after_step(xs)  # step 2: pseudo-gradient -2, momentum -2, global 0 + 0.7 * (2 + 0.9 * 2)
        ```
    """

    def __init__(self, x0: np.ndarray, n: int, sync_every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: int = 1, delay: int = 0, alpha: float = 0.0, bits: int = 32,
                 compression=None):
        self.n, self.h, self.lr, self.mu, self.nesterov = n, sync_every, outer_lr, outer_momentum, nesterov
        self.delay, self.alpha, self.bits, self.compression = delay, alpha, bits, compression
        self.errors = [np.zeros(np.asarray(x0).size, np.float32) for _ in range(n)]
        numel = np.asarray(x0).size
        cuts = [i * numel // fragments for i in range(fragments + 1)]
        self.ranges = list(zip(cuts[:-1], cuts[1:]))
        self.offsets = [sync_every * (i + 1) // fragments for i in range(fragments)]
        self.global_weights = np.asarray(x0, np.float32).copy()
        self.momentum = np.zeros_like(self.global_weights)
        self.in_flight: dict[int, np.ndarray] = {}  # fragment -> averaged pseudo-gradient
        self.step = 0

    @classmethod
    def like(cls, algorithm, x0: np.ndarray, n: int) -> "DiLoCoWorkers":
        """Workers with the settings of ``algorithm`` (a :class:`~bagua_x.algorithms.DiLoCo`; only read)."""
        a = algorithm
        return cls(x0, n, a.sync_every, a.outer_lr, a.outer_momentum, a.nesterov, a.fragments, a.fragment_sync_delay,
                   a.fragment_update_alpha, a.bits, a.compression)

    def after_step(self, xs: Sequence[np.ndarray]) -> list[np.ndarray]:
        self.step += 1
        xs = [np.asarray(x, np.float32).copy() for x in xs]
        for i, (a, b) in enumerate(self.ranges):
            if self.step >= self.offsets[i] and (self.step - self.offsets[i]) % self.h == 0:
                pseudo = [self.global_weights[a:b] - x[a:b] for x in xs]
                if self.compression is not None:
                    self.in_flight[i] = self._sparse_mean(pseudo, a, b)
                else:
                    self.in_flight[i] = (allreduce(pseudo)[0] if self.bits == 32
                                         else quantized_average(pseudo, self.bits))
            landed = self.step - self.delay
            if i in self.in_flight and landed >= self.offsets[i] and (landed - self.offsets[i]) % self.h == 0:
                g = self.in_flight.pop(i)
                self.momentum[a:b] = self.mu * self.momentum[a:b] + g
                direction = g + self.mu * self.momentum[a:b] if self.nesterov else self.momentum[a:b]
                self.global_weights[a:b] = self.global_weights[a:b] - self.lr * direction
                for x in xs:
                    x[a:b] = self.global_weights[a:b] + np.float32(self.alpha) * (x[a:b] - self.global_weights[a:b])
        return xs

    def _sparse_mean(self, pseudo, a: int, b: int) -> np.ndarray:
        c = self.compression
        sent = []
        for e, p in zip(self.errors, pseudo):
            e[a:b] = e[a:b] * np.float32(c.error_decay) + p
            sent.append(topk_sent(e[a:b], c.fraction, c.bits, c.chunk))
            e[a:b] -= sent[-1]
        return allreduce(sent)[0]
