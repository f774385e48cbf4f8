"""Data-parallel training with jax.shard_map over a Mesh and bagua_x.

Params are replicated over the mesh (``in_specs=P()``), the batch is sharded
along the "batch" axis; bagua_x communicates the gradients inside the step.
(Without a shard_map of your own, ``examples/jax_jit_train.py`` is shorter.)

    python examples/jax_shard_map_train.py            # one process, 4 CPU devices
    torchrun --nproc-per-node 2 examples/jax_shard_map_train.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # CPU demo: 4 devices

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import bagua_x.jax as bxj
from bagua_x.algorithms import GradientAllReduce


def loss_fn(params, x, y):
    pred = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    return jnp.mean((pred - y) ** 2)


def main():
    bxj.init_distributed()  # no-op in a single process
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w1": jax.random.normal(k1, (8, 32)) * 0.3, "b1": jnp.zeros(32), "w2": jax.random.normal(k2, (32, 1)) * 0.3}

    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    dp = bxj.wrap(params, algorithm=GradientAllReduce(), axis_name="batch")
    tx = optax.chain(dp.gradient_transformation(), optax.adam(1e-2))

    def step(params, opt_state, x, y):  # runs per device on its shard of the batch
        # differentiate a per-device copy: with respect to params passed with P() (the same on every device),
        # jax.grad would sum the gradient over the devices itself, before bagua_x (docs/jax.md)
        loss, grads = jax.value_and_grad(loss_fn)(jax.lax.pcast(params, "batch", to="varying"), x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "batch")

    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("batch"), P("batch")),
                                 out_specs=(P(), P(), P())))
    params, opt_state = dp.replicate(params, mesh), dp.replicate(tx.init(params), mesh)
    batch = NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(jax.process_index())
    local_rows = 16 * jax.local_device_count()
    for i in range(50):
        x = rng.normal(size=(local_rows, 8)).astype(np.float32)  # this process's part of the global batch
        y = np.sin(x.sum(-1, keepdims=True))
        x, y = (jax.make_array_from_process_local_data(batch, a) for a in (x, y))
        params, opt_state, loss = step(params, opt_state, x, y)
        if i % 10 == 0 and jax.process_index() == 0:
            print(f"step {i:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
