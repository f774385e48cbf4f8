"""PowerSGD on N simulated ranks against the numpy reference (torch's powerSGD_hook semantics)."""

import numpy as np
import pytest

import reference as ref
from simulated import run

from bagua_x.algorithms import PowerSGD
from bagua_x.core.bucket import BucketLayout
from bagua_x.core.errors import BaguaXError

# compressed at rank 1: (16, 12), (5, 4, 3) as 5 x 12; averaged as they are: the bias, the 3 x 3 (too small to gain)
SHAPES = [(16, 12), (12,), (5, 4, 3), (3, 3)]
STEPS = 5


def layout(shapes=SHAPES, alignment=1):
    return BucketLayout([f"t{i}" for i in range(len(shapes))], shapes, "float32", alignment)


def grads(n, t, numel):
    rng = np.random.default_rng(100 * t + 7)
    return [rng.standard_normal(numel).astype(np.float32) for _ in range(n)]


def train(n, alg, lay, steps=STEPS):
    """Each rank's bucket after each step, the inputs, and each rank's communicator."""
    inputs = [grads(n, t, lay.padded_numel) for t in range(steps)]
    for xs in inputs:  # padding is zero, as in a real bucket
        for x in xs:
            x[lay.numel:] = 0

    def rank(c):
        state = alg.init(inputs[0][c.rank], lay, n)
        outs = []
        for t in range(steps):
            out, state = alg.reduce(inputs[t][c.rank].copy(), lay, state, c)
            outs.append(np.asarray(out))
        return outs, state

    results, comms = run(n, rank)
    return results, inputs, comms


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("settings", [
    {},
    {"matrix_approximation_rank": 2},
    {"start_powerSGD_iter": 2},
    {"use_error_feedback": False},
    {"warm_start": False},
])
def test_matches_the_reference(n, settings):
    kw = {"start_powerSGD_iter": 0, **settings}
    alg = PowerSGD(**kw)
    lay = layout()
    results, inputs, _ = train(n, alg, lay)
    want = ref.powersgd(inputs, SHAPES, rank=alg.matrix_approximation_rank, start=alg.start_powerSGD_iter,
                        error_feedback=alg.use_error_feedback, warm_start=alg.warm_start)
    assert len(results) == n and len(want) == STEPS
    for r, (outs, state) in enumerate(results):
        assert len(outs) == STEPS and int(state["step"]) == STEPS
        for t in range(STEPS):
            # seen: up to 4.5e-6 (float32 against the float64 reference; 8 ranks, 5 steps of error feedback)
            np.testing.assert_allclose(outs[t], want[t][r], rtol=0, atol=1e-5, err_msg=f"rank {r} step {t}")
    # really compressed: the compressed tensors differ from the plain mean, the others equal it
    last = results[0][0][-1]
    mean = np.mean([x.astype(np.float64) for x in inputs[-1]], axis=0)
    if not alg.use_error_feedback:
        np.testing.assert_allclose(last[192:204], mean[192:204], atol=1e-6)  # the bias: averaged
    assert np.abs(last[:192] - mean[:192]).max() > 0.1  # the 16 x 12 matrix: a rank-r approximation


def test_sends_the_low_rank_factors_only():
    n, alg, lay = 4, PowerSGD(start_powerSGD_iter=1), layout()
    _, _, comms = train(n, alg, lay, steps=3)
    plain = 12 + 9  # the bias and the 3 x 3
    factors = (16 + 12) + (5 + 12)  # r (n + m) per compressed matrix, r = 1
    for c in comms:
        sizes = [(s.op, int(np.prod(s.shape))) for s in c.sent]
        # step 1 plain: the whole bucket; then per step: the uncompressed tensors, all Ps, all Qs
        assert sizes == [("allreduce", lay.numel)] + [("allreduce", plain), ("allreduce", 16 + 5),
                                                       ("allreduce", 12 + 12)] * 2, sizes
        assert c.bytes_sent() == pytest.approx(alg.wire_bytes(lay, 4, n) * 2 + 2 * 3 / 4 * lay.numel * 4)
    assert alg.wire_bytes(lay, 4, n) == pytest.approx(2 * 3 / 4 * (plain + factors) * 4)


def test_padding_is_averaged_and_kept_zero():
    lay = layout(alignment=8)
    assert lay.padded_numel > lay.numel
    results, inputs, _ = train(3, PowerSGD(start_powerSGD_iter=0), lay)
    want = ref.powersgd([[x[: lay.numel] for x in xs] for xs in inputs], SHAPES, start=0)
    for r, (outs, _) in enumerate(results):
        for t in range(STEPS):
            np.testing.assert_allclose(outs[t][: lay.numel], want[t][r], atol=1e-5)
            assert not outs[t][lay.numel:].any()


def test_a_zero_gradient_stays_zero():
    lay = layout([(8, 6)])
    alg = PowerSGD(start_powerSGD_iter=0)
    out, _ = run(2, lambda c: alg.reduce(np.zeros(48, np.float32), lay, alg.init(np.zeros(48, np.float32), lay, 2),
                                         c)[0])
    assert all(np.array_equal(o, np.zeros(48)) for o in out)  # torch's hook would give NaN here


def test_refuses_bad_settings():
    for kw in ({"matrix_approximation_rank": 0}, {"start_powerSGD_iter": -1}, {"min_compression_rate": -1}):
        with pytest.raises(BaguaXError, match="PowerSGD"):
            PowerSGD(**kw)


def test_compresses_only_where_torch_does():
    """(4, 4) at rank 1: (4 + 4) * 1 * 2 == 16 is not < 16, so torch leaves it as it is; (5, 4) is compressed."""
    shapes = [(4, 4), (5, 4)]
    lay = layout(shapes)
    results, inputs, comms = train(2, PowerSGD(start_powerSGD_iter=0, use_error_feedback=False), lay, steps=1)
    mean = np.mean([x.astype(np.float64) for x in inputs[0]], axis=0)
    out = results[0][0][0]
    np.testing.assert_allclose(out[:16], mean[:16], atol=1e-6)  # averaged as it is
    assert np.abs(out[16:] - mean[16:]).max() > 0.05  # a rank-1 approximation
    assert [int(np.prod(s.shape)) for s in comms[0].sent] == [16, 5, 4]


def test_a_bucket_of_vectors_is_averaged_as_it_is():
    lay = layout([(12,), (5,)])
    alg = PowerSGD(start_powerSGD_iter=0)
    assert alg.init(np.zeros(17, np.float32), lay, 2)["q"].shape == (0,)
    results, inputs, comms = train(3, alg, lay, steps=2)
    for t in range(2):
        np.testing.assert_allclose(results[0][0][t], np.mean(inputs[t], axis=0), atol=1e-6)
    assert [int(np.prod(s.shape)) for s in comms[0].sent] == [17, 17]  # no factors to exchange
    assert alg.wire_bytes(lay, 4, 3) == pytest.approx(2 * 2 / 3 * 17 * 4)


def test_wire_bytes_at_rank_two():
    # rank 2: the 16 x 12 is compressed (2 (16 + 12) values), the 5 x 12 is not worth it, nor the 3 x 3
    assert PowerSGD(matrix_approximation_rank=2).wire_bytes(layout(), 4, 4) == pytest.approx(
        2 * 3 / 4 * (12 + 60 + 9 + 2 * (16 + 12)) * 4)
