"""The Triton kernels of ``bagua_x.torch.cuda_compression``, run by Triton's interpreter on the CPU: the packed
bytes and the decompressed values must equal ``compression.py`` run on numpy, bit for bit.

The interpreter executes the kernels' own code with numpy (same operations, same rounding), so this checks
their indexing, masking, header bytes and formulas without a GPU; the GPU check (check 7) runs them
compiled.  Triton is in the test extra (Linux x86-64, where its wheels are), so `make test` runs it; skipped
where Triton is not installed.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

WORKER = textwrap.dedent("""
    import numpy as np, torch
    from bagua_x.algorithms import compression as C
    from bagua_x.torch import cuda_compression as T

    def case(x):
        packed = T.compress_rows(x)
        want = C.compress_rows(x.float().numpy())
        assert np.array_equal(packed.numpy(), want), (tuple(x.shape), "bytes")
        values = T.decompress_rows(packed)
        assert np.array_equal(values.numpy(), C.decompress_rows(want)), (tuple(x.shape), "values")
        out = torch.full(x.shape, float("nan"))
        assert T.decompress_rows(packed, out=out) is out and torch.equal(out, values)

    g = torch.Generator().manual_seed(0)
    for rows, k in [(1, 5), (1, 4096), (1, 4097), (3, 10000), (8, 8193)]:  # one block, exact, ragged, several
        case(torch.randn(rows, k, generator=g))
        case(torch.randn(rows, k, generator=g) * 1e-30)
        case(torch.randn(rows, k, generator=g) * 1e30)
        case(torch.full((rows, k), -1e30))  # a constant row: the guard on eps
        case(torch.rand(rows, k, generator=g) + 1)  # all above 0 and all below: a block's padding is no value
        case(-torch.rand(rows, k, generator=g) - 1)
        case(torch.randn(rows, k, generator=g).to(torch.bfloat16))
    extreme = torch.randn(2, 5000, generator=g)
    extreme[0, 7], extreme[1, 9] = 3.4e38, -3.4e38  # the range from quarters cannot overflow
    case(extreme)
    half = torch.arange(-8.0, 8.0).reshape(1, -1) * 127.5 / 8  # values at .5 steps: round half to even
    case(half)

    def owner_step(x):  # ByteGrad's owner step on the rows received: dequantise, sum in rank order, requantise
        packed = C.compress_rows(x.float().numpy())
        for average in (True, False):
            want = C.reduce_requantize(packed, average)
            got = T.reduce_requantize(torch.from_numpy(packed), average)
            assert np.array_equal(got.numpy(), want), (tuple(x.shape), average)

    for rows, k in [(1, 5), (2, 4096), (3, 10000), (8, 8193)]:
        owner_step(torch.randn(rows, k, generator=g))
        owner_step(torch.randn(rows, k, generator=g) * 1e30)  # large sums (an overflow to inf is garbage anyway)
        owner_step(torch.randn(rows, k, generator=g) * 10.0 ** torch.arange(rows).reshape(-1, 1))  # scales apart
        owner_step(torch.zeros(rows, k))
    print("ok")
""")


def test_triton_kernels_equal_compression_on_numpy_bit_for_bit():
    """compress_rows, decompress_rows and ByteGrad's owner step (reduce_requantize)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_launches_go_to_the_tensors_device():
    """Triton launches on the thread's current CUDA device: each launch is wrapped in the tensor's."""
    import torch

    from bagua_x.torch import cuda_compression as T

    on = T._on(torch.device("cuda", 1))
    assert isinstance(on, torch.cuda.device) and on.idx == 1
