"""One demo run with the JAX frontend (executed on every rank by the launcher)."""

from __future__ import annotations

import os
import time


def train(algo_name: str, steps: int, batch: int, lr: float, seed: int, coordinator_port: int) -> dict:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # one device per process
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import bagua_x.jax as bxj

    from .quiet import without_gloo_lines

    with without_gloo_lines():  # gloo says from C++ each time processes connect
        bxj.init_distributed(coordinator_address=f"127.0.0.1:{coordinator_port}")
        return _train(algo_name, steps, batch, lr, seed, jax.process_index(), jax.process_count())


def _train(algo_name, steps, batch, lr, seed, rank, world) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tqdm import tqdm

    import bagua_x.jax as bxj
    from bagua_x.algorithms import Phase, Target

    from .algorithms import make
    from .data import load_digits_split, rank_batches

    x_tr, y_tr, x_te, y_te = load_digits_split(seed)

    def init(key):
        k1, k2 = jax.random.split(key)
        return {
            "l1": {"w": jax.random.normal(k1, (64, 128)) * (1 / 8), "b": jnp.zeros(128)},
            "l2": {"w": jax.random.normal(k2, (128, 10)) * (1 / 128**0.5), "b": jnp.zeros(10)},
        }

    def logits(p, x):
        return jax.nn.relu(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"]["w"] + p["l2"]["b"]

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()

    params = init(jax.random.PRNGKey(seed + rank))  # processes start apart: replicate() broadcasts process 0's
    algorithm = make(algo_name, steps)
    dp = bxj.wrap(params, algorithm=algorithm, axis_name="batch")
    if algorithm.target is Target.MOMENTUM:
        tx = dp.optimizer()
    else:
        tx = optax.sgd(lr, momentum=0.9)
    sync_first = algorithm.phase == Phase.BEFORE_FORWARD

    def step(params, opt_state, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        grads, state = dp.reduce_gradients(grads, state)
        if sync_first:  # decentralized: x <- avg(x_t), then the gradient taken at x_t
            params, state = dp.sync_params(params, state)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if not sync_first:
            params, state = dp.sync_params(params, state)
        return params, opt_state, state, loss

    pstep = jax.pmap(step, axis_name="batch")
    params = dp.replicate(params)
    opt_state = jax.pmap(tx.init)(params)
    state = dp.init()
    losses, times = [], []
    batches = rank_batches(x_tr, y_tr, rank, world, batch, steps, seed)
    for xb, yb in tqdm(batches, total=steps, desc=f"jax/{algo_name}", disable=rank != 0, leave=False):
        start = time.perf_counter()
        params, opt_state, state, loss = pstep(params, opt_state, state, xb[None], yb[None])
        loss = float(loss[0])  # waits for the step
        times.append(time.perf_counter() - start)
        losses.append(loss)

    local = dp.unreplicate(params)
    accuracy = float((np.asarray(logits(local, x_te)).argmax(1) == y_te).mean())
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray([accuracy, *losses], np.float64))
    mean = np.asarray(gathered).reshape(world, -1).mean(0)
    return {
        "frontend": "jax", "algorithm": algo_name, "losses": mean[1:].tolist(), "accuracy": float(mean[0]),
        "step_ms": 1000 * float(np.mean(times[len(times) // 5 :])),
        "bytes_per_step": sum(algorithm.wire_bytes(layout, 4, world) for layout in dp.layouts),
    }
