"""Compute utilisation over a slow link: how much of the wall time each algorithm leaves to computing.

    sudo bagua-x cluster --nodes 2 --nproc-per-node 2 --inter-node 10mbit --timeout 3600 -- \\
        python benchmarks/slow_link.py [--frontend torch|jax] [--model digits|transformer] [--steps 320] [--h 32]
        [--json OUT]

Utilisation is (steps x compute-only step time) / wall time: the compute-only
step is the same model and optimizer with no communication at all, timed in
the same job on the same ranks.  Settings: GradientAllReduce, ByteGrad,
DiLoCo(sync_every=H) with the pseudo-gradient in 32, 8 and 4 bits, and
SparseLoCo(sync_every=H) (TopK 2 % at 2 bits, error feedback), also streamed
(4 fragments, each exchange overlapping the next step); all in their
default form, which on 2 nodes of 2 ranks is two levels for DiLoCo (a node is
one worker, its ranks averaging gradients every step); ``--flat``: every rank
a DiLoCo worker, nothing exchanged between the syncs.  ``digits``: the demo's
MLP (64-256-256-10) on the digits, SGD with momentum, batch 16 per rank,
``--steps`` for every setting (the same samples), held-out accuracy of each
rank's model after the last step.  ``transformer``: the zoo's 11.6M-parameter
decoder (``torch_zoo`` / ``jax_zoo``, the same tensors) with AdamW on random
tokens (no accuracy); the settings that communicate every step run
``--per-step-steps`` steps (one step of them at 10 Mbit/s moves tens of MB).  JAX: one process per rank (one CPU device each,
``bagua_x.jax.init_distributed``), a pmapped step, ``dp.reduce_gradients``
(gradients; for DiLoCo the in-node mean) and ``dp.sync_params``; DiLoCo and
SparseLoCo through ``dp.step``, one program per branch, each compiled in two
untimed exchange periods before the clock starts.  Rank 0 prints one table
(``--json`` keeps it).
"""

import argparse
import itertools
import json
import os
import time

import numpy as np

from bagua_x.algorithms import ByteGrad, DiLoCo, GradientAllReduce, SparseLoCo
from bagua_x.apps.data import load_digits_split, rank_batches


def settings(h: int, flat: bool):
    """(name, algorithm or None for compute only, whether it communicates every step)."""
    yield "compute only", None, False
    yield "GradientAllReduce", GradientAllReduce(), True
    yield "ByteGrad", ByteGrad(), True
    form, suffix = (False, " flat") if flat else (None, "")
    for bits in (32, 8, 4):
        yield f"DiLoCo H={h} {bits} bits{suffix}", DiLoCo(sync_every=h, bits=bits, hierarchical=form), False
    yield f"SparseLoCo H={h} 2% 2 bits{suffix}", SparseLoCo(sync_every=h, hierarchical=form), False
    # Streaming: each quarter's exchange in flight while the next step computes (torch overlaps it)
    yield (f"SparseLoCo H={h} P=4 tau=1{suffix}",
           SparseLoCo(sync_every=h, fragments=4, fragment_sync_delay=1, hierarchical=form), False)


# -- torch ---------------------------------------------------------------------------------------------------


def torch_run(name, algorithm, steps, args, data) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import bagua_x.torch as bxt

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    if args.model == "digits":
        from bagua_x.apps.demo_torch import mlp

        model = mlp(256)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        batches = ((torch.from_numpy(x), torch.from_numpy(y))
                   for x, y in rank_batches(data[0], data[1], rank, world, args.batch, steps, args.seed))
    else:
        from bagua_x.apps.benchmarks.torch_zoo import batch, build

        model = build("transformer")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batches = (batch("transformer", rank + world * step) for step in range(steps))
    wrapped = model if algorithm is None else bxt.wrap(model, opt, algorithm=algorithm)
    dist.barrier()
    start = time.perf_counter()
    for xb, yb in batches:
        opt.zero_grad()
        F.cross_entropy(wrapped(xb), yb).backward()
        opt.step()
    dist.barrier()
    wall = torch.tensor([time.perf_counter() - start])
    stats = torch.zeros(2)
    if args.model == "digits":
        with torch.no_grad():
            x_te, y_te = torch.from_numpy(data[2][rank::world]), torch.from_numpy(data[3][rank::world])
            stats = torch.tensor([float((model(x_te).argmax(1) == y_te).sum()), float(len(y_te))])
    if algorithm is not None:
        wrapped.shutdown()
    dist.all_reduce(stats)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    return {"setting": name, "steps": steps, "wall_s": float(wall[0]),
            "accuracy": float(stats[0] / stats[1]) if stats[1] else float("nan")}


# -- JAX -----------------------------------------------------------------------------------------------------


