"""Independent numpy references that simulate every rank of each of bagua_x's algorithms.

Written from the formulas in DESIGN.md (Bagua's semantics), sharing no code with
bagua_x.algorithms, so a test comparing the two catches a wrong formula on either side.
Built on the public building blocks of :mod:`bagua_x.testing.reference` (the allreduce,
MinMaxUInt8), which algorithms written outside the library use the same way.
``xs`` is a list with one flat float32 array per rank; ``step`` is the 0-based
index of the reduce call.
"""

from __future__ import annotations

import numpy as np

from bagua_x.testing.reference import allreduce, dequantize, quantize, roundtrip


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


def qadam(param, grads, lr, warmup_steps, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, local=None):
    """QAdam on one flat parameter shared by all ranks; ``grads[t][r]`` is rank r's gradient at step t+1.

    ``local``: hierarchical, over nodes of ``local`` ranks.  Returns the parameter after every step (the same on
    all ranks).
    """
    average_momentum = (lambda ms: bytegrad(ms, True)) if local is None else \
        (lambda ms: bytegrad_hierarchical(ms, local, True))
    b1, b2 = betas
    p = np.asarray(param, np.float64).copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    history = []
    for t, per_rank in enumerate(grads, start=1):
        gs = [np.asarray(g, np.float64) + weight_decay * p for g in per_rank]
        if t <= warmup_steps:
            g = np.mean(gs, axis=0)
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
        else:
            moments = [(b1 * m + (1 - b1) * g).astype(np.float32) for g in gs]
            m = average_momentum(moments)[0].astype(np.float64)
        p = p - lr / (1 - b1**t) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
        history.append(p.astype(np.float32))
    return history


# -- hierarchical variants ---------------------------------------------------------------------------
# Bagua's meaning (DESIGN.md): full-precision average inside each node (``local`` consecutive ranks), the flat
# algorithm between the nodes, every rank of a node ending with its node's result.  bagua_x runs the exchange
# between nodes on ``local`` shards of the node average (shard i by the i-th rank of every node), so a
# compressing algorithm quantises each shard's chunks on their own; these references do the same.

def node_means(xs, local):
    return [np.mean(np.stack(xs[k:k + local]).astype(np.float64), axis=0).astype(np.float32)
            for k in range(0, len(xs), local)]


