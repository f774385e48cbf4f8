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
an all-zero column stays zero instead of becoming NaN (torch's hook divides
by its zero norm).  Without warm start, ``Q`` restarts each step from the same
seeded draw: the Array API has no random numbers, so a fresh normal draw per
step (torch's hook) is not available.

A zero column of the warm-started ``Q`` is drawn again.  A matrix whose
gradient (plus error feedback) is exactly zero for one step -- a parameter
unused in that step, at the first compressed step or without error feedback --
gives ``P = 0``, so ``Q = M^T P = 0``, and ``P = M Q`` would stay zero at
every later step: the matrix would be switched off for good while its error
grows.  The redraw is :func:`_redraw`, a counter-based hash of the seed, the
step and the element's position within its matrix in integer Array API
arithmetic: identical on every rank (``Q`` is the same everywhere after its
allreduce, so is the mask), independent of the bucket the matrix is in, and
traceable by JAX (a ``where`` on a per-column mask, no data-dependent branch).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import array_api_compat
import numpy as np

from ..core.comm import ReduceOp
from ..core.errors import BaguaXError
from .base import Algorithm, counter, namespace, ring_allreduce_bytes

__all__ = ["PowerSGD", "PowerSGDState"]


class PowerSGDState(NamedTuple):
    step: Any  # steps so far (counter): compression starts at start_powerSGD_iter
    q: Any  # every compressed matrix's Q (cols x rank), flattened back to back in bucket order
    error: Any  # the error feedback, laid out as the bucket


@dataclasses.dataclass(frozen=True)
class _Matrix:
    """A compressed tensor: where it lives in the bucket and where its ``Q`` lives in the state."""

    offset: int
    rows: int
    cols: int
    rank: int
    q_offset: int

    def q(self, buffer, xp):
        """This matrix's ``cols x rank`` factor in a buffer laid out as the state's ``q``."""
        return xp.reshape(buffer[self.q_offset : self.q_offset + self.cols * self.rank], (self.cols, self.rank))


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


def _int32(c: int) -> int:
    """``c`` modulo 2**32 as a signed 32-bit value: the same bits, a constant every namespace keeps int32."""
    c &= 0xFFFFFFFF
    return c - (1 << 32) if c >= 1 << 31 else c


def _mix(h):
    """MurmurHash3's 32-bit finaliser on int32 arrays (wrapping products; shifts masked to be logical)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _int32(0x85EBCA6B)
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _int32(0xC2B2AE35)
    return h ^ ((h >> 16) & 0xFFFF)


def _step_key(seed: int, step, xp):
    """The redraw's key at ``step``: a 0-d int32 where the step counter lives (the host: base.counter).

    It stays there: added to an array on the bucket's device it is a scalar
    operand (torch reads a CPU 0-d tensor on the host), where moving it to the
    device would be one blocking host-to-device copy per bucket and step.
    """
    key = _mix(xp.reshape(xp.astype(step, xp.int32), (1,)) * _int32(0x9E3779B9) + _int32(seed))  # 1-d: wraps silently
    return xp.reshape(key, ())


def _redraw(key, m: _Matrix, like, xp):
    """Matrix ``m``'s ``cols x rank`` values uniform in [-1, 1) (multiples of 2**-23): a function of the key
    (seed and step) and the position *within the matrix* only, so a matrix redraws the same values wherever
    it sits in a bucket (DDP's comm hook regroups buckets; a resume must stay bitwise).

    The direction of a ``Q`` column is all that matters, so uniform serves as well
    as normal and needs no ``log``/``cos`` whose rounding differs between libraries.
    """
    positions = xp.arange(m.cols * m.rank, dtype=xp.int32, device=array_api_compat.device(like))
    bits = _mix(positions + key) & 0xFFFFFF
    values = xp.astype(xp.astype(bits, xp.float32) / 2.0**23 - 1.0, like.dtype)
    return xp.reshape(values, (m.cols, m.rank))


def _revive(q, fresh, xp):
    """``q`` with each all-zero column replaced by that column of ``fresh`` (a dead warm start, see above)."""
    return xp.where(xp.all(q == 0, axis=0), fresh, q)


@dataclasses.dataclass(frozen=True)
class PowerSGD(Algorithm):
    """Rank-r gradient compression with error feedback, as torch's ``powerSGD_hook`` (same names).

    Args:
        matrix_approximation_rank: r, the rank of each matrix's approximation ``P Q^T``.
        start_powerSGD_iter: steps of plain allreduce before compressing.
        min_compression_rate: compress a matrix only where ``n m / (r (n + m))`` exceeds this.
        use_error_feedback: add what compression lost to the next step's gradient.
        warm_start: start each step's ``Q`` from the last one (else from the seeded draw).
        random_seed: the seed of the initial ``Q`` and of redrawn zero columns (the same on every rank).
    """

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

    def branch_key(self, step):
        return step >= self.start_powerSGD_iter

    def init(self, flat, layout, world_size):
        xp = namespace(flat)
        matrices, _ = self._plan(layout)
        rng = np.random.default_rng(self.random_seed)  # the same draw on every rank
        q = np.concatenate([rng.standard_normal(m.cols * m.rank) for m in matrices] or [np.zeros(0)])
        q = xp.asarray(q, dtype=flat.dtype, device=array_api_compat.device(flat))
        return PowerSGDState(step=counter(xp), q=q, error=xp.zeros_like(flat))

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
            flat, q, e = carry

            def fed(m):
                """The matrix plus its error feedback as a new array: its result must not depend on where it sits
                in the bucket (BLAS rounds differently at other alignments), so regrouped buckets (DDP's rebuild,
                a resume through the comm hook) compute bitwise the same."""
                end = m.offset + m.rows * m.cols
                if self.use_error_feedback:
                    x = flat[m.offset : end] + e[m.offset : end]
                else:
                    x = xp.asarray(flat[m.offset : end], copy=True, device=array_api_compat.device(flat))
                return xp.reshape(x, (m.rows, m.cols))

            pieces, fed_back = {}, {}  # bucket offset -> reduced values, and -> the values reduced (g + e)
            if plain:
                g = xp.concat([flat[o : o + n] for o, n in plain])
                if self.use_error_feedback:
                    g = g + xp.concat([e[o : o + n] for o, n in plain])
                averaged = comm.allreduce(g, ReduceOp.AVG)
                start = 0
                for o, n in plain:
                    pieces[o], fed_back[o] = averaged[start : start + n], g[start : start + n]
                    start += n
            if matrices:
                ms = [fed(m) for m in matrices]
                key = _step_key(self.random_seed, state.step, xp)
                qs = [_orthonormal(_revive(m.q(q, xp), _redraw(key, m, q, xp), xp), xp) for m in matrices]
                ps = self._exchange([xp.matmul(mat, qm) for mat, qm in zip(ms, qs)], comm, ReduceOp.SUM, xp)
                ps = [_orthonormal(p, xp) for p in ps]
                qs = self._exchange([xp.matmul(mat.T, p) for mat, p in zip(ms, ps)], comm, ReduceOp.AVG, xp)
                for m, mat, p, qm in zip(matrices, ms, ps, qs):
                    pieces[m.offset] = xp.reshape(xp.matmul(p, qm.T), (-1,))
                    fed_back[m.offset] = xp.reshape(mat, (-1,))
                if self.warm_start:  # else the state keeps the first draw
                    q = xp.concat([xp.reshape(qm, (-1,)) for qm in qs])
            offsets = sorted(pieces)
            out = xp.concat([pieces[o] for o in offsets])
            if self.use_error_feedback:
                e = xp.concat([fed_back[o] - pieces[o] for o in offsets])
            return out, q, e

        host = comm.counter(state.step)  # for the branch only: the seed reads the traced counter
        compressing = namespace(host).astype(host >= self.start_powerSGD_iter, namespace(host).int32)
        out, q, e = comm.switch(compressing, [allreduce, compress], (flat, state.q, state.error))
        return out, PowerSGDState(step=state.step + 1, q=q, error=e)

    def split_state(self, state, layout):
        """Per tensor: the step, its ``Q`` (empty if not compressed) and its error feedback; all per matrix or
        elementwise, so a tensor keeps them in any bucket."""
        matrices, _ = self._plan(layout)
        by_offset = {m.offset: m for m in matrices}
        pieces = []
        for slot in layout.slots:
            m = by_offset.get(slot.offset) if slot.numel else None  # a zero-size slot may share the next offset
            q = state.q[m.q_offset : m.q_offset + m.cols * m.rank] if m else state.q[:0]
            error = state.error[slot.offset : slot.offset + slot.numel]
            pieces.append(PowerSGDState(step=state.step, q=q, error=error))
        return pieces

    def join_state(self, pieces, layout):
        """Pieces back to back in slot order (the padding's error is zero); the step is the largest, so a tensor
        new to the bucket follows the others (DDP reduces every bucket every step: they agree anyway)."""
        xp = namespace(pieces[0].error)
        first = pieces[0].error
        padding = xp.zeros(layout.padded_numel - layout.numel, dtype=first.dtype, device=array_api_compat.device(first))
        step = pieces[0].step
        for piece in pieces[1:]:
            step = xp.maximum(step, piece.step)
        return PowerSGDState(step=step, q=xp.concat([p.q for p in pieces]),
                             error=xp.concat([p.error for p in pieces] + [padding]))

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
