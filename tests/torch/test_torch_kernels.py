"""The compiled MinMaxUInt8 kernels give the eager formula's results bit for bit."""

import torch

import bagua_x.torch  # noqa: F401  (installs the kernels)
from bagua_x.algorithms import compression
from bagua_x.torch.kernels import MIN_NUMEL


def test_fused_kernels_are_registered_and_bitwise_equal():
    x = torch.randn(2, MIN_NUMEL // 2 + 3)
    assert compression._fused("compress_rows", x) is not None
    q, mm = compression.compress_rows(x)
    q0, mm0 = compression.compress_rows_eager(x)
    assert torch.equal(q, q0) and torch.equal(mm, mm0)
    assert torch.equal(compression.decompress_rows(q, mm), compression.decompress_rows_eager(q0, mm0))
    for a, b in zip(compression.reduce_requantize(q, mm, True), compression.reduce_requantize_eager(q0, mm0, True)):
        assert torch.equal(a, b)


def test_small_arrays_stay_eager():
    assert compression._fused("compress_rows", torch.zeros(2, 8)) is None