def over_nodes(xs, local, exchange):
    """``exchange(per_node_arrays)`` on each of the ``local`` shards of the node means; one result per rank."""
    shards = [np.split(m, local) for m in node_means(xs, local)]  # shards[node][i]
    per_shard = [exchange([s[i] for s in shards]) for i in range(local)]  # per_shard[i][node]
    nodes = [np.concatenate([per_shard[i][k] for i in range(local)]) for k in range(len(shards))]
    return [nodes[r // local].copy() for r in range(len(xs))]


def bytegrad_hierarchical(xs, local, average=True):
    if not average:  # sums: node sums, then the compressed sum
        return over_nodes([x * np.float32(local) for x in xs], local, lambda ys: bytegrad(ys, False))
    return over_nodes(xs, local, lambda ys: bytegrad(ys, True))


def decentralized_hierarchical(xs, local, mode, step, interval):
    if step % interval:
        return [x.copy() for x in xs]
    return over_nodes(xs, local, lambda ys: decentralized(ys, mode, step, interval))


def low_precision_hierarchical(xs, local, node_states, step, interval):
    """``node_states``: one ``{"w", "left", "right"}`` per node (every rank of a node holds the same)."""
    if step % interval:
        return [x.copy() for x in xs], node_states
    means = node_means(xs, local)
    m = len(means)
    qs = [[quantize(shard) for shard in np.split(x + st["left"] / 3 + st["right"] / 3 - 5 * st["w"] / 3, local)]
          for x, st in zip(means, node_states)]  # qs[node][shard]
    deq = lambda k: np.concatenate([dequantize(*q) for q in qs[k % m]])  # noqa: E731
    new_nodes, new_states = [], []
    for k, st in enumerate(node_states):
        x = st["w"] + deq(k)
        new_nodes.append(x)
        new_states.append({"w": x.copy(), "left": st["left"] + deq(k - 1), "right": st["right"] + deq(k + 1)})
    return [new_nodes[r // local].copy() for r in range(len(xs))], new_states


# -- PowerSGD ----------------------------------------------------------------------------------------

def _orthonormal(a):
    """Orthonormal columns spanning ``a``'s, as Gram-Schmidt gives them: QR with a positive R diagonal, and a
    zero column where ``a``'s column adds nothing to the ones before it (all zero, or a multiple of them)."""
    q, r = np.linalg.qr(a)
    d = np.diag(r)
    return np.where(np.abs(d) <= 1e-10 * np.abs(r).max(), 0.0, q * np.where(d < 0, -1.0, 1.0))


def _powersgd_redraw(seed, step, numel):
    """The values that replace an all-zero column of the warm-started Q at ``step`` (docs/architecture.md):
    MurmurHash3's 32-bit finaliser of ``mix(step * 0x9E3779B9 + seed) + position``, low 24 bits scaled to [-1, 1);
    position counts through one matrix's Q (cols x rank, row-major), wherever the matrix sits in its bucket."""
    def mix(h):
        h = h ^ (h >> np.uint32(16))
        h = h * np.uint32(0x85EBCA6B)
        h = h ^ (h >> np.uint32(13))
        h = h * np.uint32(0xC2B2AE35)
        return h ^ (h >> np.uint32(16))

    key = mix(np.array([step], np.uint32) * np.uint32(0x9E3779B9) + np.uint32(seed & 0xFFFFFFFF))
    bits = mix(np.arange(numel, dtype=np.uint32) + key) & np.uint32(0xFFFFFF)
    return bits / 2.0**23 - 1.0


def powersgd(steps, shapes, rank=1, start=0, min_rate=2.0, error_feedback=True, warm_start=True, seed=0):
    """Every rank's bucket after each step.  ``steps[t][r]`` is rank r's flat bucket (the tensors of
    ``shapes`` back to back, then any padding) at step t; torch's powerSGD_hook, all ranks simulated."""
    n_ranks = len(steps[0])
    tensors, offset = [], 0  # (offset, numel, rows, cols, rank) with rank 0: not compressed
    for shape in shapes:
        numel = int(np.prod(shape))
        rows, cols = (shape[0], numel // shape[0]) if len(shape) >= 2 else (0, 0)
        r = min(rows, cols, rank)
        compressed = rows > 0 and (rows + cols) * r * min_rate < rows * cols
        tensors.append((offset, numel, rows, cols, r if compressed else 0))
        offset += numel
    rng = np.random.default_rng(seed)
    initial = {t[0]: rng.standard_normal(t[3] * t[4]).reshape(t[3], t[4]) for t in tensors if t[4]}
    qs = dict(initial)
    errors = [np.zeros(len(steps[0][0])) for _ in range(n_ranks)]
    outs = []
    for t, xs in enumerate(steps):
        xs = [np.asarray(x, np.float64) for x in xs]
        if t < start:
            outs.append([np.mean(xs, axis=0)] * n_ranks)
            continue
        gs = [x + e for x, e in zip(xs, errors)] if error_feedback else xs
        out = np.mean(gs, axis=0)  # the uncompressed tensors and the padding
        for off, numel, rows, cols, r in tensors:
            if not r:
                continue
            ms = [g[off : off + numel].reshape(rows, cols) for g in gs]
            q = qs[off] if warm_start else initial[off]
            fresh = _powersgd_redraw(seed, t, cols * r).reshape(cols, r)
            q = _orthonormal(np.where((q == 0).all(axis=0), fresh, q))  # a zero column is drawn again
            p = _orthonormal(sum(m @ q for m in ms))
            q = np.mean([m.T @ p for m in ms], axis=0)
            out[off : off + numel] = (p @ q.T).reshape(-1)
            qs[off] = q
        if error_feedback:
            errors = [g - out for g in gs]
        outs.append([out] * n_ranks)
    return outs
