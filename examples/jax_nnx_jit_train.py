"""A flax.nnx model trained under ``nnx.jit`` over a mesh with bagua_x's ByteGrad (the jit-first style).

``dp.value_and_grad`` in place of ``nnx.value_and_grad``: it differentiates
the params split out of the model (``nnx.split``), each device on its shard of
the batch, and returns ByteGrad's mean, which the ``nnx.Optimizer`` applies as
usual.  (Under plain ``nnx.jit`` XLA would reduce the gradients itself, in full
precision, before bagua_x saw them.)

    python examples/jax_nnx_jit_train.py            # one process, 4 CPU devices
    torchrun --nproc-per-node 2 examples/jax_nnx_jit_train.py
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


def train_step(dp):
    """The jitted step: the model and optimizer updated in place, bagua_x's state in and out."""

    @nnx.jit
    def step(model, optimizer, state, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params, x, y):
            return jnp.mean((nnx.merge(graphdef, params, rest)(x) - y) ** 2)

        (loss, grads), state = dp.value_and_grad(loss_fn)(nnx.to_pure_dict(params), x, y, state=state)
        nnx.replace_by_pure_dict(params, grads)  # the reduced gradients, in the optimizer's structure
        optimizer.update(model, params)
        return loss.mean(), state

    return step


def main():
    bxj.init_distributed()  # no-op in a single process
    mesh = jax.make_mesh((jax.device_count(),), ("batch",))
    model = MLP(nnx.Rngs(jax.process_index()))
    dp = bxj.wrap(nnx.to_pure_dict(nnx.state(model, nnx.Param)), algorithm=ByteGrad(), axis_name="batch", mesh=mesh)
    nnx.update(model, dp.replicate(nnx.state(model)))  # process 0's values, replicated on the mesh
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step, state = train_step(dp), dp.init()
    batch = NamedSharding(mesh, P("batch"))
    rng = np.random.default_rng(jax.process_index())
    local_rows = 16 * jax.local_device_count()
    for i in range(50):
        x = rng.normal(size=(local_rows, 8)).astype(np.float32)  # this process's part of the global batch
        y = np.sin(x.sum(-1, keepdims=True))
        x, y = (jax.make_array_from_process_local_data(batch, a) for a in (x, y))
        loss, state = step(model, optimizer, state, x, y)
        if i % 10 == 0 and jax.process_index() == 0:
            print(f"step {i:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
