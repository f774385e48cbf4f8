"""GradientAllReduce on N simulated ranks against the numpy reference."""

import numpy as np
import pytest

from bagua_x import testing
from bagua_x.algorithms import EmptyState, GradientAllReduce, Phase, Target
from bagua_x.algorithms.base import ring_allreduce_bytes
from bagua_x.testing import flat_layout, run

SIZES = [2, 3, 4, 8]
STEPS = 3


def grads(n, step, numel=1000):
    rng = np.random.default_rng(100 * n + step)
    return [rng.standard_normal(numel).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("average", [True, False])
def test_matches_reference_over_steps(n, average):
    alg = GradientAllReduce(average=average)
    assert alg.hierarchical is False  # flat by default

    def job(c):
        state = alg.init(grads(n, 0)[c.rank], flat_layout(grads(n, 0)[c.rank]), n)
        outs = []
        for t in range(STEPS):
            flat, state = alg.reduce(grads(n, t)[c.rank].copy(), flat_layout(grads(n, t)[c.rank].copy()), state, c)
            outs.append(flat)
        return outs, state

    out, comms = run(n, job)
    assert len(out) == n
    for t in range(STEPS):
        want = testing.reference.allreduce(grads(n, t), average)
        for r in range(n):
            got = out[r][0][t]
            assert got.shape == want[r].shape and got.dtype == np.float32
            # float32 rank-order sum vs the correctly rounded float64 reference: seen at most one float32
            # ulp of the largest result (9.5e-7 on sums in [8, 16) for N = 8, average=False; 0 for N = 2)
            assert np.abs(got - want[r]).max() <= np.spacing(np.abs(want[r]).max())
            assert np.array_equal(got, out[0][0][t])  # every rank holds the same result
    for (_, state), c in zip(out, comms):
        assert state == EmptyState()
        assert c.ops() == ["allreduce"] * STEPS
        assert c.bytes_sent() == pytest.approx(STEPS * alg.wire_bytes(flat_layout(1000), 4, n))


@pytest.mark.parametrize("average, mean", [(True, True), (False, False)])
def test_average_flag_selects_mean_or_sum(average, mean):
    out, _ = run(4, lambda c: GradientAllReduce(average=average).reduce(np.full(3, c.rank + 1.0, np.float32), flat_layout(np.full(3, c.rank + 1.0, np.float32)), EmptyState(), c)[0])
    assert all(np.array_equal(o, np.full(3, 2.5 if mean else 10.0)) for o in out)  # 1+2+3+4 = 10, exact


def test_hierarchical_without_support_is_one_flat_allreduce():
    out, comms = run(2, lambda c: GradientAllReduce(hierarchical=True).reduce(np.ones(4, np.float32) * c.rank, flat_layout(np.ones(4, np.float32) * c.rank), EmptyState(), c)[0])
    assert all(c.ops() == ["allreduce"] for c in comms)
    assert all(np.array_equal(o, np.full(4, 0.5)) for o in out)


def test_declarations():
    alg = GradientAllReduce()
    assert (alg.target, alg.phase, alg.donates_input, alg.alignment(8)) == (Target.GRAD, Phase.AFTER_BACKWARD, True, 1)
    assert alg.init(np.zeros(3, np.float32), flat_layout(np.zeros(3, np.float32)), 4) == EmptyState()
    assert alg.wire_bytes(flat_layout(1000), 4, 4) == ring_allreduce_bytes(1000, 4, 4) == 2 * 3 / 4 * 4000
    assert alg.hyperparameters() == {"algorithm": "GradientAllReduce", "average": True, "hierarchical": False}
