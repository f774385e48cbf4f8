"""docs/write-your-own-algorithm.md's Float16AllReduce (examples/own_algorithm.py) through bagua_x.jax.wrap, on 4
devices under pmap: the gradient transformation gives every device the float16 mean of the devices' gradients."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

import bagua_x.jax as bxj
from own_algorithm import Float16AllReduce


def test_pmap_steps_with_the_float16_mean():
    n = jax.local_device_count()
    assert n == 4  # tests/conftest.py forces 4 CPU devices
    params = {"w": jnp.linspace(-1.0, 1.0, 24).reshape(8, 3), "b": jnp.zeros(3)}
    loss = lambda p, x: jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - 1.0) ** 2)  # noqa: E731
    dp = bxj.wrap(params, algorithm=Float16AllReduce(), axis_name="batch")
    tx = optax.chain(dp.gradient_transformation(), optax.sgd(0.1))

    @partial(jax.pmap, axis_name="batch")
    def step(params, opt_state, x):
        updates, opt_state = tx.update(jax.grad(loss)(params, x), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    xs = np.random.default_rng(0).standard_normal((n, 16, 8)).astype(np.float32)  # each device its own batch
    new, _ = step(dp.replicate(params), dp.replicate(tx.init(params)), xs)
    grads = [jax.grad(loss)(params, x) for x in xs]
    for name in params:
        local = np.stack([np.asarray(g[name]) for g in grads])
        bound = n * 2.0**-11 * np.abs(local).max(axis=0)  # n roundings to float16
        for device in range(n):
            moved = np.asarray(params[name]) - np.asarray(new[name][device])
            assert np.all(np.abs(moved - 0.1 * local.mean(axis=0)) <= 0.1 * bound + 1e-7)
        assert not np.allclose(moved, 0.1 * local[-1], atol=1e-6)  # the mean, not the device's own gradient


def test_a_dict_state_is_refused_at_init():
    """A state that is not a NamedTuple would be traced, then fail at the first torch-style checkpoint."""
    import dataclasses

    import pytest

    from bagua_x.core import BaguaXError

    @dataclasses.dataclass(frozen=True)
    class DictState(Float16AllReduce):
        def init(self, flat, layout, world_size):
            return {"residual": flat * 0}

    dp = bxj.wrap({"w": jnp.ones((3, 2))}, algorithm=DictState(), axis_name="batch")
    with pytest.raises(BaguaXError, match=r"DictState.init returned a dict .*'w'.*NamedTuple"):
        dp.init()
