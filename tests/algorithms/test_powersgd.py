"""PowerSGD on N simulated ranks against the numpy reference (torch's powerSGD_hook semantics)."""

import numpy as np
import pytest

import reference as ref
from bagua_x.testing import run

from bagua_x.algorithms import EmptyState, PowerSGD, PowerSGDState
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


def train(n, alg, lay, steps=STEPS, inputs=None):
    """Each rank's bucket after each step, the inputs, and each rank's communicator."""
    inputs = inputs or [grads(n, t, lay.padded_numel) for t in range(steps)]
    steps = len(inputs)
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
        assert len(outs) == STEPS and int(state.step) == STEPS
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


@pytest.mark.parametrize("settings", [{}, {"use_error_feedback": False}, {"matrix_approximation_rank": 2},
                                      {"random_seed": 3}])
def test_a_zero_gradient_does_not_switch_a_matrix_off(settings):
    """All-zero gradients at the first compressed step (a parameter unused in that step) give P = 0 and Q = 0;
    the zero Q columns are drawn again, so the next gradients are compressed as usual (torch's hook gives NaN)."""
    n, lay, zero = 2, layout(), 2
    alg = PowerSGD(start_powerSGD_iter=2, **settings)
    inputs = [grads(n, t, lay.numel) for t in range(STEPS + 1)]
    inputs[zero] = [np.zeros(lay.numel, np.float32) for _ in range(n)]
    results, _, _ = train(n, alg, lay, inputs=inputs)
    want = ref.powersgd(inputs, SHAPES, rank=alg.matrix_approximation_rank, start=2,
                        error_feedback=alg.use_error_feedback, seed=alg.random_seed)
    for r, (outs, state) in enumerate(results):
        assert not outs[zero].any()
        assert np.isfinite(state.q).all() and np.isfinite(state.error).all()
        for t in range(len(inputs)):  # seen: up to 3e-6
            np.testing.assert_allclose(outs[t], want[t][r], rtol=0, atol=1e-5, err_msg=f"rank {r} step {t}")
        for t in range(zero + 1, len(inputs)):  # both matrices are compressed again, not zero
            assert np.abs(outs[t][:192]).max() > 0.1 and np.abs(outs[t][204:264]).max() > 0.1, t


def test_a_column_that_adds_nothing_is_drawn_again():
    """Rank 2 and gradients nonzero in the first row only: P's second column is a multiple of its first, so
    Gram-Schmidt makes it exactly zero (not NaN), Q's second column is zero, and it is drawn again next step."""
    n, lay = 2, layout([(16, 12)])
    alg = PowerSGD(start_powerSGD_iter=0, matrix_approximation_rank=2)
    inputs = [grads(n, t, 192) for t in range(3)]
    for x in inputs[0]:
        x[12:] = 0
    results, _, _ = train(n, alg, lay, inputs=inputs)
    want = ref.powersgd(inputs, [(16, 12)], rank=2)
    for r, (outs, state) in enumerate(results):
        assert state.q.shape == (2 * 12,)  # compressed at rank 2
        np.testing.assert_allclose(outs[0], np.mean(inputs[0], axis=0), rtol=0, atol=1e-6)  # rank 1 is exact
        for t in range(3):  # seen: up to 1e-6
            np.testing.assert_allclose(outs[t], want[t][r], rtol=0, atol=1e-5, err_msg=f"rank {r} step {t}")
        # both columns at work: the rank-2 result is no rank-1 matrix
        assert np.linalg.svd(outs[2].reshape(16, 12).astype(np.float64), compute_uv=False)[1] > 0.1


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
    assert alg.init(np.zeros(17, np.float32), lay, 2).q.shape == (0,)
    results, inputs, comms = train(3, alg, lay, steps=2)
    for t in range(2):
        np.testing.assert_allclose(results[0][0][t], np.mean(inputs[t], axis=0), atol=1e-6)
    assert [int(np.prod(s.shape)) for s in comms[0].sent] == [17, 17]  # no factors to exchange
    assert alg.wire_bytes(lay, 4, 3) == pytest.approx(2 * 2 / 3 * 17 * 4)


def test_wire_bytes_at_rank_two():
    # rank 2: the 16 x 12 is compressed (2 (16 + 12) values), the 5 x 12 is not worth it, nor the 3 x 3
    assert PowerSGD(matrix_approximation_rank=2).wire_bytes(layout(), 4, 4) == pytest.approx(
        2 * 3 / 4 * (12 + 60 + 9 + 2 * (16 + 12)) * 4)


