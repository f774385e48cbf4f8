"""The compiled MinMaxUInt8 kernels give the plain kernels' results bit for bit; where torch.compile does not
work, every rank runs them eager instead of failing."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from bagua_x.algorithms import compression
from bagua_x.algorithms.compression import dequantize, quantize, sum_requantize
from bagua_x.algorithms.kernels import _COMPILERS
from bagua_x.torch import kernels
from bagua_x.torch.kernels import MIN_NUMEL

ENV = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}


@pytest.fixture(autouse=True, scope="module")
def installed():
    """What wrap() does where every rank can compile."""
    kernels.install()


def test_importing_bagua_x_torch_installs_no_compiler():
    code = ("import bagua_x.torch; from bagua_x.algorithms.kernels import _COMPILERS; "
            "print(sorted(_COMPILERS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


@pytest.mark.parametrize("rows", [1, 2])  # one row: the header's bytes sit at an odd offset of the buffer
def test_fused_kernels_are_registered_and_bitwise_equal(rows):
    assert kernels.NAMESPACE in _COMPILERS
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


def test_ranks_agree_to_run_eager_when_one_cannot_compile():
    """rank 1 has no working C++ compiler: at wrap both ranks find out and stay eager (one warning each), and the
    first large bucket -- which used to compile on the communication thread and kill training -- reduces."""
    from launch import run_workers

    out = run_workers("bx_torch_workers:kernels_agree", 2, args=(1,), timeout=240, env=ENV)
    assert len(out) == 2
    assert [r["compiling"] for r in out] == [False, False]
    assert "InvalidCxxCompiler" in out[1]["failure"] and out[0]["failure"] == "torch.compile failed on another rank"
    for r in out:
        assert len(r["warnings"]) == 1 and "compression kernels run eager" in r["warnings"][0], r["warnings"]
    assert np.array_equal(out[0]["grad"], out[1]["grad"])  # ByteGrad leaves every rank with the same bytes


def test_ranks_keep_compiled_kernels_when_all_can_compile():
    from launch import run_workers

    out = run_workers("bx_torch_workers:kernels_agree", 2, args=(-1,), timeout=240, env=ENV)
    assert [(r["compiling"], r["failure"], r["warnings"]) for r in out] == [(True, None, [])] * 2
    assert np.array_equal(out[0]["grad"], out[1]["grad"])


def test_a_compile_that_fails_later_falls_back_to_eager(monkeypatch):
    from bagua_x.algorithms.kernels import _COMPILERS, kernel

    @kernel
    def affine(x):  # a kernel of its own: none compiled before
        return x * 2.5 + 1.0

    def broken(fn, **kw):
        def run(*args):
            raise RuntimeError("no compiler here")
        return run

    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.setitem(_COMPILERS, kernels.NAMESPACE, (kernels._compiled, MIN_NUMEL))
    monkeypatch.setattr(torch, "compile", broken)
    x = torch.randn(2, MIN_NUMEL)
    with pytest.warns(RuntimeWarning, match="compiling affine failed .*no compiler here.*run eager"):
        y = affine(x)
    assert torch.equal(y, affine.plain(x))
    assert kernels.NAMESPACE not in _COMPILERS
    monkeypatch.setitem(_COMPILERS, kernels.NAMESPACE, (kernels._compiled, MIN_NUMEL))  # restored on teardown
