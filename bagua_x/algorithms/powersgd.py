"""PowerSGD: gradients compressed to low-rank matrices, with torch's ``powerSGD_hook`` semantics.

Per bucket and step (Vogels et al., 2019; torch's hook):

* the first ``start_powerSGD_iter`` steps average the whole bucket uncompressed;
* then the error feedback of the last step is added to the bucket, ``g += e``;
* each tensor worth compressing -- viewed as an ``n x m`` matrix ``M`` (its
  first dimension by the rest), with ``r = min(n, m, matrix_approximation_rank)``
  and ``(n + m) r * min_compression_rate < n m`` -- is approximated: ``Q``
  (``m x r``, warm-started from the last step, at first a seeded normal that is
  the same on every rank) is orthonormalised, ``P = M Q`` is summed over ranks
  and orthonormalised, ``Q = M^T P`` is averaged over ranks, and ``M' = P Q^T``;
* every other tensor (biases, norms, small matrices) is averaged uncompressed,
  all of them in one allreduce;
* ``e = g - result`` over the whole bucket.

So each rank sends ``r (n + m)`` elements per compressed matrix instead of
``n m``.  This needs each tensor's shape, which is why algorithms receive the
bucket's layout.  Orthonormalisation is Gram-Schmidt (torch switches to QR
for ``r > 2``: the same basis up to column signs, which cancel in ``P Q^T``);
an all-zero column stays zero instead of becoming NaN.  Without warm start,
``Q`` restarts each step from the same seeded draw: the Array API has no
random numbers, so a fresh draw per step (torch's hook) is not available.
"""

from __future__ import annotations

import dataclasses

import array_api_compat
import numpy as np

from ..core.comm import ReduceOp
from ..core.errors import BaguaXError
from .base import Algorithm, counter, namespace, ring_allreduce_bytes

__all__ = ["PowerSGD"]


@dataclasses.dataclass(frozen=True)
class _Matrix:
    """A compressed tensor: where it lives in the bucket and where its ``Q`` lives in the state."""

    offset: int
    rows: int
    cols: int
    rank: int
    q_offset: int


def _orthonormal(a, xp):
    """The columns of ``a`` made orthonormal, in order (modified Gram-Schmidt; zero columns stay zero)."""
    cols = []
    for i in range(a.shape[1]):
        col = a[:, i]
        for done in cols:
            col = col - xp.sum(done * col) * done
        norm = xp.sqrt(xp.sum(col * col))
        safe = xp.where(norm > 0, norm, xp.ones_like(norm))
        cols.append(xp.where(norm > 0, col / safe, xp.zeros_like(col)))
    return xp.stack(cols, axis=1)


@dataclasses.dataclass(frozen=True)
class PowerSGD(Algorithm):
    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 1000
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True
    random_seed: int = 0

    def __post_init__(self):
        if self.matrix_approximation_rank < 1 or self.start_powerSGD_iter < 0 or self.min_compression_rate < 0:
            raise BaguaXError(
                "PowerSGD: need matrix_approximation_rank >= 1, start_powerSGD_iter >= 0 and "
                f"min_compression_rate >= 0; got {self.matrix_approximation_rank}, {self.start_powerSGD_iter}, "
                f"{self.min_compression_rate}"
            )

    def _plan(self, layout) -> tuple[list[_Matrix], list[tuple[int, int]]]:
        """The matrices to compress, and the ``(offset, numel)`` ranges averaged as they are (padding included)."""
        matrices, plain, q_offset = [], [], 0
        for slot in layout.slots:
            rows = slot.shape[0] if len(slot.shape) >= 2 else 0
            cols = slot.numel // rows if rows else 0
            rank = min(rows, cols, self.matrix_approximation_rank)
            if rows and (rows + cols) * rank * self.min_compression_rate < rows * cols:
                matrices.append(_Matrix(slot.offset, rows, cols, rank, q_offset))
                q_offset += cols * rank
            elif slot.numel:
                plain.append((slot.offset, slot.numel))
        if layout.padded_numel > layout.numel:
            plain.append((layout.numel, layout.padded_numel - layout.numel))
        return matrices, plain

    def init(self, flat, layout, world_size):
        xp = namespace(flat)
        matrices, _ = self._plan(layout)
        rng = np.random.default_rng(self.random_seed)  # the same draw on every rank
        q = np.concatenate([rng.standard_normal(m.cols * m.rank) for m in matrices] or [np.zeros(0)])
        q = xp.asarray(q, dtype=flat.dtype, device=array_api_compat.device(flat))
        return {"step": counter(xp), "q": q, "error": xp.zeros_like(flat)}

    def wire_bytes(self, layout, itemsize, world_size):
        matrices, plain = self._plan(layout)
        numel = sum(n for _, n in plain) + sum((m.rows + m.cols) * m.rank for m in matrices)
        return ring_allreduce_bytes(numel, itemsize, world_size)  # after start_powerSGD_iter

    def reduce(self, flat, layout, state, comm):
        xp = namespace(flat)
        matrices, plain = self._plan(layout)

        def allreduce(carry):
            g, q, e = carry
            return comm.allreduce(g, ReduceOp.AVG), q, e

        def compress(carry):
            g, q, e = carry
            if self.use_error_feedback:
                g = g + e
            pieces = {}  # bucket offset -> reduced values
            if plain:
                averaged = comm.allreduce(xp.concat([g[o : o + n] for o, n in plain]), ReduceOp.AVG)
                start = 0
                for o, n in plain:
                    pieces[o] = averaged[start : start + n]
                    start += n
            if matrices:
                ms = [xp.reshape(g[m.offset : m.offset + m.rows * m.cols], (m.rows, m.cols)) for m in matrices]
                qs = [_orthonormal(xp.reshape(q[m.q_offset : m.q_offset + m.cols * m.rank], (m.cols, m.rank)),
                                   xp) for m in matrices]
                ps = self._exchange([xp.matmul(mat, qm) for mat, qm in zip(ms, qs)], comm, ReduceOp.SUM, xp)
                ps = [_orthonormal(p, xp) for p in ps]
                qs = self._exchange([xp.matmul(mat.T, p) for mat, p in zip(ms, ps)], comm, ReduceOp.AVG, xp)
                for m, p, qm in zip(matrices, ps, qs):
                    pieces[m.offset] = xp.reshape(xp.matmul(p, qm.T), (-1,))
                if self.warm_start:  # else the state keeps the first draw
                    q = xp.concat([xp.reshape(qm, (-1,)) for qm in qs])
            out = xp.concat([pieces[o] for o in sorted(pieces)])
            return out, q, (g - out if self.use_error_feedback else e)

        compressing = xp.astype(state["step"] >= self.start_powerSGD_iter, xp.int32)
        out, q, e = comm.switch(compressing, [allreduce, compress], (flat, state["q"], state["error"]))
        return out, {"step": state["step"] + 1, "q": q, "error": e}

    @staticmethod
    def _exchange(arrays: list, comm, op: ReduceOp, xp) -> list:
        """Every array of ``arrays`` reduced over ranks in one collective, shapes kept."""
        reduced = comm.allreduce(xp.concat([xp.reshape(a, (-1,)) for a in arrays]), op)
        out, start = [], 0
        for a in arrays:
            n = a.shape[0] * a.shape[1]
            out.append(xp.reshape(reduced[start : start + n], a.shape))
            start += n
        return out