def jax_run(name, algorithm, steps, args, data) -> dict:
    import jax
    import optax
    from jax.experimental import multihost_utils

    import bagua_x.jax as bxj
    from bagua_x.algorithms import Target
    from bagua_x.apps.demo_jax import init_mlp, logits

    rank, world = jax.process_index(), jax.process_count()
    if args.model == "digits":
        def loss_fn(p, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(logits(p, x), y).mean()

        params = init_mlp(jax.random.PRNGKey(args.seed), 256)
        tx = optax.sgd(args.lr, momentum=0.9)
        batches = list(rank_batches(data[0], data[1], rank, world, args.batch, steps + 1, args.seed))
    else:
        from bagua_x.apps.benchmarks.jax_zoo import batch, build

        params, stats, apply = build("transformer", args.seed)  # no batch statistics: stats stays empty

        def loss_fn(p, x, y):
            return optax.softmax_cross_entropy_with_integer_labels(apply(p, stats, x)[0], y).mean()

        tx = optax.adamw(1e-4)
        batches = [batch("transformer", rank + world * step) for step in range(steps + 1)]
    dp = None if algorithm is None else bxj.wrap(params, algorithm=algorithm, axis_name="batch")

    def step(p, o, state, x, y):
        grads = jax.grad(loss_fn)(p, x, y)
        if dp is not None and (algorithm.target is Target.GRAD or algorithm.averages_gradients_in_node):
            grads, state = dp.reduce_gradients(grads, state)  # DiLoCo: the node's mean (identity when flat)
        updates, o = tx.update(grads, o, p)
        p = optax.apply_updates(p, updates)
        if dp is not None and algorithm.target is Target.WEIGHT:
            p, state = dp.sync_params(p, state)
        return p, o, state

    pstep = jax.pmap(step, axis_name="batch")
    # DiLoCo's family through dp.step: one program per branch, none holding a switch (a plain pmap's
    # lax.switch made every inner step of the transformer 2x slower).  The others as they are: flat, since
    # through dp.step a form trial would take their first 12 steps (minutes at 10 Mbit/s).
    scheduled = dp is not None and hasattr(algorithm, "branch_key")
    train = dp.step(pstep) if scheduled else pstep
    placed = jax.tree.map(lambda a: a[None], params) if dp is None else dp.replicate(params)  # one local device
    initial = (placed, jax.pmap(tx.init)(placed), () if dp is None else dp.init())
    if scheduled:  # two exchange periods from the start, thrown away: every program compiled before the clock
        carry, compiling = initial, time.perf_counter()  # (the first period lands nothing launched before it)
        for xb, yb in itertools.islice(itertools.cycle(batches), 2 * algorithm.sync_every):
            carry = jax.block_until_ready(train(*carry, xb[None], yb[None]))
        if rank == 0:
            print(f"  {name}: programs compiled in {time.perf_counter() - compiling:.1f} s", flush=True)
    carry = jax.block_until_ready(train(*initial, batches[0][0][None], batches[0][1][None]))  # compiles: untimed
    multihost_utils.sync_global_devices("start")
    start = time.perf_counter()
    for xb, yb in batches[1:]:
        carry = jax.block_until_ready(train(*carry, xb[None], yb[None]))
    multihost_utils.sync_global_devices("end")
    wall = time.perf_counter() - start
    mine = np.asarray([0.0, 0.0, wall])
    if args.model == "digits":
        own = jax.tree.map(lambda a: np.asarray(a)[0], carry[0])
        x_te, y_te = data[2][rank::world], data[3][rank::world]
        mine[:2] = float((np.asarray(logits(own, x_te)).argmax(1) == y_te).sum()), len(y_te)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(world, 3)
    return {"setting": name, "steps": steps, "wall_s": float(every[:, 2].max()),
            "accuracy": float(every[:, 0].sum() / every[:, 1].sum()) if every[:, 1].sum() else float("nan")}


# -- the table -----------------------------------------------------------------------------------------------


def table(rows) -> str:
    head = f"{'setting':28s} {'steps':>6s} {'step ms':>9s} {'utilisation':>11s} {'accuracy':>8s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['setting']:28s} {r['steps']:6d} {r['step_ms']:9.1f} {r['utilisation']:11.1%} "
                     f"{r['accuracy']:8.3f}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frontend", choices=("torch", "jax"), default="torch")
    parser.add_argument("--model", choices=("digits", "transformer"), default="digits")
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--per-step-steps", type=int, default=None,
                        help="steps for the settings that communicate every step (default: --steps)")
    parser.add_argument("--h", type=int, default=32)
    parser.add_argument("--flat", action="store_true", help="DiLoCo and SparseLoCo flat: every rank a worker")
    parser.add_argument("--only", nargs="+", metavar="PREFIX",
                        help="only the settings whose names start so (e.g. DiLoCo SparseLoCo); compute only always")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.frontend == "jax":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import bagua_x.jax as bxj

        bxj.init_distributed()
        import jax

        rank, run = jax.process_index(), jax_run
    else:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        rank, run = dist.get_rank(), torch_run
    data = load_digits_split(args.seed) if args.model == "digits" else None
    rows = []
    for name, algorithm, every_step in settings(args.h, args.flat):
        if algorithm is not None and args.only and not name.startswith(tuple(args.only)):
            continue
        steps = args.per_step_steps if every_step and args.per_step_steps else args.steps
        rows.append(run(name, algorithm, steps, args, data))
        rows[-1]["step_ms"] = 1000 * rows[-1]["wall_s"] / steps
        if rank == 0:
            print(f"  {name}: {rows[-1]['step_ms']:.1f} ms a step", flush=True)
    for r in rows:
        r["utilisation"] = rows[0]["step_ms"] / r["step_ms"]
    if rank == 0:
        link = os.environ.get("BAGUA_X_LINK", "loopback")
        print(f"slow link: {args.frontend}, link {link}, model {args.model}, H={args.h}\n" + table(rows), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"frontend": args.frontend, "model": args.model, "link": link, "h": args.h, "rows": rows},
                          f, indent=1)


if __name__ == "__main__":
    main()
