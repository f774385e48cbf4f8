"""ByteGrad on N simulated ranks against the numpy reference, and what it really sends."""

import numpy as np
import pytest

import reference as ref
from bagua_x import testing
from bagua_x.algorithms import ByteGrad, EmptyState, Phase, Target
from bagua_x.algorithms.base import compressed_bytes
from bagua_x.algorithms.bytegrad import compressed_allreduce
from bagua_x.testing import flat_layout, run

SIZES = [2, 3, 4, 8]
STEPS = 3
CHUNK = 1000  # elements per rank's chunk: thousands of elements per bucket


def grads(n, step, scale=0.05):
    """Gradient-like values: |sum over 8 ranks| < 1, where MinMaxUInt8 is Bagua's formula exactly."""
    rng = np.random.default_rng(1000 * n + step)
    return [(rng.standard_normal(n * CHUNK) * scale).astype(np.float32) for _ in range(n)]


def job(alg, n, steps=STEPS, scale=0.05):
    def fn(c):
        state = alg.init(grads(n, 0, scale)[c.rank], flat_layout(grads(n, 0, scale)[c.rank]), n)
        outs = []
        for t in range(steps):
            flat = grads(n, t, scale)[c.rank].copy()
            result, state = alg.reduce(flat, flat_layout(flat), state, c)
            assert result is flat  # numpy is writable: the result is written over the bucket (donates_input)
            outs.append(result)
        return outs, state
    return fn


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("average", [True, False])
def test_matches_reference_over_steps(n, average):
    alg = ByteGrad(average=average)
    out, comms = run(n, job(alg, n))
    assert len(out) == n
    for t in range(STEPS):
        want = ref.bytegrad(grads(n, t), average)
        for r in range(n):
            got = out[r][0][t]
            assert got.shape == want[r].shape == (n * CHUNK,) and got.dtype == np.float32
            # the same codes and the same float32 arithmetic: seen 0 (bitwise equal) for every N and step;
            # 1e-7 allows one ulp at these magnitudes (< 1). A flipped code would be a step, ~1e-3 here
            assert np.abs(got - want[r]).max() <= 1e-7
            assert np.array_equal(got, out[0][0][t])  # all ranks bitwise identical, own chunk included
    for (_, state), c in zip(out, comms):
        assert state == EmptyState()
        assert c.ops() == ["alltoall", "allgather"] * STEPS


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("average", [True, False])
def test_wire_is_uint8_codes_of_the_reference(n, average):
    xs = grads(n, 0)
    out, comms = run(n, lambda c: ByteGrad(average=average).reduce(xs[c.rank].copy(), flat_layout(xs[c.rank].copy()), EmptyState(), c)[0])
    own = []  # the chunk each rank reduced, as the reference computes it before re-quantising
    for r in range(n):
        s = np.sum([testing.reference.roundtrip(np.split(x, n)[r]) for x in xs], axis=0, dtype=np.float32)
        own.append(s / np.float32(n) if average else s)
    for r, c in enumerate(comms):
        a2a, gather = c.sent
        # alltoall: one row per destination, CHUNK codes then min and max as float32
        assert a2a.dtype == np.uint8 and a2a.shape == (n, CHUNK + 8)
        for j, chunk in enumerate(np.split(xs[r], n)):
            q, mn, mx = testing.reference.quantize(chunk)
            assert np.array_equal(a2a.data[j, :CHUNK], q)  # the same codes exactly
            assert np.array_equal(a2a.data[j, CHUNK:].view(np.float32), [mn, mx])
            # the levels are really used: the top code for the max, and > 150 of 256 levels on 1000
            # normal values (seen 176..192: the tails are sparse)
            assert a2a.data[j, :CHUNK].max() == 255 and len(np.unique(a2a.data[j, :CHUNK])) > 150
        # allgather: this rank's reduced chunk, re-quantised with its own fresh min/max
        assert gather.dtype == np.uint8 and gather.shape == (CHUNK + 8,)
        q, mn, mx = testing.reference.quantize(own[r])
        assert np.array_equal(gather.data[:CHUNK], q)
        assert np.array_equal(gather.data[CHUNK:].view(np.float32), [mn, mx])
        assert c.bytes_sent() == pytest.approx(ByteGrad().wire_bytes(flat_layout(n * CHUNK), 4, n))
        assert c.bytes_sent() == pytest.approx(2 * (n - 1) * (CHUNK + 8))  # vs 8 (n-1) CHUNK for float32
    for r, chunk in enumerate(np.split(out[0], n)):
        assert len(np.unique(chunk)) <= 256  # the result is quantised: one of 256 levels per chunk
        assert np.abs(chunk - own[r]).max() <= testing.reference.step_size(own[r]) / 2 * 1.001  # rint: half a step


@pytest.mark.parametrize("n", [2, 8])
def test_large_magnitudes_within_a_step_of_reference(n):
    """Above magnitude 1, eps is relative to the largest value (a documented deviation from Bagua),
    so the scale differs from the reference's in its last bits and a code could differ by one."""
    alg = ByteGrad(average=False)
    out, _ = run(n, job(alg, n, steps=1, scale=1.0))
    want = ref.bytegrad(grads(n, 0, 1.0), average=False)[0]
    for r, chunk in enumerate(np.split(want, n)):
        got = np.split(out[0][0][0], n)[r]
        # seen <= 2.9e-6 here (no code flipped for these seeds; with other seeds a code does, one step:
        # 0.064 on sums of 8 N(0,1)); one step is ~0.07 here
        assert np.abs(got - chunk).max() <= 4e-6


def test_compressed_allreduce_without_out_returns_a_new_array():
    xs = grads(2, 0)
    out, _ = run(2, lambda c: (compressed_allreduce(xs[c.rank], c), xs[c.rank]))
    want = ref.bytegrad(xs)[0]
    for (result, x), orig in zip(out, xs):
        assert result is not x and np.array_equal(x, orig)
        assert result.dtype == np.float32 and result.shape == x.shape
        assert np.abs(result - want).max() <= 1e-7  # as above: seen 0


def test_float64_bucket_keeps_its_dtype():
    xs = [x.astype(np.float64) for x in grads(2, 0)]
    out, _ = run(2, lambda c: compressed_allreduce(xs[c.rank], c))
    assert out[0].dtype == np.float64 and out[0].shape == xs[0].shape


def test_declarations():
    alg = ByteGrad()
    assert (alg.target, alg.phase, alg.donates_input) == (Target.GRAD, Phase.AFTER_BACKWARD, True)
    assert [alg.alignment(n) for n in SIZES] == SIZES
    assert alg.init(np.zeros(4, np.float32), flat_layout(np.zeros(4, np.float32)), 4) == EmptyState()
    assert alg.wire_bytes(flat_layout(4000), 4, 4) == compressed_bytes(4000, 4) == 2 * 3 * (1000 + 8)


def test_read_only_bucket_gets_a_new_array():
    """Where the input cannot be written (JAX; here a read-only numpy array) the result is a new array."""
    xs = grads(2, 0)
    def fn(c):
        flat = xs[c.rank].copy()
        flat.flags.writeable = False
        return ByteGrad().reduce(flat, flat_layout(flat), EmptyState(), c)[0], flat
    out, _ = run(2, fn)
    for result, flat in out:
        assert result is not flat and np.abs(result - ref.bytegrad(xs)[0]).max() <= 1e-7  # seen 0
