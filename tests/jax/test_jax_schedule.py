"""Branches decided on the host (bagua_x.jax.schedule): through ``dp.step`` each compiled step holds the
branch its step takes and nothing else, one program per branch key, and trains as the traced ``lax.switch``
of a plain loop does."""

import jax
import numpy as np
import pytest

import bx_jax_workers as w
from bagua_x.algorithms import DiLoCo, Decentralized, LowPrecisionDecentralized, ModelAverage, PowerSGD, QAdam
from bagua_x.jax import wrap
from bagua_x.jax.schedule import Scheduled

N, STEPS = 4, 9
ALGORITHMS = [
    ModelAverage(period=3),
    LowPrecisionDecentralized(communication_interval=2),
    Decentralized(communication_interval=2),
    QAdam(warmup_steps=3),
    PowerSGD(start_powerSGD_iter=3),
    DiLoCo(sync_every=3),
    DiLoCo(sync_every=4, fragments=2, fragment_sync_delay=1),
]


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=repr)
def test_through_dp_step_one_branch_per_program_and_the_same_training(algorithm):
    params = w.make_params(0)
    x, y = w.make_data(STEPS, N)
    dp = wrap(params, algorithm=algorithm)
    traces = []
    tx, step = w.training_step(dp, 1e-2, traces=traces)
    f = jax.pmap(step, axis_name="batch")
    seen = []  # the arguments of each call as dp.step passes them

    def record(*args):
        seen.append(args)
        return f(*args)

    start = (dp.replicate(params), dp.replicate(tx.init(params)), dp.init())
    plain, driven, decided = start, start, dp.step(record)
    for s in range(STEPS):
        plain = jax.block_until_ready(f(*plain, x[s], y[s]))
        untraced = len(traces)
        driven = decided(*driven, x[s], y[s])
        for a, b in zip(jax.tree.leaves(plain[0]), jax.tree.leaves(driven[0])):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6, err_msg=f"step {s}")
        if len(traces) > untraced:
            print(f"step {s}: compiled")
    keys = {algorithm.branch_key(s) for s in range(STEPS)}
    assert 2 <= len(keys) and len(traces) == 1 + len(keys), (len(traces), keys)  # the plain loop's, one per key
    assert w.conditionals(f, (*start, x[0], y[0])) >= 1  # the plain loop's step switches in the program
    for s in (0, 1, STEPS - 1):
        assert w.conditionals(f, seen[s]) == 0, s  # dp.step's: the branch alone


def test_a_state_that_skips_dp_step_is_traced_again():
    """A state that leaves a step through dp.step carries no branch: the next plain call switches in the program
    (a stale branch would average at the wrong steps), and trains as the plain loop."""
    params = w.make_params(0)
    x, y = w.make_data(4, N)
    dp = wrap(params, algorithm=ModelAverage(period=2))
    tx, step = w.training_step(dp, 1e-2)
    f = jax.pmap(step, axis_name="batch")
    start = (dp.replicate(params), dp.replicate(tx.init(params)), dp.init())
    mixed = dp.step(f)(*start, x[0], y[0])
    assert w.conditionals(f, (*mixed, x[1], y[1])) >= 1
    plain = f(*start, x[0], y[0])
    for s in range(1, 4):
        mixed, plain = f(*mixed, x[s], y[s]), f(*plain, x[s], y[s])
    for a, b in zip(jax.tree.leaves(plain[0]), jax.tree.leaves(mixed[0])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)


@pytest.mark.parametrize("algorithm", [ModelAverage(period=3), QAdam(warmup_steps=3), DiLoCo(sync_every=3)], ids=repr)
def test_jit_first_through_dp_step_one_branch_per_program(algorithm):
    """The jit-first style (dp.value_and_grad / dp.sync_params in a plain jax.jit over a mesh) through dp.step:
    no conditional in the programs, and the training of the plain jitted loop."""
    params = w.make_params(0)
    x, y = w.make_data(STEPS, N)
    mesh = jax.make_mesh((N,), ("batch",))
    plain, _ = w.bagua_jit(wrap(params, algorithm=algorithm, mesh=mesh), params, x, y, mesh)
    seen = []
    driven, _ = w.bagua_jit(wrap(params, algorithm=algorithm, mesh=mesh), params, x, y, mesh, seen=seen)
    assert len(seen) == STEPS
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(driven)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    step = seen[0][0]
    for s in (0, 1, STEPS - 1):
        assert w.conditionals(step, seen[s][1]) == 0, s
    # the same arguments without the key dp.step wrote (a plain call): the switch is traced
    keyless = jax.tree.map(lambda m: Scheduled(m.state, m.algorithm) if isinstance(m, Scheduled) else m, seen[0][1],
                           is_leaf=lambda m: isinstance(m, Scheduled))
    assert w.conditionals(step, keyless) >= 1

