"""MinMaxUInt8 against the numpy reference, and its robustness on extreme inputs."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from bagua_x import testing
from bagua_x.algorithms.compression import HEADER_BYTES, compress_rows, decompress_rows, quantize_roundtrip, unpack_rows


def assert_within_one_step(x, y):
    """One step (max - min)/255, plus float32 rounding of values as large as x's."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    big = max(1.0, float(np.abs(x64).max()))
    step = (x64.max() - x64.min()) / 255 + 1e-7 * big
    assert np.all(np.abs(y64 - x64) <= step * 1.01 + 1e-6 * big)


def test_matches_bagua_formula_on_ordinary_gradients():
    x = np.random.default_rng(0).standard_normal((4, 1000)).astype(np.float32) * 0.1
    packed = compress_rows(x)
    assert packed.dtype == np.uint8 and packed.shape == (4, 1000 + HEADER_BYTES)
    q, mm = unpack_rows(packed)
    for row, prow, qrow, mmrow in zip(x, packed, q, mm):
        rq, mn, mx = testing.reference.quantize(row)
        assert mmrow[0] == mn and mmrow[1] == mx
        assert np.array_equal(prow[-HEADER_BYTES:].view(np.float32), [mn, mx])  # the header: min, max as float32
        np.testing.assert_array_equal(qrow, rq)  # the codes are Bagua's exactly
        # seen: 0 (a quantisation step here is 2.7e-3)
        np.testing.assert_allclose(decompress_rows(prow[None])[0], testing.reference.dequantize(rq, mn, mx),
                                   rtol=0, atol=1e-8)


def test_is_really_quantized():
    x = np.linspace(-1, 1, 10_000, dtype=np.float32)
    y = quantize_roundtrip(x)
    assert y.shape == x.shape and y.dtype == np.float32
    assert len(np.unique(y)) == 256  # evenly spread values use every level
    x2 = x.reshape(100, 100)
    assert quantize_roundtrip(x2).shape == (100, 100)


@pytest.mark.parametrize("x", [
    np.zeros(16, np.float32),
    np.full(16, 3.5, np.float32),
    np.full(16, 1e30, np.float32),
    np.array([1e38, -1e38, 0.0, 1.0], np.float32),
    np.array([1e-40, -1e-41, 0.0, 1e-45], np.float32),
    np.array([np.finfo(np.float32).max, np.finfo(np.float32).min], np.float32),
])
def test_extreme_inputs_stay_finite_and_within_a_step(x):
    y = quantize_roundtrip(x)
    assert np.all(np.isfinite(y))
    assert_within_one_step(x, y)


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 300),
                  elements=st.floats(-1.0000000150474662e+30, 1.0000000150474662e+30, allow_nan=False, allow_infinity=False, width=32)))
def test_round_trip_error_is_within_one_step(x):
    y = quantize_roundtrip(x)
    assert np.all(np.isfinite(y))
    assert_within_one_step(x, y)


@pytest.mark.parametrize("shape", [(3, 257), (1, 145)])  # odd widths: the header bytes sit unaligned
def test_torch_and_jax_give_the_numpy_result(shape):
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    pn, pt, pj = compress_rows(x), compress_rows(torch.from_numpy(x)), compress_rows(jnp.asarray(x))
    assert np.array_equal(pn, pt.numpy()) and np.array_equal(pn, np.asarray(pj))  # the same bytes, header included
    assert np.allclose(decompress_rows(pn), decompress_rows(pt).numpy(), rtol=0, atol=1e-6)
    assert np.allclose(decompress_rows(pn), np.asarray(decompress_rows(pj)), rtol=0, atol=1e-6)


def test_decompress_into_writes_the_result_over_out():
    x = np.random.default_rng(2).standard_normal((2, 100)).astype(np.float32)
    packed, out = compress_rows(x), np.zeros((2, 100), np.float32)
    assert decompress_rows(packed, out=out) is out
    assert np.array_equal(out, decompress_rows(packed))
