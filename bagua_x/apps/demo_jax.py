"""The demo's JAX runs: every process of one launch trains the small MLP once per algorithm.

One launch runs all the algorithms in turn: starting JAX and connecting its
processes costs more than a short run on a 2-core machine.  The first step of
each algorithm traces and compiles it, so the clock starts after it.
"""

from __future__ import annotations

import os
import time


def train(algo_names: list, steps: int, batch: int, lr: float, seed: int, eval_every: int,
          coordinator_port: int) -> list:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # one device per process
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import bagua_x.jax as bxj

    from .data import load_digits_split
    from .quiet import without_gloo_lines

    with without_gloo_lines():  # gloo says from C++ each time processes connect
        bxj.init_distributed(coordinator_address=f"127.0.0.1:{coordinator_port}")
        data = load_digits_split(seed)
        return [_train(name, steps, batch, lr, seed, eval_every, data, jax.process_index(), jax.process_count())
                for name in algo_names]


def _train(algo_name, steps, batch, lr, seed, eval_every, data, rank, world) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from tqdm import tqdm

    import bagua_x.jax as bxj
    from bagua_x.algorithms import Phase, Target

    from .algorithms import make
    from .data import rank_batches

    x_tr, y_tr, x_te, y_te = data

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
    tx = dp.optimizer() if algorithm.target is Target.MOMENTUM else optax.sgd(lr, momentum=0.9)
    # each call communicates for one target and refuses the others: gradients here, weights
    # before (decentralized: x <- avg(x_t), then the gradient taken at x_t) or after the update
    weights = algorithm.target is Target.WEIGHT
    sync_first = weights and algorithm.phase is Phase.BEFORE_FORWARD

    def step(params, opt_state, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        if algorithm.target is Target.GRAD:
            grads, state = dp.reduce_gradients(grads, state)
        if sync_first:
            params, state = dp.sync_params(params, state)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if weights and not sync_first:
            params, state = dp.sync_params(params, state)
        return params, opt_state, state, loss

    pstep = jax.pmap(step, axis_name="batch")
    accuracy = jax.jit(lambda p: (logits(p, x_te).argmax(1) == y_te).mean())
    params = dp.replicate(params)
    opt_state = jax.pmap(tx.init)(params)
    state = dp.init()
    losses, seconds, evals, clock = [], [], [], 0.0
    batches = rank_batches(x_tr, y_tr, rank, world, batch, steps, seed)
    for i, (xb, yb) in enumerate(tqdm(batches, total=steps, desc=f"jax/{algo_name}", disable=rank != 0,
                                      leave=False), 1):
        start = time.perf_counter()
        params, opt_state, state, loss = pstep(params, opt_state, state, xb[None], yb[None])
        loss = float(loss[0])  # waits for the step
        clock += 0.0 if i == 1 else time.perf_counter() - start  # step 1 traces and compiles: off the clock
        losses.append(loss)
        seconds.append(clock)
        if i % eval_every == 0 or i == steps:  # this process's own model on the whole held-out set
            evals.append([i, float(accuracy(dp.unreplicate(params)))])

    # mean loss and accuracy over processes, the slowest process's clock
    local = np.asarray([*losses, *(a for _, a in evals), *seconds], np.float64)
    gathered = np.asarray(multihost_utils.process_allgather(local)).reshape(world, -1)
    n, k = len(losses), len(evals)
    mean, slowest = gathered.mean(0), gathered[:, n + k:].max(0)
    return {
        "frontend": "jax", "algorithm": algo_name, "losses": mean[:n].tolist(), "seconds": slowest.tolist(),
        "evals": [[s, float(a)] for (s, _), a in zip(evals, mean[n:n + k])],
        "accuracy": float(mean[n + k - 1]), "step_ms": 1000 * float(slowest[-1]) / max(n - 1, 1),
        "bytes_per_step": float(sum(algorithm.wire_bytes(layout, 4, world) for layout in dp.layouts)),
        "parameters": int(sum(x.size for x in jax.tree_util.tree_leaves(dp.unreplicate(params)))),
    }
