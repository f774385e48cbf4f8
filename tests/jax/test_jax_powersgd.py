"""PowerSGD traced by JAX: per-matrix compression of a bucket of several tensors, against the numpy
reference, and through wrap() (reduce_gradients of a params tree) against per-leaf training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from algorithms import reference as ref
from bagua_x.algorithms import PowerSGD
from bagua_x.core.bucket import BucketLayout
from bagua_x.jax import AxisCommunicator, wrap

N = 4
SHAPES = [(16, 12), (12,), (5, 4, 3), (3, 3)]


@pytest.mark.parametrize("zero_step", [None, 1], ids=["random", "zero-at-first-compressed-step"])
def test_matches_the_reference_under_pmap(zero_step):
    """With all gradients zero at the first compressed step, Q = 0 and the redraw of its zero columns (a
    hash of the traced step counter, a ``where`` on a column mask) must run inside the one traced program."""
    layout = BucketLayout([f"t{i}" for i in range(len(SHAPES))], SHAPES, "float32")
    alg = PowerSGD(start_powerSGD_iter=1, matrix_approximation_rank=2)
    steps = [[np.random.default_rng(10 * t + r).standard_normal(layout.numel).astype(np.float32) for r in range(N)]
             for t in range(5)]
    if zero_step is not None:
        steps[zero_step] = [np.zeros(layout.numel, np.float32)] * N
    traces = []

    def reduce(x, st):
        traces.append(1)
        return alg.reduce(x, layout, st, AxisCommunicator("batch"))

    reduce = jax.pmap(reduce, axis_name="batch")
    state = jax.pmap(lambda x: alg.init(x, layout, N), axis_name="batch")(np.stack(steps[0]))
    want = ref.powersgd(steps, SHAPES, rank=2, start=1)
    assert len(want) == len(steps) == 5
    for t, xs in enumerate(steps):
        out, state = reduce(np.stack(xs), state)
        for r in range(N):  # seen: up to 2e-6
            np.testing.assert_allclose(np.asarray(out[r]), want[t][r], rtol=0, atol=1e-5, err_msg=f"step {t}")
    assert len(traces) == 1, "one trace: the warm-up and compressed steps are one program (lax.switch)"
    assert np.abs(np.asarray(out[0]) - np.mean(steps[-1], axis=0)).max() > 0.1, "not compressed?"
    assert np.abs(np.asarray(out[0])[:192]).max() > 0.1, "the 16 x 12 matrix switched off"


def test_trains_through_wrap_like_plain_averaging():
    """A linear regression whose 32 x 16 weight (of rank 2) is compressed at rank 4: the loss falls as with pmean."""
    rng = np.random.default_rng(0)
    true_w = (rng.standard_normal((32, 2)) @ rng.standard_normal((2, 16))).astype(np.float32)
    params = {"w": jnp.zeros((32, 16)), "b": jnp.zeros((16,))}
    x = rng.standard_normal((N, 60, 8, 32)).astype(np.float32)
    y = x @ true_w

    def loss(p, xb, yb):
        return jnp.mean((xb @ p["w"] + p["b"] - yb) ** 2)

    def train(reduce, state):
        opt = optax.sgd(0.1)
        p = dp.replicate(params)
        o = jax.pmap(opt.init)(p)

        def step(p, o, st, xb, yb):
            g = jax.grad(loss)(p, xb, yb)
            g, st = reduce(g, st)
            u, o = opt.update(g, o, p)
            return optax.apply_updates(p, u), o, st

        step = jax.pmap(step, axis_name="batch")
        for t in range(x.shape[1]):
            p, o, state = step(p, o, state, x[:, t], y[:, t])
        return jax.tree.map(lambda a: np.asarray(a[0]), p)

    dp = wrap(params, algorithm=PowerSGD(matrix_approximation_rank=4, start_powerSGD_iter=5))
    assert [s.name for s in dp.layouts[0].slots] == ["['b']", "['w']"]
    compressed = train(dp.reduce_gradients, dp.init())
    plain = train(lambda g, st: (jax.lax.pmean(g, "batch"), st), dp.replicate(jnp.zeros(())))
    start = float(loss(params, x[0, 0], y[0, 0]))
    final = float(loss(compressed, x[0, -1], y[0, -1]))
    reference = float(loss(plain, x[0, -1], y[0, -1]))
    assert reference < 0.25 * start, (start, reference)
    # seen: 9.751 against 9.747 (0.04%); the weights differ, so the gradients really were approximated
    assert abs(final - reference) < 0.01 * reference, (final, reference)
    # the gradients really were approximated: a compressed step's reduced weight gradient has rank 4 at most,
    # where the plain mean's has rank 16 (what the algorithm guarantees, not how far training drifted)
    w = rng.standard_normal((32, 16)).astype(np.float32)
    at = {"w": dp.replicate(w), "b": dp.replicate(params["b"])}
    grads = jax.pmap(jax.grad(loss))(at, x[:, 0], y[:, 0])
    (state,) = dp.init()
    state = state._replace(step=state.step + 5)  # past start_powerSGD_iter
    reduced, _ = jax.pmap(dp.reduce_gradients, axis_name="batch")(grads, (state,))
    averaged = jax.pmap(lambda g: jax.lax.pmean(g, "batch"), axis_name="batch")(grads)
    singular = np.linalg.svd(np.asarray(reduced["w"][0], np.float64), compute_uv=False)
    full = np.linalg.svd(np.asarray(averaged["w"][0], np.float64), compute_uv=False)
    assert len(singular) == len(full) == 16
    assert full[4] > 1e-2 * full[0], full  # the plain mean has more than 4 directions to lose
    assert singular[4] < 1e-5 * singular[0], singular  # float32 rounding of P Q^T: ~1e-7 of the largest
    # bytes: rank 4 factors of the 32 x 16 weight (4 x 48) and the 16 biases, instead of 528 values
    assert dp.algorithm.wire_bytes(dp.layouts[0], 4, N) == 2 * 3 / 4 * (16 + 4 * 48) * 4
