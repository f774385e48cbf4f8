"""QAdam's step on N simulated ranks against the numpy reference: warmup, then 8-bit momentum."""

import numpy as np
import pytest

import reference as ref
from bagua_x.algorithms import Phase, QAdam, Target
from bagua_x.algorithms.base import compressed_bytes
from bagua_x.algorithms.qadam import adam_direction
from bagua_x.core import BaguaXError
from bagua_x.testing import flat_layout, run

SIZES = [2, 3, 4, 8]
NUMEL = 840  # a multiple of every N (2, 3, 4, 8): the bucket is aligned to the world size
STEPS = 6


def start():
    return (np.random.default_rng(0).standard_normal(NUMEL) * 0.5).astype(np.float32)


def grads(n):
    """Per-rank gradients whose average stays away from 0 (|g| in [0.05, 0.15], one sign per element):
    after warmup v is frozen, and a v near 0 would amplify any last-bit difference of m a thousandfold."""
    rng = np.random.default_rng(40 * n)
    sign = np.where(rng.random(NUMEL) < 0.5, -1, 1).astype(np.float32)
    return [[(sign * rng.uniform(0.05, 0.15, NUMEL)).astype(np.float32) for _ in range(n)] for _ in range(STEPS)]


def simulate(alg, n):
    gs = grads(n)

    def fn(c):
        p = start()
        state = alg.init(p, flat_layout(p), n)
        history = []
        for t in range(STEPS):
            update, state = alg.step(gs[t][c.rank], p, flat_layout(gs[t][c.rank]), state, c)
            p = p + update
            history.append((p, type(state)(*map(np.copy, state))))
        return history
    return run(n, fn)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("warmup_steps, weight_decay", [(1, 0.0), (2, 0.0), (3, 0.01), (100, 0.01)])
def test_matches_reference_over_steps(n, warmup_steps, weight_decay):
    alg = QAdam(lr=0.01, warmup_steps=warmup_steps, weight_decay=weight_decay)
    out, comms = simulate(alg, n)
    want = ref.qadam(start(), grads(n), lr=0.01, warmup_steps=warmup_steps, weight_decay=weight_decay)
    assert len(out) == n and len(want) == STEPS
    for t in range(STEPS):
        for r in range(n):
            p, state = out[r][t]
            assert p.shape == (NUMEL,) and p.dtype == np.float32
            # float32 Adam vs the float64 reference, growing with the steps: seen <= 1.37e-6 at step 6
            # (N = 2, warmup 1); the same codes (a flipped one would move p by ~1e-3 here)
            assert np.abs(p - want[t]).max() <= 1.5e-6
            assert np.array_equal(p, out[0][t][0])  # every rank takes the same step
            assert int(state.step) == t + 1
            if t + 1 > warmup_steps:  # m is the 8-bit averaged momentum: at most 256 levels per chunk
                assert all(len(np.unique(chunk)) <= 256 for chunk in np.split(state.m, n))
                if t > 0:  # v frozen after warmup
                    assert np.array_equal(state.v, out[r][t - 1][1].v)
            else:
                assert len(np.unique(state.m)) > 256  # full precision during warmup
    for c in comms:
        warm = min(warmup_steps, STEPS)
        assert c.ops() == ["allreduce"] * warm + ["alltoall", "allgather"] * (STEPS - warm)
        assert all(s.dtype == np.float32 for s in c.sent[:warm])
        assert all(s.dtype == np.uint8 for s in c.sent[warm:])
        compressed = sum(s.nbytes for s in c.sent[warm:])
        assert compressed == pytest.approx((STEPS - warm) * alg.wire_bytes(flat_layout(NUMEL), 4, n))
        assert compressed == pytest.approx((STEPS - warm) * compressed_bytes(NUMEL, n))


def test_reduce_is_the_momentum_exchange_and_declarations():
    """QAdam.reduce (torch's path: the optimizer keeps the moments) averages a momentum bucket as ByteGrad does."""
    alg = QAdam()
    xs = [np.random.default_rng(r).standard_normal(400).astype(np.float32) for r in range(4)]
    out, comms = run(4, lambda c: alg.reduce(xs[c.rank].copy(), flat_layout(400), {"kept": 1}, c))
    assert len(out) == 4
    for o in out:
        assert o[1] == {"kept": 1}  # no state of its own on this path
        np.testing.assert_array_equal(o[0], out[0][0])
        # seen: 3.6e-7 (float32 rounding of the dequantisation); a quantisation step here is ~0.03
        np.testing.assert_allclose(o[0], ref.bytegrad(xs, True)[0], rtol=0, atol=5e-7)
    assert comms[0].ops() == ["alltoall", "allgather"]
    assert (alg.lr, alg.warmup_steps, alg.betas, alg.eps, alg.weight_decay) == (1e-3, 100, (0.9, 0.999), 1e-8, 0.0)
    assert (alg.target, alg.phase, alg.donates_input) == (Target.MOMENTUM, Phase.AFTER_BACKWARD, False)
    assert alg.alignment(8) == 8 and alg.wire_bytes(flat_layout(800), 4, 4) == compressed_bytes(800, 4)
    assert alg.is_warmup(100) and not alg.is_warmup(101)
    state = alg.init(np.ones(8, np.float32), flat_layout(np.ones(8, np.float32)), 4)
    assert int(state.step) == 0 and np.array_equal(state.m, np.zeros(8)) and np.array_equal(state.v, np.zeros(8))


def test_adam_direction_formula():
    m, v = np.array([0.1, -0.2], np.float32), np.array([0.04, 0.01], np.float32)
    got = adam_direction(m, v, 3, lr=0.5, beta1=0.9, beta2=0.99, eps=1e-3)
    want = -0.5 / (1 - 0.9**3) * m.astype(np.float64) / (np.sqrt(v.astype(np.float64)) / np.sqrt(1 - 0.99**3) + 1e-3)
    assert got.dtype == np.float32 and got.shape == (2,)
    assert np.abs(got - want).max() <= 1e-7  # float32 arrays, float64 bias corrections: seen 7.7e-8
    t = np.asarray(3, np.int32)  # the state's counter: bias corrections computed in float32
    assert np.abs(adam_direction(m, v, t, 0.5, 0.9, 0.99, 1e-3) - want).max() <= 2.5e-7  # seen 2.2e-7


def test_adam_direction_with_a_traced_step():
    """Under jit the step counter is a tracer: the bias corrections must stay array operations."""
    jax = pytest.importorskip("jax")
    m, v = np.array([0.1, -0.2], np.float32), np.array([0.04, 0.01], np.float32)
    got = jax.jit(lambda t: adam_direction(m, v, t, 0.5, 0.9, 0.99, 1e-3))(np.int32(3))
    want = adam_direction(m, v, np.asarray(3, np.int32), 0.5, 0.9, 0.99, 1e-3)
    assert np.abs(np.asarray(got) - want).max() <= 1e-7  # XLA vs numpy float32: seen 0


@pytest.mark.parametrize("kwargs", [dict(lr=-1e-3), dict(betas=(1.0, 0.999)), dict(betas=(0.9, 1.0)),
                                    dict(betas=(-0.1, 0.999)), dict(betas=(0.9, -0.1))])
def test_refuses_bad_lr_and_betas(kwargs):
    with pytest.raises(BaguaXError, match=r"^QAdam: need lr >= 0, .*betas in \[0, 1\); got lr="):
        QAdam(**kwargs)


def test_accepts_boundary_lr_and_betas():
    QAdam(lr=0.0, betas=(0.0, 0.0))
    QAdam(betas=(0.999, 0.5))