@pytest.mark.parametrize("start, zero", [(1, None), (3, 3)], ids=["live", "redrawn"])
def test_state_follows_its_tensors_into_other_buckets(start, zero):
    """Three steps on one bucket (compressed from step 1: Q and error feedback live), the state cut per tensor
    and joined into two other buckets (other order, one padded), two more steps: each tensor's results are
    bitwise those of two more steps on the one bucket (a comm hook under DDP's regrouping, or a resume).
    "redrawn": zero gradients at the first compressed step (step 3) leave Q zero, so step 4 draws every
    matrix's Q again, which must not depend on where the matrix sits in its bucket."""
    n, whole = 2, layout()
    alg = PowerSGD(start_powerSGD_iter=start)
    inputs = [grads(n, t, whole.numel) for t in range(5)]
    if zero is not None:
        inputs[zero] = [np.zeros(whole.numel, np.float32) for _ in range(n)]
    groups = [[3, 0], [2, 1]]  # slots of SHAPES: the 3 x 3 and the 16 x 12; the 5 x 4 x 3 and the bias
    regrouped = [BucketLayout([f"t{i}" for i in g], [SHAPES[i] for i in g], "float32", a)
                 for g, a in zip(groups, [8, 1])]
    assert regrouped[0].padded_numel > regrouped[0].numel

    def rank(c):
        state = alg.init(inputs[0][c.rank], whole, n)
        for t in range(3):
            _, state = alg.reduce(inputs[t][c.rank].copy(), whole, state, c)
        pieces = alg.split_state(state, whole)
        states = [alg.join_state([pieces[i] for i in g], lay) for g, lay in zip(groups, regrouped)]
        went_on, moved = [], []
        for t in range(3, 5):
            out, state = alg.reduce(inputs[t][c.rank].copy(), whole, state, c)
            went_on.append(whole.unpack(np.asarray(out)))
            step = []
            for k, (g, lay) in enumerate(zip(groups, regrouped)):
                x = lay.pack([whole.unpack(inputs[t][c.rank])[i] for i in g])
                out, states[k] = alg.reduce(x, lay, states[k], c)
                step.append(dict(zip(g, lay.unpack(np.asarray(out)))))
            moved.append({**step[0], **step[1]})
        return went_on, moved, states

    for went_on, moved, states in run(n, rank)[0]:
        for t in range(2):
            for i in range(len(SHAPES)):
                np.testing.assert_array_equal(moved[t][i], went_on[t][i], err_msg=f"step {t + 3} tensor {i}")
        assert [int(s.step) for s in states] == [5, 5]
        assert not states[0].error[regrouped[0].numel:].any()  # the padding's error
        assert np.abs(went_on[1][0]).max() > 0.1 and np.abs(went_on[1][2]).max() > 0.1  # both matrices at work


def test_split_and_join_state_round_trip():
    """A zero-size tensor at the offset of a matrix takes no part of Q; the padding's error comes back as zeros."""
    shapes = [(12,), (0, 4), (16, 12), (5, 4, 3)]
    lay = layout(shapes, alignment=8)
    alg = PowerSGD(start_powerSGD_iter=0)
    inputs = [grads(2, t, lay.padded_numel) for t in range(2)]
    states = run(2, lambda c: train_state(alg, lay, inputs, c))[0]
    for state in states:
        pieces = alg.split_state(state, lay)
        assert [p.q.shape for p in pieces] == [(0,), (0,), (12,), (12,)]
        assert [p.error.shape for p in pieces] == [(12,), (0,), (192,), (60,)]
        np.testing.assert_array_equal(pieces[2].q, state.q[:12])
        np.testing.assert_array_equal(pieces[3].error, state.error[204:264])
        joined = alg.join_state(pieces, lay)
        assert isinstance(joined, PowerSGDState) and int(joined.step) == 2
        for k in ("q", "error"):
            np.testing.assert_array_equal(getattr(joined, k), getattr(state, k))


def train_state(alg, lay, inputs, c):
    state = alg.init(inputs[0][c.rank], lay, 2)
    for xs in inputs:
        x = xs[c.rank].copy()
        x[lay.numel:] = 0
        _, state = alg.reduce(x, lay, state, c)
    return state


def test_a_joined_bucket_takes_the_latest_step():
    lay = layout([(12,), (3,)])
    alg = PowerSGD()
    piece = lambda step, n: PowerSGDState(step=np.asarray(step, np.int32), q=np.zeros(0, np.float32),  # noqa: E731
                                          error=np.ones(n, np.float32))
    for steps in ([3, 5], [5, 3]):
        joined = alg.join_state([piece(steps[0], 12), piece(steps[1], 3)], lay)
        assert int(joined.step) == 5 and joined.error.shape == (15,)


def test_stateless_algorithms_split_into_empty_pieces_and_stateful_ones_refuse():
    from bagua_x.algorithms import GradientAllReduce, LowPrecisionDecentralized

    lay = layout([(4,), (2, 2)])
    assert GradientAllReduce().split_state(EmptyState(), lay) == [EmptyState(), EmptyState()]
    assert GradientAllReduce().join_state([EmptyState(), EmptyState()], lay) == EmptyState()
    alg = LowPrecisionDecentralized()
    with pytest.raises(BaguaXError, match=r"LowPrecisionDecentralized keeps per-bucket state \(\['step', 'w', "
                                          r"'left', 'right'\]\) that it cannot split per tensor.*bagua_x.torch.wrap"):
        alg.split_state(alg.init(np.zeros(8, np.float32), lay, 2), lay)
