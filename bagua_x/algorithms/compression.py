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

__all__ = ["EPS", "HEADER_BYTES", "compress_rows", "decompress_rows", "unpack_rows", "reduce_requantize", "quantize_roundtrip",
           "register_fused"]

EPS = 1e-7
HEADER_BYTES = 8  # each compressed row ends with its min and max (float32)

# Eager array libraries run the formula below as a dozen separate passes over
# memory; a frontend may register a fused (compiled) version of the same code
# for its namespace.  JAX needs none: the step is traced and XLA fuses it.
_FUSED: dict[str, tuple] = {}


def register_fused(namespace_name: str, kernels: dict, min_numel: int = 0) -> None:
    """Use ``kernels[name]`` (same results as this module's ``name``) for arrays of namespace
    ``namespace_name`` with at least ``min_numel`` elements (below that, compiling does not pay off).

    Names: ``"compress_rows"``, ``"decompress_rows"``, ``"decompress_rows_into"``, ``"reduce_requantize"``.
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
    """Quantise each row of float ``x`` (R, k) -> uint8 (R, k + 8): each row's bytes, then its
    min and max as float32 bytes (one array, so one collective carries both)."""
    fused = _fused("compress_rows", x)
    return fused(x) if fused is not None else compress_rows_eager(x)


def compress_rows_eager(x):
    xp = namespace(x)
    x = xp.astype(x, xp.float32, copy=False)
    mn = xp.min(x, axis=1, keepdims=True)
    mx = xp.max(x, axis=1, keepdims=True)
    scale, lower, upper = _scale_bounds(xp, mn, mx)
    q = xp.clip(xp.round(x * scale), lower, upper) - lower
    # .view(dtype) reinterprets bytes (numpy, torch and jax arrays all have it; the Array API does not)
    return xp.concat([xp.astype(q, xp.uint8), xp.concat([mn, mx], axis=1).view(xp.uint8)], axis=1)


def unpack_rows(packed):
    """Split :func:`compress_rows`'s output into the uint8 payload (R, k) and float32 (R, 2) min/max."""
    xp = namespace(packed)
    # a fresh 1-D copy: reinterpreting bytes as float32 needs them contiguous and 4-byte aligned
    header = xp.asarray(xp.reshape(packed[:, -HEADER_BYTES:], (-1,)), copy=True)
    return packed[:, :-HEADER_BYTES], xp.reshape(header.view(xp.float32), (-1, 2))


def decompress_rows(packed, out=None):
    """Inverse of :func:`compress_rows`: float32 (R, k).

    ``out``, a writable (R, k) array of any float dtype, receives the result
    (cast to its dtype) and is returned: one pass over memory and no new
    buffer, which on a CPU costs more than the arithmetic (fresh pages fault in).
    """
    if out is None:
        fused = _fused("decompress_rows", packed)
        return fused(packed) if fused is not None else decompress_rows_eager(packed)
    fused = _fused("decompress_rows_into", packed)
    return fused(packed, out) if fused is not None else decompress_rows_into_eager(packed, out)


def decompress_rows_eager(packed):
    xp = namespace(packed)
    q, minmax = unpack_rows(packed)
    mn, mx = minmax[:, 0:1], minmax[:, 1:2]
    scale, lower, _ = _scale_bounds(xp, mn, mx)
    return (xp.astype(q, xp.float32) + lower) / scale


def decompress_rows_into_eager(packed, out):
    out[...] = decompress_rows_eager(packed)
    return out


def reduce_requantize(packed, average: bool):
    """Sum the dequantised rows (a rank's received chunks), divide by their count when
    averaging, and quantise the result as one row: ByteGrad's owner step."""
    fused = _fused("reduce_requantize", packed)
    return fused(packed, average) if fused is not None else reduce_requantize_eager(packed, average)


def reduce_requantize_eager(packed, average: bool):
    xp = namespace(packed)
    total = xp.sum(decompress_rows_eager(packed), axis=0, keepdims=True)
    if average:
        total = total / packed.shape[0]
    return compress_rows_eager(total)


def quantize_roundtrip(x):
    """Compress and decompress a flat array as one row (what a peer reconstructs)."""
    xp = namespace(x)
    return xp.reshape(decompress_rows(compress_rows(xp.reshape(x, (1, -1)))), x.shape)
