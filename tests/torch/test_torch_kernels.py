"""The compiled MinMaxUInt8 kernels give the plain kernels' results bit for bit."""

import pytest
import torch

import bagua_x.torch  # noqa: F401  (installs the kernels)
from bagua_x.algorithms import compression
from bagua_x.algorithms.compression import dequantize, quantize, sum_requantize
from bagua_x.torch.kernels import MIN_NUMEL


@pytest.mark.parametrize("rows", [1, 2])  # one row: the header's bytes sit at an odd offset of the buffer
def test_fused_kernels_are_registered_and_bitwise_equal(rows):
    x = torch.randn(rows, MIN_NUMEL // rows + 3)
    q, mm = quantize(x)
    q0, mm0 = quantize.plain(x)
    assert torch.equal(q, q0) and torch.equal(mm, mm0)
    packed = compression.compress_rows(x)
    assert torch.equal(packed, compression.pack_rows(q0, mm0))
    assert torch.equal(compression.decompress_rows(packed), dequantize.plain(q0, mm0))
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(x.shape, dtype=dtype)
        assert compression.decompress_rows(packed, out=out) is out
        assert torch.equal(out, dequantize.plain(q0, mm0).to(dtype))
    assert torch.equal(compression.reduce_requantize(packed, True),
                       compression.pack_rows(*sum_requantize.plain(q0, mm0, True)))


def test_kernels_compile_for_large_arrays_only():
    import torch._dynamo

    torch._dynamo.reset()
    counter = torch._dynamo.utils.counters
    counter.clear()
    quantize(torch.zeros(2, 8))
    assert not counter["stats"]["unique_graphs"]
    quantize(torch.zeros(2, MIN_NUMEL))
    assert counter["stats"]["unique_graphs"] == 1
