"""Data-parallel training in JAX's jit-first style with bagua_x: ``jax.jit`` over a mesh, the batch sharded
along its "batch" axis, ByteGrad compressing the gradients.

The change from a plain jitted step is ``dp.value_and_grad(loss_fn)`` in place of
``jax.value_and_grad(loss_fn)``, with the bagua_x state passed in and out: under
plain ``jax.jit`` XLA would reduce the gradients itself, in full precision,
before any library saw them, so bagua_x differentiates per device inside a
``shard_map`` of its own and communicates there.

    python examples/jax_jit_train.py            # one process, 4 CPU devices
    torchrun --nproc-per-node 2 examples/jax_jit_train.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # CPU demo: 4 devices

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import bagua_x.jax as bxj
from bagua_x.algorithms import ByteGrad


def loss_fn(params, x, y):
    pred = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    return jnp.mean((pred - y) ** 2)


def main():
    bxj.init_distributed()  # no-op in a single process
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "b1": jnp.zeros(32), "w2": jax.random.normal(k2, (32, 1)) * 0.3}

    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    dp = bxj.wrap(params, algorithm=ByteGrad(), axis_name="batch", mesh=mesh)
    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state, state, x, y):
        (loss, grads), state = dp.value_and_grad(loss_fn)(params, x, y, state=state)  # grads: ByteGrad's mean
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, loss.mean()  # loss: one per device

    params, opt_state, state = dp.replicate(params), dp.replicate(tx.init(params)), dp.init()
    batch = NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(jax.process_index())
    local_rows = 16 * jax.local_device_count()
    for i in range(50):
        x = rng.normal(size=(local_rows, 8)).astype(np.float32)  # this process's part of the global batch
        y = np.sin(x.sum(-1, keepdims=True))
        x, y = (jax.make_array_from_process_local_data(batch, a) for a in (x, y))
        params, opt_state, state, loss = step(params, opt_state, state, x, y)
        if i % 10 == 0 and jax.process_index() == 0:
            print(f"step {i:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
