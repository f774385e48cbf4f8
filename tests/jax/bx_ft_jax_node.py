"""One fault-tolerant JAX node (one process, 2 CPU devices) of the JAX fault-tolerance tests.

Run as a process with REPLICA_GROUP_ID=node<k> and TORCHFT_LIGHTHOUSE.  Trains a
small MLP with DiLoCo (or SparseLoCo): a ``jax.jit`` step over the node's 2-device
mesh (``dp.value_and_grad`` averages the gradients over the node), an optax SGD
with momentum per device, then ``dp.sync_replicas`` on the host.  Node k reads
its own data stream; the position is kept for healing.  Every inner step appends
one JSON line to LOG: the inner position, torchft's committed outer steps, whether
this step committed one, the nodes taking part, the outer steps discarded so far, the time.  At the end it saves
row 0 of the params and the algorithm state (``LOG.npz``).

    python bx_ft_jax_node.py ALGORITHM SYNC_EVERY TARGET LOG [DELAY]

LOG may hold ``{node}`` (every node of a ``bagua-x cluster`` runs the same command).  With ``BX_FT_DIE_AT=K``
node 1 kills itself (SIGKILL) after its K-th inner step of its first attempt, so that torchrun restarts it.
With ``BX_FT_PMAP=1`` the step runs under ``jax.pmap`` instead of a ``jax.jit`` over the node's mesh.
With ``BX_FT_SEED`` the initial weights' seed, the same on every node (``init_sync=False``); by default the
node's number: nodes start apart and the first quorum makes them one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

DEVICES, BATCH, IN, OUT = 2, 16, 6, 3
HIDDEN = int(os.environ.get("BX_FT_HIDDEN", 16))  # another width: a node that joins with another model
LR, MOMENTUM = 0.05, 0.5  # DiLoCo converges at H = 4 (inner momentum 0.9 stacks on the outer one: diverges)


def make_params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"l1": {"w": (rng.normal(size=(IN, HIDDEN)) * 0.4).astype(np.float32), "b": np.zeros(HIDDEN, np.float32)},
            "l2": {"w": (rng.normal(size=(HIDDEN, OUT)) * 0.3).astype(np.float32), "b": np.zeros(OUT, np.float32)}}


def batch(node: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Node ``node``'s batch ``index``: a pure function of the two, so a healed position reads the same data."""
    rng = np.random.default_rng(1_000_003 * node + index)
    x = rng.normal(size=(BATCH, IN)).astype(np.float32)
    teacher = np.random.default_rng(7).normal(size=(IN, OUT)).astype(np.float32)
    return x, np.tanh(x @ teacher).astype(np.float32)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    return jnp.mean((h @ params["l2"]["w"] + params["l2"]["b"] - y) ** 2)


def algorithm(name: str, sync_every: int):
    from bagua_x.algorithms import DiLoCo, SparseLoCo

    if name == "diloco":
        return DiLoCo(sync_every=sync_every)
    return SparseLoCo(sync_every=sync_every, fraction=0.25, chunk=64)


def main(name: str, sync_every: int, target: int, log_path: str, delay: float = 0.0) -> None:
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import bagua_x.jax as bxj
    from bagua_x.ft import FaultTolerance

    node = int(os.environ["REPLICA_GROUP_ID"].removeprefix("node"))
    log_path = log_path.format(node=node, rank=0)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    die_at = int(os.environ.get("BX_FT_DIE_AT", "-1")) if node == 1 and first_attempt else -1
    pmap = os.environ.get("BX_FT_PMAP") == "1"  # the step under jax.pmap instead of jax.jit over a mesh
    mesh = None if pmap else jax.make_mesh((DEVICES,), ("batch",))
    params = make_params(int(os.environ.get("BX_FT_SEED", node)))
    dp = bxj.wrap(params, algorithm=algorithm(name, sync_every), mesh=mesh,
                  fault_tolerance=FaultTolerance(timeout=10, quorum_timeout=float(
                      os.environ.get("BX_FT_QUORUM_TIMEOUT", 60)), init_sync="BX_FT_SEED" not in os.environ))
    tx = optax.sgd(LR, momentum=MOMENTUM)
    p, o = dp.replicate(params, per_device=True), dp.replicate(tx.init(params), per_device=True)
    state = dp.init()
    def on_device(p, o, state, x, y):
        (loss, grads), state = dp.value_and_grad(loss_fn)(p, x, y, state=state)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, state, loss

    if pmap:
        step = jax.pmap(on_device, axis_name="batch")
        split = lambda a: a.reshape(DEVICES, -1, *a.shape[1:])  # noqa: E731
    else:
        @jax.jit
        def step(p, o, state, x, y):
            (loss, grads), state = dp.value_and_grad(loss_fn)(p, x, y, state=state)
            updates, o = jax.vmap(tx.update)(grads, o, p)
            return optax.apply_updates(p, updates), o, state, loss

        sharding = NamedSharding(mesh, P("batch"))
        split = lambda a: jax.device_put(a, sharding)  # noqa: E731

    manager = dp.replicas.manager
    position = {"inner": 0}
    dp.replicas.keep("data", lambda: dict(position), position.update)
    steps_here = 0  # in this attempt
    with open(log_path, "a") as log:
        while position["inner"] < target:
            x, y = (split(a) for a in batch(node, position["inner"]))
            p, o, state, loss = step(p, o, state, x, y)
            before = manager.current_step()
            p, o, state = dp.sync_replicas(p, o, state)
            position["inner"] += 1
            log.write(json.dumps({"inner": position["inner"], "step": manager.current_step(),
                                  "committed": manager.current_step() > before, "nodes": manager.num_participants(),
                                  "discarded": dp.replicas.discarded,
                                  "time": time.time(), "loss": float(loss.mean())}) + "\n")
            log.flush()
            steps_here += 1
            if steps_here == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(delay)
    rows = lambda tree: [np.asarray(a)[0] for a in jax.tree.leaves(tree)]  # noqa: E731
    np.savez(f"{log_path}.npz", *rows(p), *[np.asarray(a) for a in jax.tree.leaves(state)],
             n_params=len(jax.tree.leaves(p)),
             state_names=np.array([jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(state)]))
    dp.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5]) if len(sys.argv) > 5 else 0.0)
