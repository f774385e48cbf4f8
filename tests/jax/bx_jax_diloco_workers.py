"""DiLoCo through the JAX frontend: training loops (pmap, shard_map), the independent references, and the
multi-process worker.

A DiLoCo worker is a device (or a node of devices, two levels): each runs its own optax inner optimizer on its
own data, and ``dp.sync_params`` after every optimizer step does the outer exchange every H steps.  The
references know nothing of bagua_x's wrap: N copies of the params, each with its own optax state, and after every
inner step either the numpy ``DiLoCoWorkers`` on the flattened weights, or (plain DiLoCo) an optax
``sgd(nesterov=True)`` outer step on the global copy with gradient ``global - mean(local)``.
"""

from __future__ import annotations

import numpy as np

import bx_jax_workers as w

N = 4


def inner_optimizer():
    import optax

    return optax.adam(1e-2)


def inner_step(dp, tx, node_mean: bool):
    """One device's inner step: gradient (``node_mean``: averaged inside the node, ``dp.reduce_gradients``),
    optax update, then ``dp.sync_params`` (DiLoCo's phase: after the optimizer step)."""
    import jax
    import optax

    def step(p, o, st, xb, yb):
        g = jax.grad(w.loss_fn)(p, xb, yb)
        if node_mean:
            g, st = dp.reduce_gradients(g, st)
        u, o = tx.update(g, o, p)
        p, st = dp.sync_params(optax.apply_updates(p, u), st)
        return p, o, st

    return step


def flat_of(dp, tree) -> np.ndarray:
    """The single bucket's flat float32 vector of ``tree`` (numpy), in wrap's bucket order."""
    import jax

    (bucket,), (layout,) = dp.bucket_leaves, dp.layouts
    leaves = [np.asarray(a, np.float32) for a in jax.tree.leaves(tree)]
    return np.asarray(layout.pack([leaves[i] for i in bucket]))


def tree_of(dp, flat, like):
    import jax

    (bucket,), (layout,) = dp.bucket_leaves, dp.layouts
    leaves = [np.asarray(a) for a in jax.tree.leaves(like)]
    for i, v in zip(bucket, layout.unpack(np.asarray(flat))):
        leaves[i] = np.asarray(v).reshape(leaves[i].shape)
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def reference(dp, alg, params, x, y, workers: int = N, outer: str = "numpy"):
    """Every step's per-worker weights (a list of lists of flat vectors): ``workers`` copies, worker ``k`` training
    on the mean gradient of devices ``[k * d, (k + 1) * d)`` (d = devices per worker, 1 unless two levels).

    ``outer="numpy"``: :class:`bagua_x.testing.reference.DiLoCoWorkers`; ``"optax"`` (plain DiLoCo only): an optax
    SGD with Nesterov momentum on a global copy, gradient ``global - mean(local)``, every H steps.
    """
    import jax
    import optax

    from bagua_x.testing.reference import DiLoCoWorkers

    tx = inner_optimizer()
    per = x.shape[1] // workers
    grad = jax.jit(jax.grad(w.loss_fn))

    @jax.jit
    def update(p, o, g):
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    copies, opts = [params] * workers, [tx.init(params)] * workers
    x0 = flat_of(dp, params)
    if outer == "numpy":
        ref = DiLoCoWorkers.like(alg, x0, workers)
    else:
        assert alg.fragments == 1 and alg.bits == 32 and alg.compression is None and alg.nesterov
        otx = optax.sgd(alg.outer_lr, momentum=alg.outer_momentum, nesterov=True)
        glob = x0
        ostate = otx.init(glob)
    history = []
    for s in range(x.shape[0]):
        for k in range(workers):
            gs = [grad(copies[k], x[s, d], y[s, d]) for d in range(k * per, (k + 1) * per)]
            g = jax.tree.map(lambda *a: sum(a[1:], a[0]) / len(a), *gs) if per > 1 else gs[0]
            copies[k], opts[k] = update(copies[k], opts[k], g)
        flats = [flat_of(dp, c) for c in copies]
        if outer == "numpy":
            flats = ref.after_step(flats)
        elif (s + 1) % alg.sync_every == 0:
            pseudo = glob - np.mean(np.stack(flats), axis=0)
            u, ostate = otx.update(pseudo, ostate, glob)
            glob = np.asarray(optax.apply_updates(glob, u))
            flats = [glob.copy() for _ in flats]
        copies = [tree_of(dp, f, params) for f in flats]
        history.append(flats)
    return history


def diloco_pmap(dp, params, x, y, node_mean: bool = False):
    """The steps under pmap (``node_mean``: see :func:`inner_step`); every step's per-device flat weights of this
    process's devices."""
    import jax

    tx = inner_optimizer()
    carry = dp.replicate(params), dp.replicate(tx.init(params)), dp.init()
    f = jax.pmap(inner_step(dp, tx, node_mean), axis_name=dp.axis_name)
    history = []
    for s in range(x.shape[0]):
        carry = jax.block_until_ready(f(*carry, x[s], y[s]))
        p = jax.tree.map(w._host_local, carry[0])
        history.append([flat_of(dp, jax.tree.map(lambda a, i=i: a[i], p)) for i in range(x.shape[1])])
    return history


def diloco_shard_map(dp, params, x, y, mesh, node_mean: bool = False):
    """The same under ``jax.jit(jax.shard_map(...))`` over a 1-D mesh: params, optimizer and bagua_x state one
    copy per device (``P(axis)``, indexed ``[0]`` inside).  Every step's per-device flat weights."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    tx, axis = inner_optimizer(), dp.axis_name
    inner = inner_step(dp, tx, node_mean)
    own = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
    back = lambda t: jax.tree.map(lambda a: a[None], t)  # noqa: E731

    def step(p, o, st, xb, yb):
        return back(inner(own(p), own(o), own(st), xb[0], yb[0]))

    spec = P(axis)
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))
    p, o = dp.replicate(params, mesh, per_device=True), dp.replicate(tx.init(params), mesh, per_device=True)
    st = dp.init(mesh=mesh)
    data = NamedSharding(mesh, spec)
    history = []
    for s in range(x.shape[0]):
        xs, ys = (jax.device_put(a[s], data) for a in (x, y))
        p, o, st = jax.block_until_ready(f(p, o, st, xs, ys))
        host = jax.tree.map(np.asarray, p)
        history.append([flat_of(dp, jax.tree.map(lambda a, i=i: a[i], host)) for i in range(x.shape[1])])
    return history


@w._multiprocess
def diloco_worker(cases: dict, steps: int):
    """DiLoCo over 2 processes x 2 devices under pmap (LOCAL_WORLD_SIZE=1: a process is a node of 2 devices),
    gradients through ``dp.reduce_gradients``: per case, every step's weights of all 4 devices, gathered
    (``(steps, 4, numel)``)."""
    import jax
    from jax.experimental import multihost_utils

    import bagua_x.jax as bxj
    from bagua_x.algorithms import DiLoCo

    rank = jax.process_index()
    params = w.make_params(0)
    x, y = w.make_data(steps, 4)
    out = {}
    for name, kw in cases.items():
        dp = bxj.wrap(params, algorithm=DiLoCo(**kw))
        history = diloco_pmap(dp, params, x[:, 2 * rank:2 * rank + 2], y[:, 2 * rank:2 * rank + 2], node_mean=True)
        mine = np.stack([np.stack(h) for h in history])  # (steps, 2 devices, numel)
        every = np.asarray(multihost_utils.process_allgather(mine[None], tiled=True))  # (2 processes, steps, 2, numel)
        out[name] = np.concatenate([every[0], every[1]], axis=1)
    return out
