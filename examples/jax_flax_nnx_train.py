"""Data-parallel flax.nnx training with jax.shard_map and bagua_x (8-bit compressed gradients).

nnx.split turns the model and its nnx.Optimizer into a graph definition and a
state pytree, so the step is a plain function of arrays that shard_map runs on
every device; inside it nnx.merge rebuilds them, and the optimizer's chain
communicates the gradients (bagua_x first, then Adam).

    python examples/jax_flax_nnx_train.py            # one process, 4 CPU devices
    torchrun --nproc-per-node 2 examples/jax_flax_nnx_train.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # CPU demo: 4 devices

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import bagua_x.jax as bxj
from bagua_x.algorithms import ByteGrad


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def main():
    bxj.init_distributed()  # no-op in a single process
    model = MLP(nnx.Rngs(jax.process_index()))  # replicate() broadcasts process 0's
    # wrap the params as the optimizer hands them to optax: nnx.as_pure strips the Param boxes
    dp = bxj.wrap(nnx.as_pure(nnx.state(model, nnx.Param)), algorithm=ByteGrad(), axis_name="batch")
    optimizer = nnx.Optimizer(model, optax.chain(dp.gradient_transformation(), optax.adam(1e-2)), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, x, y):  # runs per device on its shard of the batch
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)  # bagua_x's update runs here, inside shard_map
        return nnx.state((model, optimizer)), jax.lax.pmean(loss, "batch")

    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    # check_vma=False: untyped, as pmap is. Typed, nnx.value_and_grad of a model passed with P() would be the
    # gradient summed over the devices by JAX itself, which bagua_x refuses (docs/jax.md)
    step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=(P(), P()),
                                 check_vma=False))
    state = dp.replicate(state, mesh)
    batch = NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(jax.process_index())
    local_rows = 16 * jax.local_device_count()
    for i in range(50):
        x = rng.normal(size=(local_rows, 8)).astype(np.float32)  # this process's part of the global batch
        y = np.sin(x.sum(-1, keepdims=True))
        x, y = (jax.make_array_from_process_local_data(batch, a) for a in (x, y))
        state, loss = step(state, x, y)
        if i % 10 == 0 and jax.process_index() == 0:
            print(f"step {i:3d}  loss {float(loss):.4f}")
    model, optimizer = nnx.merge(graphdef, state)  # the trained model, replicated over the mesh
    if jax.process_index() == 0:
        print("trained:", int(optimizer.step[...]), "steps")


if __name__ == "__main__":
    main()
