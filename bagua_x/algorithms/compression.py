"""MinMaxUInt8: 8-bit quantisation of each row of a 2-D array (Bagua's scheme).

Per row: ``scale = 255 / (max - min + eps)``, ``upper = rint(max * scale)``,
``lower = upper - 255``, ``q = uint8(clip(rint(x * scale), lower, upper) - lower)``
and back ``x' = (q + lower) / scale``.  The error is at most one step
``1 / scale`` per element.

Two guards keep extreme inputs finite, without changing ordinary results:
the range is computed from quarters (``max/4 - min/4`` cannot overflow for
any finite float32, +-3.4e38 included), and ``eps`` is taken relative to the largest
magnitude when that exceeds 1 (a constant row of 1e30 would otherwise scale
to infinity).  For inputs of magnitude <= 1 this is exactly Bagua's formula.
"""

from __future__ import annotations

from .base import namespace

__all__ = ["EPS", "compress_rows", "decompress_rows", "reduce_requantize", "quantize_roundtrip", "register_fused"]

EPS = 1e-7

# Eager array libraries run the formula below as a dozen separate passes over
# memory; a frontend may register a fused (compiled) version of the same code
# for its namespace.  JAX needs none: the step is traced and XLA fuses it.
_FUSED: dict[str, tuple] = {}


def register_fused(namespace_name: str, kernels: dict, min_numel: int = 0) -> None:
    """Use ``kernels[name]`` (same results as this module's ``name``) for arrays of namespace
    ``namespace_name`` with at least ``min_numel`` elements (below that, compiling does not pay off).

    Names: ``"compress_rows"``, ``"decompress_rows"``, ``"reduce_requantize"``.
    """
    _FUSED[namespace_name] = (kernels, min_numel)


def _fused(name: str, x):
    entry = _FUSED.get(namespace(x).__name__)
    if entry is not None and x.shape[0] * x.shape[1] >= entry[1]:
        return entry[0].get(name)
    return None


def _scale_bounds(xp, mn, mx):
    big = xp.maximum(xp.maximum(xp.abs(mn), xp.abs(mx)), xp.ones_like(mx))
    scale = 63.75 / ((mx * 0.25 - mn * 0.25) + 0.25 * EPS * big)
    upper = xp.round(mx * scale)
    return scale, upper - 255.0, upper


def compress_rows(x):
    """Quantise each row of float ``x`` (R, k) -> (uint8 (R, k), float32 (R, 2) holding min and max)."""
    fused = _fused("compress_rows", x)
    return fused(x) if fused is not None else compress_rows_eager(x)


def compress_rows_eager(x):
    xp = namespace(x)
    x = xp.astype(x, xp.float32, copy=False)
    mn = xp.min(x, axis=1, keepdims=True)
    mx = xp.max(x, axis=1, keepdims=True)
    scale, lower, upper = _scale_bounds(xp, mn, mx)
    q = xp.clip(xp.round(x * scale), lower, upper) - lower
    return xp.astype(q, xp.uint8), xp.concat([mn, mx], axis=1)


def decompress_rows(q, minmax):
    """Inverse of :func:`compress_rows`: float32 (R, k)."""
    fused = _fused("decompress_rows", q)
    return fused(q, minmax) if fused is not None else decompress_rows_eager(q, minmax)


def decompress_rows_eager(q, minmax):
    xp = namespace(q)
    mn, mx = minmax[:, 0:1], minmax[:, 1:2]
    scale, lower, _ = _scale_bounds(xp, mn, mx)
    return (xp.astype(q, xp.float32) + lower) / scale


def reduce_requantize(q, minmax, average: bool):
    """Sum the dequantised rows (a rank's received chunks), divide by their count when
    averaging, and quantise the result as one row: ByteGrad's owner step."""
    fused = _fused("reduce_requantize", q)
    return fused(q, minmax, average) if fused is not None else reduce_requantize_eager(q, minmax, average)


def reduce_requantize_eager(q, minmax, average: bool):
    xp = namespace(q)
    total = xp.sum(decompress_rows_eager(q, minmax), axis=0, keepdims=True)
    if average:
        total = total / q.shape[0]
    return compress_rows_eager(total)


def quantize_roundtrip(x):
    """Compress and decompress a flat array as one row (what a peer reconstructs)."""
    xp = namespace(x)
    q, mm = compress_rows(xp.reshape(x, (1, -1)))
    return xp.reshape(decompress_rows(q, mm), x.shape)
