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

A compressed row travels as one uint8 array: the row's bytes, then an
8-byte header holding its min and max (float32), so one collective carries
both (as in Bagua).  The arithmetic lives in four kernels on the unpacked
form (``quantize``, ``dequantize``, ``dequantize_into``, ``sum_requantize``;
see :mod:`.kernels`); packing is glue around them, outside compiled code.
``compress_rows`` and ``decompress_rows`` are kernels too, so that a frontend
can stand in one that writes the packed rows directly (torch on CUDA:
:mod:`bagua_x.torch.cuda_compression`); called plain, they run the kernels
inside them.
"""

from __future__ import annotations

import array_api_compat

from .base import namespace
from .kernels import kernel

__all__ = ["EPS", "HEADER_BYTES", "compress_rows", "decompress_rows", "reduce_requantize", "pack_rows", "unpack_rows",
           "quantize_roundtrip", "quantize", "dequantize", "dequantize_into", "sum_requantize"]

EPS = 1e-7
HEADER_BYTES = 8  # each compressed row ends with its min and max (float32)


def _scale_bounds(xp, mn, mx):
    big = xp.maximum(xp.maximum(xp.abs(mn), xp.abs(mx)), xp.ones_like(mx))
    scale = 63.75 / ((mx * 0.25 - mn * 0.25) + 0.25 * EPS * big)
    upper = xp.round(mx * scale)
    return scale, upper - 255.0, upper


# -- kernels: pure array functions on the unpacked form ---------------------------------------------------


@kernel
def quantize(x):
    """float (R, k) -> (uint8 (R, k), float32 (R, 2) holding each row's min and max)."""
    xp = namespace(x)
    x = xp.astype(x, xp.float32, copy=False)
    mn = xp.min(x, axis=1, keepdims=True)
    mx = xp.max(x, axis=1, keepdims=True)
    scale, lower, upper = _scale_bounds(xp, mn, mx)
    q = xp.clip(xp.round(x * scale), lower, upper) - lower
    return xp.astype(q, xp.uint8), xp.concat([mn, mx], axis=1)


@kernel
def dequantize(q, minmax):
    """Inverse of :func:`quantize`: float32 (R, k)."""
    xp = namespace(q)
    mn, mx = minmax[:, 0:1], minmax[:, 1:2]
    scale, lower, _ = _scale_bounds(xp, mn, mx)
    return (xp.astype(q, xp.float32) + lower) / scale


@kernel
def dequantize_into(q, minmax, out):
    """:func:`dequantize` written over ``out`` (any float dtype), which is returned."""
    out[...] = dequantize.plain(q, minmax)
    return out


@kernel
def sum_requantize(q, minmax, average: bool):
    """Sum the dequantised rows, divide by their count when averaging, quantise the result as one row."""
    rows = dequantize.plain(q, minmax)
    # Row by row, not xp.sum(axis=0): XLA on CPU compiles that reduction fused with the dequantisation into a
    # slow loop (2 x 2.1M: 85 ms against 1.3 ms; 4 rows: 1.9 s against 6 ms), and rank order is numpy's order.
    total = rows[0:1]
    for i in range(1, rows.shape[0]):
        total = total + rows[i:i + 1]
    if average:
        total = total / q.shape[0]
    return quantize.plain(total)


# -- the packed form ---------------------------------------------------------------------------------------


def pack_rows(q, minmax):
    """uint8 (R, k) and float32 (R, 2) -> uint8 (R, k + 8)."""
    xp = namespace(q)
    # .view(dtype) reinterprets bytes (numpy, torch and jax arrays all have it; the Array API does not)
    header = xp.asarray(minmax, dtype=xp.float32, copy=True, device=array_api_compat.device(q)).view(xp.uint8)
    return xp.concat([q, header], axis=1)


def unpack_rows(packed):
    """uint8 (R, k + 8) -> the payload (R, k) (a view) and float32 (R, 2) min/max."""
    xp = namespace(packed)
    # a fresh 1-D copy: reinterpreting bytes as float32 needs them contiguous and 4-byte aligned
    header = xp.asarray(xp.reshape(packed[:, -HEADER_BYTES:], (-1,)), copy=True, device=array_api_compat.device(packed))
    return packed[:, :-HEADER_BYTES], xp.reshape(header.view(xp.float32), (-1, 2))


@kernel
def compress_rows(x):
    """Quantise each row of float ``x`` (R, k) -> uint8 (R, k + 8): each row's bytes, then its
    min and max as float32 bytes."""
    return pack_rows(*quantize(x))


@kernel
def decompress_rows(packed, out=None):
    """Inverse of :func:`compress_rows`: float32 (R, k).

    ``out``, a writable (R, k) array of any float dtype, receives the result
    (cast to its dtype) and is returned: one pass over memory and no new
    buffer, which on a CPU costs more than the arithmetic (fresh pages fault in).
    """
    q, minmax = unpack_rows(packed)
    return dequantize(q, minmax) if out is None else dequantize_into(q, minmax, out)


def reduce_requantize(packed, average: bool):
    """ByteGrad's owner step on the chunks a rank received (R, k + 8): sum the dequantised
    rows, divide by their count when averaging, compress the result as one row (1, k + 8)."""
    q, minmax = unpack_rows(packed)
    return pack_rows(*sum_requantize(q, minmax, average))


def quantize_roundtrip(x):
    """Compress and decompress a flat array as one row (what a peer reconstructs)."""
    xp = namespace(x)
    return xp.reshape(decompress_rows(compress_rows(xp.reshape(x, (1, -1)))), x.shape)
