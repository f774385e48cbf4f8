"""ModelAverage and AsyncModelAverage's averaging step on N simulated ranks against the numpy reference."""

import numpy as np
import pytest

import reference as ref
from bagua_x import testing
from bagua_x.algorithms import AsyncModelAverage, EmptyState, ModelAverage, Phase, Target
from bagua_x.core import BaguaXError
from bagua_x.testing import flat_layout, run

SIZES = [2, 3, 4, 8]
NUMEL = 500
STEPS = 7


def noise(n, step):
    rng = np.random.default_rng(20 * n + step)
    return [rng.standard_normal(NUMEL).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("period", [1, 2, 3])
def test_matches_reference_over_steps(n, period):
    alg = ModelAverage(period=period)

    def fn(c):
        x = noise(n, -1)[c.rank]
        state = alg.init(x, flat_layout(x), n)
        xs, steps = [], []
        for t in range(STEPS):
            x, state = alg.reduce(x + noise(n, t)[c.rank], flat_layout(x + noise(n, t)[c.rank]), state, c)
            xs.append(x)
            steps.append(state.step)
        return xs, steps

    out, comms = run(n, fn)
    xs, want = noise(n, -1), []
    for t in range(STEPS):
        xs = ref.model_average([x + e for x, e in zip(xs, noise(n, t))], t, period)
        want.append(xs)
    assert len(out) == n
    for r in range(n):
        got, steps = out[r]
        assert len(got) == STEPS
        for t in range(STEPS):
            assert got[t].shape == (NUMEL,) and got[t].dtype == np.float32
            # float32 sum vs the correctly rounded reference, compounded over 7 steps: seen <= 9.6e-7
            # (N = 3, period 1; 0 for N = 2)
            assert np.abs(got[t] - want[t][r]).max() <= 1e-6
        assert [int(s) for s in steps] == list(range(1, STEPS + 1))
    averaged = STEPS // period  # after steps period, 2 period, ...
    for c in comms:
        assert c.ops() == ["allreduce"] * averaged
        assert c.bytes_sent() == pytest.approx(averaged * period * alg.wire_bytes(flat_layout(NUMEL), 4, n))


def test_first_average_after_period_steps():
    def fn(c):
        state = ModelAverage(period=2).init(np.zeros(2, np.float32), flat_layout(np.zeros(2, np.float32)), 2)
        first, state = ModelAverage(period=2).reduce(np.full(2, c.rank, np.float32), flat_layout(np.full(2, c.rank, np.float32)), state, c)
        second, state = ModelAverage(period=2).reduce(np.full(2, c.rank, np.float32), flat_layout(np.full(2, c.rank, np.float32)), state, c)
        return first, second
    out, _ = run(2, fn)
    assert [list(f) for f, _ in out] == [[0, 0], [1, 1]]  # step 1: kept
    assert all(list(s) == [0.5, 0.5] for _, s in out)  # step 2: averaged


@pytest.mark.parametrize("n", SIZES)
def test_async_reduce_is_the_mean(n):
    xs = noise(n, 0)
    out, comms = run(n, lambda c: AsyncModelAverage().reduce(xs[c.rank], flat_layout(xs[c.rank]), EmptyState(), c))
    mean = testing.reference.allreduce(xs)[0]
    for avg, state in out:
        # float32 sum / N vs the correctly rounded mean: seen <= 2.4e-7 (N = 4, 8; 0 for N = 2)
        assert np.abs(avg - mean).max() <= 2.5e-7
        assert state == EmptyState()
    for c in comms:
        assert c.ops() == ["allreduce"]


def test_refuses_bad_period_and_declarations():
    with pytest.raises(BaguaXError, match="period must be >= 1, got 0"):
        ModelAverage(period=0)
    alg = ModelAverage(3)
    assert (alg.target, alg.phase, alg.donates_input) == (Target.WEIGHT, Phase.AFTER_STEP, True)
    assert alg.wire_bytes(flat_layout(1000), 4, 4) == 2 * 3 / 4 * 4000 / 3
    assert ModelAverage().period == 1
    a = AsyncModelAverage()
    assert (a.sync_interval_ms, a.warmup_steps, a.target, a.phase) == (500, 0, Target.WEIGHT, Phase.BACKGROUND)
