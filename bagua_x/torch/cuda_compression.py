"""MinMaxUInt8 on CUDA tensors as hand-written Triton kernels: quantise straight into the packed rows.

``torch.compile`` of the framework-free kernels (:mod:`bagua_x.torch.kernels`)
measured on an H200 at ByteGrad's shapes: its pointwise kernels ran at 1.4-1.7
TB/s, and packing (``concat`` of the bytes and the 8-byte headers, rows not
aligned) at 0.6 TB/s, a quarter of the round trip.  Here a compressed row is
written in place: one pass finds each row's min and max in parts, and one
pass finishes them, quantises into the packed buffer and writes each row's
header bytes; decompressing is one pass that reads the header and the bytes; ByteGrad's owner step
(dequantise the received rows, sum them in rank order, quantise the sum into one packed row) is a pass that
sums and finds the min and max in parts, then the same quantising pass.  The formulas are those of
:mod:`bagua_x.algorithms.compression`, each operation rounded as there
(precise division, no fused multiply-add: ``enable_fp_fusion=False``), so
results equal the other paths bit for bit.

This module imports Triton; :mod:`bagua_x.torch.kernels` imports it at the
first CUDA bucket, so importing bagua_x.torch never needs Triton, and uses it
for contiguous CUDA tensors only.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from ..algorithms.compression import EPS, HEADER_BYTES

__all__ = ["compress_rows", "decompress_rows", "reduce_requantize", "applies"]

BLOCK = 4096  # elements per program: 16 KB of float32 read per program
WARPS = 8
_EPS = tl.constexpr(EPS)  # a jit function reads only constexpr globals


def applies(x: torch.Tensor, out=None) -> bool:
    """Whether the Triton kernels take ``x`` (and ``out``): 2-D and contiguous, ``out`` float32 (a narrower
    ``out`` goes to the compiled kernels, whose rounding to it is torch's)."""
    ok = x.dim() == 2 and x.is_contiguous() and x.shape[1] > 0
    return ok and (out is None or (out.is_contiguous() and out.dtype == torch.float32))


@triton.jit
def _rint(v):
    """Round half to even, exactly (numpy's ``round``): below 2**23 in magnitude, adding and taking away
    2**23 leaves the nearest integer (float32 has no fraction bits there); above, ``v`` is an integer."""
    r = (tl.abs(v) + 8388608.0) - 8388608.0
    return tl.where(tl.abs(v) >= 8388608.0, v, tl.where(v < 0, -r, r))


@triton.jit
def _row_bounds(mn, mx):
    """``_scale_bounds`` of compression.py, operation by operation."""
    big = tl.maximum(tl.maximum(tl.abs(mn), tl.abs(mx)), 1.0)
    span = (mx * 0.25 - mn * 0.25) + (0.25 * _EPS) * big
    scale = tl.math.div_rn(tl.full(span.shape, 63.75, tl.float32), span)
    upper = _rint(mx * scale)
    return scale, upper - 255.0, upper


@triton.jit
def _minmax_parts(x_ptr, part_ptr, k, parts, steps, BLOCK: tl.constexpr):
    """Program ``part`` of a row takes blocks part, part + parts, ...: a few hundred programs read at
    full bandwidth, and each row leaves ``parts`` (min, max) pairs for the quantising programs to finish."""
    part, row = tl.program_id(0), tl.program_id(1)
    lo = tl.full((BLOCK,), float("inf"), tl.float32)
    hi = tl.full((BLOCK,), float("-inf"), tl.float32)
    for step in range(steps):
        offs = (part + step * parts) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < k
        x = tl.load(x_ptr + row.to(tl.int64) * k + offs, mask=mask, other=0.0).to(tl.float32)
        lo = tl.minimum(lo, tl.where(mask, x, float("inf")))
        hi = tl.maximum(hi, tl.where(mask, x, float("-inf")))
    at = (row * parts + part) * 2
    tl.store(part_ptr + at, tl.min(lo, axis=0))
    tl.store(part_ptr + at + 1, tl.max(hi, axis=0))


@triton.jit
def _quantize_packed(x_ptr, part_ptr, packed_ptr, k, parts, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    """Each program finishes its row's min and max from the parts (a few KB, from L2), quantises its
    block into the packed row, and the row's first program writes the header (min, max as bytes)."""
    block, row = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, PARTS)
    there = i < parts
    mn = tl.min(tl.load(part_ptr + (row * parts + i) * 2, mask=there, other=float("inf")), axis=0)
    mx = tl.max(tl.load(part_ptr + (row * parts + i) * 2 + 1, mask=there, other=float("-inf")), axis=0)
    scale, lower, upper = _row_bounds(mn, mx)
    start = packed_ptr + row.to(tl.int64) * (k + 8)
    if block == 0:  # little-endian float32 bytes, as .view(uint8) lays them out
        j = tl.arange(0, 4)
        tl.store(start + k + j, ((mn.to(tl.int32, bitcast=True) >> (8 * j)) & 255).to(tl.uint8))
        tl.store(start + k + 4 + j, ((mx.to(tl.int32, bitcast=True) >> (8 * j)) & 255).to(tl.uint8))
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    x = tl.load(x_ptr + row.to(tl.int64) * k + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(_rint(x * scale), lower), upper) - lower
    tl.store(start + offs, q.to(tl.uint8), mask=mask)


@triton.jit
def _header(start, k):
    """A packed row's min and max, from its 8 header bytes (little-endian float32) after ``k`` codes."""
    j = tl.arange(0, 8)
    shifted = tl.load(start + k + j).to(tl.int32) << (8 * (j % 4))
    mn = tl.sum(tl.where(j < 4, shifted, 0), axis=0).to(tl.float32, bitcast=True)
    mx = tl.sum(tl.where(j >= 4, shifted, 0), axis=0).to(tl.float32, bitcast=True)
    return mn, mx


@triton.jit
def _dequantized(start, k, offs, mask):
    """The values at ``offs`` of the packed row at ``start``."""
    mn, mx = _header(start, k)
    scale, lower, _ = _row_bounds(mn, mx)
    q = tl.load(start + offs, mask=mask, other=0).to(tl.float32)
    return tl.math.div_rn(q + lower, scale)


@triton.jit
def _dequantize_packed(packed_ptr, out_ptr, k, BLOCK: tl.constexpr):
    block, row = tl.program_id(0), tl.program_id(1)  # blocks on x: up to 2**31 - 1
    offs = block * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    y = _dequantized(packed_ptr + row.to(tl.int64) * (k + 8), k, offs, mask)
    tl.store(out_ptr + row.to(tl.int64) * k + offs, y, mask=mask)


@triton.jit
def _sum_parts(packed_ptr, total_ptr, part_ptr, k, rows, parts, steps, AVERAGE: tl.constexpr,
               BLOCK: tl.constexpr):
    """ByteGrad's owner step, first pass: program ``part`` takes blocks part, part + parts, ...; for each it
    dequantises the block of every received row, sums them in rank order from the first row (not from 0:
    0 + -0.0 would lose a sign), divides by the row count when averaging, writes the block of the sum and keeps its
    min and max, left as ``_minmax_parts`` leaves them for ``_quantize_packed``."""
    part = tl.program_id(0)
    lo = tl.full((BLOCK,), float("inf"), tl.float32)
    hi = tl.full((BLOCK,), float("-inf"), tl.float32)
    for step in range(steps):
        offs = (part + step * parts) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < k
        start = packed_ptr  # a pointer moved row by row: 64-bit, however many bytes the rows hold
        total = _dequantized(start, k, offs, mask)
        for _ in range(1, rows):
            start += k + 8
            total += _dequantized(start, k, offs, mask)
        if AVERAGE:
            total = tl.math.div_rn(total, tl.full(total.shape, rows, tl.float32))
        tl.store(total_ptr + offs, total, mask=mask)
        lo = tl.minimum(lo, tl.where(mask, total, float("inf")))
        hi = tl.maximum(hi, tl.where(mask, total, float("-inf")))
    tl.store(part_ptr + part * 2, tl.min(lo, axis=0))
    tl.store(part_ptr + part * 2 + 1, tl.max(hi, axis=0))


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    """Programs that keep every multiprocessor of ``device`` reading: four per multiprocessor (4 on the CPU,
    where only Triton's interpreter runs these kernels: tests, with rows split into parts of several blocks)."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _on(device: torch.device):
    """Context in which a launch goes to ``device``: Triton launches on the calling thread's current CUDA
    device, which need not be the tensor's (a thread that never set it is on GPU 0)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def compress_rows(x: torch.Tensor) -> torch.Tensor:
    """:func:`bagua_x.algorithms.compression.compress_rows` for a contiguous 2-D CUDA tensor."""
    rows, k = x.shape
    blocks = triton.cdiv(k, BLOCK)
    parts = min(blocks, triton.cdiv(_programs(x.device), rows))
    partial = torch.empty(rows, parts, 2, dtype=torch.float32, device=x.device)
    packed = torch.empty(rows, k + HEADER_BYTES, dtype=torch.uint8, device=x.device)
    with _on(x.device):
        _minmax_parts[(parts, rows)](x, partial, k, parts, triton.cdiv(blocks, parts), BLOCK=BLOCK,
                                     num_warps=WARPS)
        _quantize_packed[(blocks, rows)](x, partial, packed, k, parts, BLOCK=BLOCK,
                                         PARTS=triton.next_power_of_2(parts), num_warps=WARPS,
                                         enable_fp_fusion=False)
    return packed


def reduce_requantize(packed: torch.Tensor, average: bool) -> torch.Tensor:
    """:func:`bagua_x.algorithms.compression.reduce_requantize` for a contiguous packed CUDA tensor (R, k + 8):
    two kernels (sum with min/max parts, then quantise into the packed row) instead of a dequantisation,
    a compiled sum and quantisation, and a packing concat."""
    rows, k = packed.shape[0], packed.shape[1] - HEADER_BYTES
    blocks = triton.cdiv(k, BLOCK)
    parts = min(blocks, _programs(packed.device))
    total = torch.empty(1, k, dtype=torch.float32, device=packed.device)
    partial = torch.empty(1, parts, 2, dtype=torch.float32, device=packed.device)
    out = torch.empty(1, k + HEADER_BYTES, dtype=torch.uint8, device=packed.device)
    with _on(packed.device):
        _sum_parts[(parts,)](packed, total, partial, k, rows, parts, triton.cdiv(blocks, parts), AVERAGE=average,
                             BLOCK=BLOCK, num_warps=WARPS, enable_fp_fusion=False)
        _quantize_packed[(blocks, 1)](total, partial, out, k, parts, BLOCK=BLOCK,
                                      PARTS=triton.next_power_of_2(parts), num_warps=WARPS, enable_fp_fusion=False)
    return out


def decompress_rows(packed: torch.Tensor, out=None) -> torch.Tensor:
    """:func:`bagua_x.algorithms.compression.decompress_rows` for a contiguous packed CUDA tensor."""
    rows, k = packed.shape[0], packed.shape[1] - HEADER_BYTES
    if out is None:
        out = torch.empty(rows, k, dtype=torch.float32, device=packed.device)
    with _on(packed.device):
        _dequantize_packed[(triton.cdiv(k, BLOCK), rows)](packed, out, k, BLOCK=BLOCK, num_warps=WARPS,
                                                        enable_fp_fusion=False)
    return out
