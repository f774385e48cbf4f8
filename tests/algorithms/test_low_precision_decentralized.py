"""LowPrecisionDecentralized on a ring of N simulated ranks against the numpy reference, state included."""

import numpy as np
import pytest

import reference as ref
from bagua_x import testing
from bagua_x.algorithms import LowPrecisionDecentralized, Phase, Target
from bagua_x.core import BaguaXError
from bagua_x.testing import flat_layout, run

SIZES = [2, 3, 4, 8]
NUMEL = 2000
STEPS = 6


def start(n):
    rng = np.random.default_rng(30 * n)
    return [(rng.standard_normal(NUMEL) * 0.1).astype(np.float32) for _ in range(n)]


def noise(n, step):
    """Each rank's optimizer step between exchanges (small, like lr * grad)."""
    rng = np.random.default_rng(30 * n + step + 1)
    return [(rng.standard_normal(NUMEL) * 0.01).astype(np.float32) for _ in range(n)]


def simulate(alg, n):
    def fn(c):
        x = start(n)[c.rank]
        state = alg.init(x, flat_layout(x), n)
        assert int(state.step) == 0
        for copy in (state.w, state.left, state.right):  # copies of x, not x itself
            assert np.array_equal(copy, x) and copy is not x and copy.dtype == np.float32
        history = []
        for t in range(STEPS):
            x, state = alg.reduce(x + noise(n, t)[c.rank], flat_layout(x + noise(n, t)[c.rank]), state, c)
            history.append((x, type(state)(*map(np.copy, state))))
        return history
    return run(n, fn)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("interval", [1, 2])
def test_matches_reference_over_steps(n, interval):
    alg = LowPrecisionDecentralized(communication_interval=interval)
    out, comms = simulate(alg, n)
    xs = start(n)
    states = ref.low_precision_init(xs)
    assert len(out) == n
    for t in range(STEPS):
        xs, states = ref.low_precision_decentralized([x + e for x, e in zip(xs, noise(n, t))], states, t, interval)
        for r in range(n):
            x, state = out[r][t]
            assert x.shape == (NUMEL,) and x.dtype == np.float32
            assert int(state.step) == t + 1
            # the same float32 difference, codes and dequantisation: seen 0 (bitwise equal) after 6 steps for
            # every N and interval; 1e-8 is below one ulp (1.5e-8) at these magnitudes. A flipped code: ~1e-4
            assert np.abs(x - xs[r]).max() <= 1e-8
            for key in ("w", "left", "right"):
                assert np.abs(getattr(state, key) - states[r][key]).max() <= 1e-8, key  # seen 0
            if t % interval == 0:
                assert np.array_equal(state.w, x)  # w <- x after an exchange
            else:  # no exchange: x is the optimizer's, the state is kept
                assert np.array_equal(x, xs[r]) and np.array_equal(state.w, out[r][t - 1][1].w)
    exchanges = len(range(0, STEPS, interval))
    neighbours = 1 if n == 2 else 2  # a ring of two: the one neighbour's message once
    for r, c in enumerate(comms):
        assert c.ops() == ["permute"] * neighbours * exchanges
        # uint8: NUMEL codes then min and max (float32), to the right neighbour, then to the left one
        for s in c.sent:
            assert s.dtype == np.uint8 and s.shape == (1, NUMEL + 8)
        assert c.bytes_sent() == pytest.approx(exchanges * interval * alg.wire_bytes(flat_layout(NUMEL), 4, n))
        assert c.bytes_sent() == pytest.approx(exchanges * neighbours * (NUMEL + 8))


@pytest.mark.parametrize("n", [3, 4])
def test_sends_the_quantised_difference_to_both_neighbours(n):
    out, comms = simulate(LowPrecisionDecentralized(), n)
    xs, states = start(n), ref.low_precision_init(start(n))
    x0 = [x + e for x, e in zip(xs, noise(n, 0))]
    for r, c in enumerate(comms):
        d = x0[r] + states[r]["left"] / 3 + states[r]["right"] / 3 - 5 * states[r]["w"] / 3
        q, mn, mx = testing.reference.quantize(d)
        first = c.sent[0].data[0]
        assert np.array_equal(first[:NUMEL], q)  # the codes exactly
        assert np.array_equal(first[NUMEL:].view(np.float32), [mn, mx])
        assert len(np.unique(first[:NUMEL])) <= 256 and first[:NUMEL].max() == 255
        assert np.array_equal(c.sent[1].data, c.sent[0].data)  # the same bytes to the other side
    # rank r's R estimate moved by what its right neighbour sent, L by its left neighbour's
    for r in range(n):
        state = out[r][0][1]
        right_sent, left_sent = comms[(r + 1) % n].sent[0].data[0], comms[(r - 1) % n].sent[0].data[0]
        for key, sent in (("right", right_sent), ("left", left_sent)):
            step = getattr(state, key) - xs[r]
            want = testing.reference.dequantize(sent[:NUMEL], *sent[NUMEL:].view(np.float32))
            assert np.abs(step - want).max() <= 2e-8  # seen <= 1.49e-8: float32 rounding of (L + deQ) - x


def test_refuses_bad_interval_and_declarations():
    with pytest.raises(BaguaXError, match="communication_interval must be >= 1, got 0"):
        LowPrecisionDecentralized(communication_interval=0)
    alg = LowPrecisionDecentralized()
    assert alg.communication_interval == 1
    assert (alg.target, alg.phase, alg.donates_input) == (Target.WEIGHT, Phase.AFTER_STEP, False)
    assert alg.wire_bytes(flat_layout(1000), 4, 4) == 2 * 1008
    assert LowPrecisionDecentralized(4).wire_bytes(flat_layout(1000), 4, 4) == 2 * 1008 / 4
    assert alg.wire_bytes(flat_layout(1000), 4, 2) == 1008  # two ranks: one neighbour


def test_float64_weights_keep_their_dtype():
    xs = [x.astype(np.float64) for x in start(2)]
    alg = LowPrecisionDecentralized()
    out, _ = run(2, lambda c: alg.reduce(xs[c.rank], flat_layout(xs[c.rank]), alg.init(xs[c.rank], flat_layout(xs[c.rank]), 2), c))
    for x, state in out:
        assert x.dtype == np.float64 and state.w.dtype == np.float32
