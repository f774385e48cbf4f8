"""JAX step time on a cluster: every algorithm against per-leaf ``pmean``, bagua_x GradientAllReduce and the
compute-only floor, in one job.

    sudo XLA_FLAGS=--xla_force_host_platform_device_count=1 JAX_PLATFORMS=cpu \\
        bagua-x cluster --nodes 2 --nproc-per-node 2 --inter-node 1gbit -- \\
        python -m bagua_x.apps.benchmarks.jax_cluster_step --model transformer [--json OUT]

(``bagua-x bench --nodes 2 --nproc-per-node 2`` runs it per model; ``--jit`` adds the
jit-first style, :func:`build_jit_system`.)  Every
rank is one JAX process with one CPU device, joined by
``bagua_x.jax.init_distributed`` (gloo collectives across processes).  Each
builds a model of ``jax_zoo.py`` once per system, as a pmapped training step
(SGD with momentum; QAdam is its own optimizer; the ResNet's running batch
statistics averaged over the devices every step, as DDP broadcasts its
buffers): ``compute`` (the gradients
applied unreduced: the floor any algorithm can reach while the ranks share
the machine's cores), ``pmean`` (one ``lax.pmean`` per leaf, what a plain JAX
program does), and each algorithm through ``bagua_x.jax.wrap`` at its
defaults (on >= 2 nodes of >= 2 ranks, the faster of flat and two-level:
timed at ``wrap``, then decided by the trial of 12 whole steps its
``dp.step`` runs in the warm-up); GradientAllReduce is always among them, as the second
baseline.  With ``--forms``, each algorithm that has a measured default also
runs forced flat and forced two-level (``<name>/flat``, ``<name>/hierarchical``)
beside it (``<name>``), to check the default's choice.  Every step of every
system waits for its results (as ``dp.step`` does).  The systems run in
interleaved rounds, the order reversed every other round, so all see the
same machine load; rank 0 prints the median step times as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import jax
import numpy as np

import bagua_x.jax as bxj
from bagua_x.apps.benchmarks.shared import ALGORITHMS, JAX_MODELS, make_algorithm
from bagua_x.apps.quiet import without_gloo_lines
from bagua_x.core.topology import StepTrial

AXIS = "batch"


FORMS = {"flat": False, "hierarchical": True}


def build_system(name: str, model: str, rank: int):
    """A function ``carry -> carry`` doing one training step of system ``name`` (finished on return), its first
    carry, and whether it is a measured default (its first steps are ``dp.step``'s trial of the forms)."""
    import dataclasses

    import optax

    from bagua_x.algorithms import Phase, Target

    from . import jax_zoo

    params, stats, apply = jax_zoo.build(model)
    x, y = (a[None] for a in jax_zoo.batch(model, rank))  # this process's one device

    def loss_fn(p, stats):
        logits, stats = apply(p, stats, x[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[0]).mean(), stats

    sgd = optax.sgd(0.01, momentum=0.9)
    algorithm, _, form = name.partition("/")
    if name in ("compute", "pmean"):
        tx, dp, target, sync_first = sgd, None, None, False
        placed, state = jax.tree.map(lambda a: np.asarray(a)[None], params), ()
    else:
        algorithm = make_algorithm(algorithm)
        if form:
            algorithm = dataclasses.replace(algorithm, hierarchical=FORMS[form])
        dp = bxj.wrap(params, algorithm=algorithm, axis_name=AXIS)
        tx = dp.optimizer() if algorithm.target is Target.MOMENTUM else sgd
        target, sync_first = algorithm.target, algorithm.phase is Phase.BEFORE_FORWARD
        placed, state = dp.replicate(params), dp.init()

    # each call of dp communicates for one target and refuses the others: gradients here, weights before
    # (decentralized: x <- avg(x_t), then the gradient taken at x_t) or after the update, momentum in tx
    def step(p, opt_state, state, stats):
        grads, stats = jax.grad(loss_fn, has_aux=True)(p, stats)
        if name != "compute":  # the running statistics' mean over the devices (torch: DDP's buffer broadcast)
            stats = jax.lax.pmean(stats, AXIS)
        if name == "pmean":
            grads = jax.tree.map(lambda g: jax.lax.pmean(g, AXIS), grads)
        elif target is Target.GRAD:
            grads, state = dp.reduce_gradients(grads, state)
        if target is Target.WEIGHT and sync_first:
            p, state = dp.sync_params(p, state)
        updates, opt_state = tx.update(grads, opt_state, p)
        p = optax.apply_updates(p, updates)
        if target is Target.WEIGHT and not sync_first:
            p, state = dp.sync_params(p, state)
        return p, opt_state, state, stats

    pstep = jax.pmap(step, axis_name=AXIS, donate_argnums=(0, 1, 2, 3))
    guarded = dp.step(pstep) if dp is not None else lambda *carry: jax.block_until_ready(pstep(*carry))
    measured = dp is not None and not form and getattr(dp.algorithm, "hierarchical", False) is None
    stats = jax.tree.map(lambda a: np.asarray(a)[None], stats)
    return lambda carry: guarded(*carry), (placed, jax.pmap(tx.init)(placed), state, stats), measured


def build_jit_system(name: str, model: str, rank: int):
    """:func:`build_system`'s step in the jit-first style: ``jax.jit`` over a mesh of every process's device,
    the global batch sharded along it.  ``xla``: plain ``jax.value_and_grad`` of the global batch's loss
    (XLA adds its own reductions: the jit-first baseline); an algorithm through ``dp.value_and_grad`` on a
    1-D mesh (flat), or with ``/mesh2d`` on a ``("node", "local")`` mesh of ``LOCAL_WORLD_SIZE`` processes
    a node (two levels where the algorithm has them).  Returns the step, its first carry, and False (no
    form is timed)."""
    import os

    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from bagua_x.algorithms import Phase, Target

    from . import jax_zoo

    params, stats, apply = jax_zoo.build(model)
    x, y = jax_zoo.batch(model, rank)  # this process's part of the global batch
    algorithm, _, form = name.partition("/")
    devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) * jax.local_device_count()
    axis = ("node", "local") if form == "mesh2d" else AXIS
    mesh = Mesh(devices.reshape(-1, per_node), axis) if form == "mesh2d" else Mesh(devices, (AXIS,))
    batch = NamedSharding(mesh, P(axis))
    xs, ys = (jax.make_array_from_process_local_data(batch, a, (a.shape[0] * jax.process_count(),) + a.shape[1:])
              for a in (x, y))

    def loss_fn(p, stats, xb, yb):
        logits, stats = apply(p, stats, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean(), stats

    sgd = optax.sgd(0.01, momentum=0.9)
    if algorithm == "xla":  # (here BatchNorm's statistics are the global batch's: XLA reduces them too)
        tx = sgd

        def step(p, o, state, stats, xb, yb):
            grads, stats = jax.grad(loss_fn, has_aux=True)(p, stats, xb, yb)
            updates, o = tx.update(grads, o, p)
            return optax.apply_updates(p, updates), o, state, stats

        placed = jax.device_put(params, NamedSharding(mesh, P()))
        carry = (placed, jax.jit(tx.init)(placed), (), bxj.replicate(stats, axis, mesh))
    else:
        dp = bxj.wrap(params, algorithm=make_algorithm(algorithm), axis_name=axis, mesh=mesh)
        target = dp.algorithm.target
        weights = target is Target.WEIGHT
        tx = dp.optimizer() if target is Target.MOMENTUM else sgd
        update = jax.vmap(tx.update) if weights else tx.update
        sync_first = weights and dp.algorithm.phase is Phase.BEFORE_FORWARD

        def step(p, o, state, stats, xb, yb):
            ((_, stats), grads), state = dp.value_and_grad(loss_fn, has_aux=True, batch_argnums=(2, 3))(
                p, stats, xb, yb, state=state)  # the statistics the same on every device, the batch split
            stats = jax.tree.map(lambda a: a.mean(0), stats)  # one per device: their mean
            if sync_first:
                p, state = dp.sync_params(p, state)
            updates, o = update(grads, o, p)
            p = optax.apply_updates(p, updates)
            if weights and not sync_first:
                p, state = dp.sync_params(p, state)
            return p, o, state, stats

        carry = (dp.replicate(params, per_device=weights),
                 dp.replicate(tx.init(params), per_device=weights or target is Target.MOMENTUM), dp.init(),
                 dp.replicate(stats))
    jitted = jax.jit(step, donate_argnums=(0, 1, 2, 3))
    return lambda c: jax.block_until_ready(jitted(*c, xs, ys)), carry, False  # (a global batch is an argument)


def timed(step, carry, steps: int):
    """``steps`` steps from ``carry``; (the last carry, seconds per step), between two syncs of every process."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("before")
    start = time.perf_counter()
    for _ in range(steps):
        carry = step(carry)
    jax.block_until_ready(carry)
    multihost_utils.sync_global_devices("after")
    return carry, (time.perf_counter() - start) / steps


def run(args) -> dict:
    """Every system's step times (seconds), measured in interleaved rounds after a warm-up."""
    bxj.init_distributed()
    rank = jax.process_index()
    if rank == 0:  # each measured default's form and timings, as torch's cluster_step logs them
        logging.basicConfig(format="%(message)s")
        logging.getLogger("bagua_x.core.topology").setLevel(logging.DEBUG)  # with each trial step
    names = ["compute", "pmean", "allreduce"] + [a for a in args.algorithms if a != "allreduce"]
    if args.forms:  # the algorithms whose default is measured: hierarchical=None
        names += [f"{a}/{form}" for a in args.algorithms
                  if getattr(make_algorithm(a), "hierarchical", False) is None for form in FORMS]
    if args.jit:  # the same algorithms in the jit-first style, beside XLA's own reduction
        names += ["jit:xla"] + [f"jit:{a}" for a in ["allreduce"] + [a for a in args.algorithms if a != "allreduce"]]
        names += [f"jit:{a}/mesh2d" for a in args.algorithms
                  if getattr(make_algorithm(a), "hierarchical", False) is None]
    systems, carries = {}, {}
    trial = StepTrial().steps + 1  # a measured default runs its trial of both forms and decides within its warm-up
    for name in names:
        build = build_jit_system if name.startswith("jit:") else build_system
        systems[name], carry, measured = build(name.removeprefix("jit:"), args.model, rank)
        carries[name], _ = timed(systems[name], carry, max(args.warmup, trial) if measured else args.warmup)
    times = {n: [] for n in names}
    for round_ in range(args.rounds):
        for n in names if round_ % 2 == 0 else names[::-1]:
            carries[n], seconds = timed(systems[n], carries[n], args.steps)
            times[n].append(seconds)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--model", choices=JAX_MODELS, default="mlp")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    parser.add_argument("--forms", action="store_true",
                        help="also run each measured default forced flat and forced two-level")
    parser.add_argument("--jit", action="store_true",
                        help="also run the jit-first style (jit:<name>, dp.value_and_grad over a mesh; jit:xla is "
                             "XLA's own reduction; jit:<name>/mesh2d two levels on a (node, local) mesh)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    with without_gloo_lines():  # gloo says from C++ each time processes connect, here once per system
        times = run(args)
    if jax.process_index() == 0:
        result = {"model": args.model, "processes": jax.process_count(), "devices": jax.device_count(),
                  "ms": {n: statistics.median(v) * 1000 for n, v in times.items()}}
        print(json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
