"""JAX training script run under ``python -m torch.distributed.run`` by test_jax_elastic.py.

Usage: ``bx_jax_elastic_train.py WORKDIR TOTAL_STEPS EVERY KILL_AT``.  Two
processes, one CPU device each, GradientAllReduce + Adam under pmap.  Process 0
checkpoints every EVERY steps to WORKDIR/checkpoint.npz (``np.savez`` of the
leaves of params, optimizer state and bagua_x state; atomically); every
(re)start resumes from it (the replicas are identical, so process 0's rows
serve both).  On the first attempt only (TORCHELASTIC_RESTART_COUNT == 0),
process 1 dies abruptly before step KILL_AT (-1: never): process 0 must not
hang (wrap's timeout; the elastic agent usually stops it first), and the agent
restarts both.  Process 0 writes the final params to WORKDIR/final.npz and
appends ``attempt start_step master_port`` lines to WORKDIR/attempts.
"""

import logging
import os
import sys

import jax
import numpy as np

import bagua_x.jax as bxj
from bx_jax_workers import _host_local, loss_fn, make_params, training_step


def main(workdir: str, total: int, every: int, kill_at: int) -> None:
    logging.basicConfig(level=logging.WARNING)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    bxj.init_distributed()
    rank = jax.process_index()
    params = make_params(0)
    dp = bxj.wrap(params, timeout=10)
    tx, step = training_step(dp, lr=1e-2)
    carry = (dp.replicate(params), dp.replicate(tx.init(params)), dp.init())
    checkpoint = os.path.join(workdir, "checkpoint.npz")
    start = 0
    if os.path.exists(checkpoint):
        with np.load(checkpoint) as saved:
            leaves = [saved[f"arr_{i}"] for i in range(len(saved.files) - 1)]
            start = int(saved[f"arr_{len(saved.files) - 1}"])
        carry = jax.tree.unflatten(jax.tree.structure(carry), leaves)
    if rank == 0:
        with open(os.path.join(workdir, "attempts"), "a") as f:
            f.write(f"{attempt} {start} {os.environ['MASTER_PORT']}\n")
    train_step = dp.step(jax.pmap(step, axis_name="batch"))
    for s in range(start, total):
        if attempt == 0 and rank == 1 and s == kill_at:
            os._exit(1)
        rng = np.random.default_rng(1000 * s + rank)
        x = rng.normal(size=(1, 8, 6)).astype(np.float32)
        y = np.tanh(x[..., :3]).astype(np.float32)
        carry = train_step(*carry, x, y)
        if rank == 0 and (s + 1) % every == 0:
            tmp = os.path.join(workdir, "checkpoint.tmp.npz")
            np.savez(tmp, *[_host_local(a) for a in jax.tree.leaves(carry)], np.int64(s + 1))
            os.replace(tmp, checkpoint)
    if rank == 0:
        np.savez(os.path.join(workdir, "final.npz"), *[_host_local(a) for a in jax.tree.leaves(carry[0])])
    assert loss_fn  # the model of bx_jax_workers, trained by training_step
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
