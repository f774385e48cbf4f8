"""MinMaxUInt8: 8-bit quantisation of each row of a 2-D array (Bagua's scheme), and its 4-bit sibling.

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

The 4-bit form (DiLoCo's ``bits=4``) is the same formula with 15 levels
instead of 255, two codes packed a byte (low nibble first): :func:`codec`
gives either form's compress / owner-reduce / decompress triple.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import array_api_compat

from .base import namespace
from .kernels import kernel

__all__ = ["EPS", "HEADER_BYTES", "Codec", "codec", "compress_rows", "decompress_rows", "reduce_requantize", "pack_rows", "unpack_rows",
           "quantize_roundtrip", "quantize", "dequantize", "dequantize_into", "sum_requantize"]

EPS = 1e-7
HEADER_BYTES = 8  # each compressed row ends with its min and max (float32)


def _scale_bounds(xp, mn, mx, levels: int = 255):
    big = xp.maximum(xp.maximum(xp.abs(mn), xp.abs(mx)), xp.ones_like(mx))
    scale = (levels / 4) / ((mx * 0.25 - mn * 0.25) + 0.25 * EPS * big)
    upper = xp.round(mx * scale)
    return scale, upper - float(levels), upper


# -- kernels: pure array functions on the unpacked form ---------------------------------------------------


@kernel
def quantize(x, levels: int = 255):
    """float (R, k) -> (uint8 (R, k) codes in [0, levels], float32 (R, 2) holding each row's min and max)."""
    xp = namespace(x)
    x = xp.astype(x, xp.float32, copy=False)
    mn = xp.min(x, axis=1, keepdims=True)
    mx = xp.max(x, axis=1, keepdims=True)
    scale, lower, upper = _scale_bounds(xp, mn, mx, levels)
    q = xp.clip(xp.round(x * scale), lower, upper) - lower
    return xp.astype(q, xp.uint8), xp.concat([mn, mx], axis=1)


@kernel
def dequantize(q, minmax, levels: int = 255):
    """Inverse of :func:`quantize`: float32 (R, k)."""
    xp = namespace(q)
    mn, mx = minmax[:, 0:1], minmax[:, 1:2]
    scale, lower, _ = _scale_bounds(xp, mn, mx, levels)
    return (xp.astype(q, xp.float32) + lower) / scale


@kernel
def dequantize_into(q, minmax, out):
    """:func:`dequantize` written over ``out`` (any float dtype), which is returned."""
    out[...] = dequantize.plain(q, minmax)
    return out


@kernel
def sum_requantize(q, minmax, average: bool, levels: int = 255):
    """Sum the dequantised rows, divide by their count when averaging, quantise the result as one row."""
    rows = dequantize.plain(q, minmax, levels)
    # Row by row, not xp.sum(axis=0): XLA on CPU compiles that reduction fused with the dequantisation into a
    # slow loop (2 x 2.1M: 85 ms against 1.3 ms; 4 rows: 1.9 s against 6 ms), and rank order is numpy's order.
    total = rows[0:1]
    for i in range(1, rows.shape[0]):
        total = total + rows[i:i + 1]
    if average:
        total = total / q.shape[0]
    return quantize.plain(total, levels)


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


@kernel
def reduce_requantize(packed, average: bool):
    """ByteGrad's owner step on the chunks a rank received (R, k + 8): sum the dequantised
    rows, divide by their count when averaging, compress the result as one row (1, k + 8)."""
    q, minmax = unpack_rows(packed)
    return pack_rows(*sum_requantize(q, minmax, average))


# -- 4 bits: 15 levels, two codes a byte ----------------------------------------------------------------


def pack_nibbles(q):
    """uint8 codes (R, 2k), each < 16 -> uint8 (R, k): code 2j in the low nibble of byte j, 2j + 1 in the high."""
    xp = namespace(q)
    four = xp.asarray(4, dtype=xp.uint8, device=array_api_compat.device(q))
    return xp.bitwise_or(q[:, 0::2], xp.bitwise_left_shift(q[:, 1::2], four))


def unpack_nibbles(packed):
    """Inverse of :func:`pack_nibbles`: uint8 (R, k) -> uint8 codes (R, 2k)."""
    xp = namespace(packed)
    device = array_api_compat.device(packed)
    low = xp.bitwise_and(packed, xp.asarray(15, dtype=xp.uint8, device=device))
    high = xp.bitwise_right_shift(packed, xp.asarray(4, dtype=xp.uint8, device=device))
    return xp.reshape(xp.stack([low, high], axis=2), (packed.shape[0], -1))


@kernel
def compress_rows4(x):
    """Quantise each row of float ``x`` (R, 2k) to 4 bits -> uint8 (R, k + 8): the packed codes, then the
    row's min and max."""
    q, minmax = quantize.plain(x, 15)
    return pack_rows(pack_nibbles(q), minmax)


@kernel
def decompress_rows4(packed, out=None):
    """Inverse of :func:`compress_rows4`: float32 (R, 2k), written over ``out`` (any float dtype) if given."""
    q, minmax = unpack_rows(packed)
    rows = dequantize.plain(unpack_nibbles(q), minmax, 15)
    if out is None:
        return rows
    out[...] = rows
    return out


def reduce_requantize4(packed, average: bool):
    """:func:`reduce_requantize` on 4-bit rows."""
    q, minmax = unpack_rows(packed)
    q, minmax = sum_requantize(unpack_nibbles(q), minmax, average, 15)
    return pack_rows(pack_nibbles(q), minmax)


class Codec(NamedTuple):
    """One quantised form's three steps of the compressed allreduce (see :mod:`.bytegrad`), and the row
    length its packing needs a multiple of."""

    compress: Callable  # float (R, k) -> packed uint8 (R, k * bits / 8 + 8)
    reduce_requantize: Callable  # (packed rows received, average) -> packed (1, ...)
    decompress: Callable  # (packed, out=None) -> float32 (R, k)
    row_multiple: int


def codec(bits: int) -> Codec:
    """The 8-bit (MinMaxUInt8) or 4-bit codec."""
    if bits == 8:
        return Codec(compress_rows, reduce_requantize, decompress_rows, 1)
    if bits == 4:
        return Codec(compress_rows4, reduce_requantize4, decompress_rows4, 2)
    raise ValueError(f"no {bits}-bit codec: 8 or 4")


def quantize_roundtrip(x):
    """Compress and decompress a flat array as one row (what a peer reconstructs)."""
    xp = namespace(x)
    return xp.reshape(decompress_rows(compress_rows(xp.reshape(x, (1, -1)))), x.shape)
