"""The demo's JAX runs: every process of one job trains the MLP once per algorithm, as ``demo_torch`` does.

    python -m torch.distributed.run --nproc_per_node 4 -m bagua_x.apps.demo_jax --json out.json allreduce bytegrad

Launched like the torch job (on the 2 x 2 cluster, a capped loopback or plain
loopback), one CPU device per process, joined by
``bagua_x.jax.init_distributed`` from torchrun's variables.  One job runs all
the algorithms in turn: starting JAX and connecting its processes costs more
than a short run on a 2-core machine.  When each run stops is
:mod:`.demo_run`'s plan (no form trial here: JAX times the two forms at
``wrap``, off the clock).  The clock counts training steps only: the first step traces
and compiles the algorithm's program (once), and the held-out evaluations are
off it; each evaluation ends in a gather across processes, so a process that
evaluates faster does not charge its wait to the next step.
"""

from __future__ import annotations

import json
import os
import time


def init_mlp(key, hidden: int) -> dict:
    """64 -> hidden -> hidden -> 10, as ``demo_torch.mlp``, fan-in scaled."""
    import jax

    sizes = [64, hidden, hidden, 10]
    keys = jax.random.split(key, len(sizes) - 1)
    return {f"l{i}": {"w": jax.random.normal(k, (n_in, n_out)) / n_in**0.5, "b": jax.numpy.zeros(n_out)}
            for i, (k, n_in, n_out) in enumerate(zip(keys, sizes, sizes[1:]))}


def logits(params: dict, x):
    import jax

    for i in range(len(params) - 1):
        x = jax.nn.relu(x @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"])
    last = params[f"l{len(params) - 1}"]
    return x @ last["w"] + last["b"]


def train(algo_name: str, args, data) -> dict:
    """One algorithm's run; process 0's dict holds the loss averaged over processes and the slowest clock."""
    import jax
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from tqdm import tqdm

    import bagua_x.jax as bxj
    from bagua_x.algorithms import Phase, Target
    from ..core.topology import StepTrial

    from .algorithms import make
    from .data import rank_batches
    from .demo_run import plan_for

    rank, world = jax.process_index(), jax.process_count()
    x_tr, y_tr, x_te, y_te = data
    x_eval, y_eval = x_te[rank::world], y_te[rank::world]

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()

    params = init_mlp(jax.random.PRNGKey(args.seed + rank), args.hidden)  # apart: replicate() broadcasts process 0's
    algorithm = make(algo_name, args.steps)
    dp = bxj.wrap(params, algorithm=algorithm, axis_name="batch")
    plan = plan_for(algorithm, args, args.reference.get(algo_name), StepTrial().steps if algorithm.timed_form else 0)
    tx = dp.optimizer() if algorithm.target is Target.MOMENTUM else optax.sgd(args.lr, momentum=0.9)
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

    # dp.step: the host decides what the step compiles (the form on nodes, after its trial; DiLoCo's sync steps)
    pstep = dp.step(jax.pmap(step, axis_name="batch"))
    correct = jax.jit(lambda p: (logits(p, x_eval).argmax(1) == y_eval).sum())
    params = dp.replicate(params)
    opt_state = jax.pmap(tx.init)(params)
    state = dp.init()

    def evaluate(clock: float) -> tuple[float, float]:
        """Held-out accuracy (each process's own model on its share) and the slowest clock."""
        mine = np.asarray([float(correct(dp.unreplicate(params))), len(y_eval), clock], np.float64)
        every = np.asarray(multihost_utils.process_allgather(mine)).reshape(world, 3)
        return float(every[:, 0].sum() / every[:, 1].sum()), float(every[:, 2].max())

    losses, seconds, evals, clock, reached = [], [], [], 0.0, False
    batches = rank_batches(x_tr, y_tr, rank, world, args.batch, args.steps, args.seed)
    for i, (xb, yb) in enumerate(tqdm(batches, total=args.steps, desc=f"jax/{algo_name}", disable=rank != 0,
                                      leave=False), 1):
        start = time.perf_counter()
        params, opt_state, state, loss = pstep(params, opt_state, state, xb[None], yb[None])
        loss = float(loss[0])  # waits for the step
        clock += 0.0 if i == 1 else time.perf_counter() - start  # step 1 traces and compiles: off the clock
        losses.append(loss)
        seconds.append(clock)
        if plan.evaluates(i):
            accuracy, slowest = evaluate(clock)
            evals.append([i, accuracy])
            reached = reached or accuracy >= args.target
            if plan.done(i, slowest, reached):
                break

    n = len(losses)
    every = np.asarray(multihost_utils.process_allgather(np.asarray([*losses, *seconds], np.float64)))
    every = every.reshape(world, 2 * n)
    return {
        "frontend": "jax", "algorithm": algo_name, "losses": every[:, :n].mean(0).tolist(),
        "seconds": every[:, n:].max(0).tolist(), "evals": evals, "accuracy": evals[-1][1],
        "step_ms": 1000 * float(every[:, -1].max()) / max(n - 1, 1),
        "bytes_per_step": float(sum(algorithm.wire_bytes(layout, 4, world) for layout in dp.layouts)),
        "parameters": int(sum(x.size for x in jax.tree_util.tree_leaves(dp.unreplicate(params)))),
        **plan.record(),
    }


def main(argv=None) -> None:
    from .demo_run import job_arguments

    args = job_arguments(__doc__.split("\n\n")[0], argv)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # one device per process
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax

    import bagua_x.jax as bxj

    from .data import load_digits_split
    from .quiet import without_gloo_lines

    with without_gloo_lines():  # gloo says from C++ each time processes connect
        bxj.init_distributed()
        data = load_digits_split(args.seed)
        runs = []
        for name in args.algorithms:
            runs.append(train(name, args, data))
            if jax.process_index() == 0:
                r = runs[-1]
                print(f"  jax   {name:14s} {len(r['losses']):4d} steps in {r['seconds'][-1]:5.1f} s, "
                      f"held-out accuracy {r['accuracy']:.3f}", flush=True)
    if jax.process_index() == 0:
        with open(args.json, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main()
