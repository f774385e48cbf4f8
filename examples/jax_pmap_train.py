"""Data-parallel training with jax.pmap and bagua_x (8-bit compressed gradients).

One process with 4 CPU devices:   python examples/jax_pmap_train.py
Several processes (each gets its local devices, gloo on CPU):
    torchrun --nproc-per-node 2 examples/jax_pmap_train.py
    (JAX's coordinator uses MASTER_PORT + 1)
"""

import os
from functools import partial

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # CPU demo: 4 devices

import jax
import jax.numpy as jnp
import numpy as np
import optax

import bagua_x.jax as bxj
from bagua_x.algorithms import ByteGrad


def loss_fn(params, x, y):
    pred = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    return jnp.mean((pred - y) ** 2)


def main():
    bxj.init_distributed()  # no-op in a single process
    k1, k2 = jax.random.split(jax.random.PRNGKey(jax.process_index()))  # replicate() broadcasts process 0's
    params = {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "b1": jnp.zeros(32), "w2": jax.random.normal(k2, (32, 1)) * 0.3}

    dp = bxj.wrap(params, algorithm=ByteGrad(), axis_name="batch")
    tx = optax.chain(dp.gradient_transformation(), optax.adam(1e-2))  # communicate, then Adam

    @partial(jax.pmap, axis_name="batch")  # compiled once; collectives span all devices of all processes
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "batch")

    step = dp.step(step)  # on several nodes: times the two-level form against flat over the first steps
    params, opt_state = dp.replicate(params), dp.replicate(tx.init(params))
    rng = np.random.default_rng(jax.process_index())
    n = jax.local_device_count()
    for i in range(50):
        x = rng.normal(size=(n, 16, 8)).astype(np.float32)  # this process's devices' batches
        y = np.sin(x.sum(-1, keepdims=True))
        params, opt_state, loss = step(params, opt_state, x, y)
        if i % 10 == 0 and jax.process_index() == 0:
            print(f"step {i:3d}  loss {float(loss[0]):.4f}")
    final = dp.unreplicate(params)
    if jax.process_index() == 0:
        print("trained:", {k: v.shape for k, v in final.items()})


if __name__ == "__main__":
    main()
