"""Independent numpy references that simulate every rank of each algorithm.

Written from the formulas in DESIGN.md (Bagua's semantics), sharing no code with
bagua_x, so a test comparing the two catches a wrong formula on either side.
``xs`` is a list with one flat float32 array per rank; ``step`` is the 0-based
index of the reduce call.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-7


def quantize(x):
    """Bagua's MinMaxUInt8 of one chunk -> (q uint8, min, max)."""
    x = np.asarray(x, np.float32)
    mn, mx = np.float32(x.min()), np.float32(x.max())
    scale = np.float32(255.0) / (mx - mn + np.float32(EPS))
    upper = np.rint(mx * scale)
    lower = upper - np.float32(255.0)
    q = (np.clip(np.rint(x * scale), lower, upper) - lower).astype(np.uint8)
    return q, mn, mx


def dequantize(q, mn, mx):
    scale = np.float32(255.0) / (np.float32(mx) - np.float32(mn) + np.float32(EPS))
    upper = np.rint(np.float32(mx) * scale)
    lower = upper - np.float32(255.0)
    return (q.astype(np.float32) + lower) / scale


def roundtrip(x):
    return dequantize(*quantize(x))


def step_size(x):
    """One quantization step of chunk ``x``: (max - min) / 255."""
    return (float(np.max(x)) - float(np.min(x)) + EPS) / 255.0


def allreduce(xs, average=True):
    total = np.sum(np.stack(xs).astype(np.float64), axis=0)
    out = total / len(xs) if average else total
    return [out.astype(np.float32) for _ in xs]


def bytegrad(xs, average=True):
    n = len(xs)
    chunks = [np.split(np.asarray(x, np.float32), n) for x in xs]  # chunks[src][dst]
    reduced = []
    for r in range(n):
        s = np.sum([roundtrip(chunks[src][r]) for src in range(n)], axis=0, dtype=np.float32)
        if average:
            s = s / np.float32(n)
        reduced.append(roundtrip(s))
    out = np.concatenate(reduced)
    return [out.copy() for _ in xs]


def shift_one_peer(rank, n, s):
    if rank < n // 2:
        return ((s + rank) % ((n + 1) // 2)) + n // 2
    return (rank - n // 2 - s) % (n // 2)


def decentralized(xs, mode, step, interval):
    if step % interval:
        return [x.copy() for x in xs]
    n = len(xs)
    if mode == "all":
        return allreduce(xs, average=True)
    s = step // interval
    return [((xs[r] + xs[shift_one_peer(r, n, s)]) / 2).astype(np.float32) for r in range(n)]


def low_precision_init(xs):
    return [{"w": x.copy(), "left": x.copy(), "right": x.copy()} for x in xs]


def low_precision_decentralized(xs, states, step, interval):
    if step % interval:
        return [x.copy() for x in xs], states
    n = len(xs)
    qs = []
    for x, st in zip(xs, states):
        d = x + st["left"] / 3 + st["right"] / 3 - 5 * st["w"] / 3
        qs.append(quantize(d))
    new_xs, new_states = [], []
    for r, st in enumerate(states):
        left = st["left"] + dequantize(*qs[(r - 1) % n])
        right = st["right"] + dequantize(*qs[(r + 1) % n])
        x = st["w"] + dequantize(*qs[r])
        new_xs.append(x)
        new_states.append({"w": x.copy(), "left": left, "right": right})
    return new_xs, new_states


def model_average(xs, step, period):
    if (step + 1) % period:
        return [x.copy() for x in xs]
    return allreduce(xs, average=True)
