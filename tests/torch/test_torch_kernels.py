"""The compiled MinMaxUInt8 kernels give the eager formula's results bit for bit."""

import torch

import bagua_x.torch  # noqa: F401  (installs the kernels)
from bagua_x.algorithms import compression
from bagua_x.torch.kernels import MIN_NUMEL


def test_fused_kernels_are_registered_and_bitwise_equal():
    x = torch.randn(2, MIN_NUMEL // 2 + 3)
    assert compression._fused("compress_rows", x) is not None
    packed = compression.compress_rows(x)
    assert torch.equal(packed, compression.compress_rows_eager(x))
    assert torch.equal(compression.decompress_rows(packed), compression.decompress_rows_eager(packed))
    for dtype in (torch.float32, torch.bfloat16):
        out, out0 = torch.empty(x.shape, dtype=dtype), torch.empty(x.shape, dtype=dtype)
        assert compression.decompress_rows(packed, out=out) is out
        compression.decompress_rows_into_eager(packed, out0)
        assert torch.equal(out, out0) and torch.equal(out, compression.decompress_rows_eager(packed).to(dtype))
    assert torch.equal(compression.reduce_requantize(packed, True), compression.reduce_requantize_eager(packed, True))


def test_small_arrays_stay_eager():
    assert compression._fused("compress_rows", torch.zeros(2, 8)) is None
