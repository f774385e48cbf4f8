"""Shared pieces of the JAX tests: a small MLP, reference loops, and the multi-process workers.

Workers run in ``tests.launch.run_workers`` subprocesses with 2 CPU devices each
(XLA_FLAGS) and ``bagua_x.jax.init_distributed()`` from the torchrun-style env.
Single-process tests import the same model and loops, so both check one thing.
"""

from __future__ import annotations

import functools

import numpy as np

IN, HIDDEN, OUT = 6, 16, 3


def make_params(seed: int):
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "l1": {"w": jax.random.normal(k1, (IN, HIDDEN)) * 0.4, "b": jnp.zeros(HIDDEN)},
        "l2": {"w": jax.random.normal(k2, (HIDDEN, OUT)) * 0.3, "b": jnp.zeros(OUT)},
    }


def loss_fn(params, x, y):
    import jax
    import jax.numpy as jnp

    h = jax.nn.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    out = h @ params["l2"]["w"] + params["l2"]["b"]
    return jnp.mean((out - y) ** 2)


# _one_step_in_flight: the loops below wait for each step before dispatching the next.  With more
# forced CPU devices than cores (4 on this 2-core machine) and several pmap steps in flight, XLA's
# CPU runtime (jaxlib 0.10.2) can deadlock under load: two devices wait at a collective's rendezvous
# while the other two never start ("Termination timeout for `all reduce RendezvousKey...`", abort).
# Seen only with steps pipelined; one step in flight never hung in stress runs.


def make_data(steps: int, ndev: int, per_device: int = 8, seed: int = 1):
    """Per-step global batches ``(steps, ndev, per_device, ...)`` of a fixed random regression task."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(IN, OUT)).astype(np.float32)
    x = rng.normal(size=(steps, ndev, per_device, IN)).astype(np.float32)
    return x, np.tanh(x @ teacher).astype(np.float32)


def reference_pmap(params, x, y, lr: float = 1e-2):
    """The plain data-parallel loop bagua_x must match: lax.pmean of grads, then optax.adam."""
    import jax
    import optax

    tx = optax.adam(lr)

    def step(p, o, xb, yb):
        g = jax.grad(loss_fn)(p, xb, yb)
        g = jax.lax.pmean(g, "batch")
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    n = x.shape[1]
    stack = lambda t: jax.tree.map(lambda a: np.stack([np.asarray(a)] * n), t)  # noqa: E731
    p, o = stack(params), stack(tx.init(params))
    f = jax.pmap(step, axis_name="batch")
    for s in range(x.shape[0]):
        p, o = jax.block_until_ready(f(p, o, x[s], y[s]))  # see _one_step_in_flight
    return jax.tree.map(lambda a: np.asarray(a[0]), p)


def training_step(dp, lr: float, chain: bool = False, traces: list | None = None, sgd: bool = False):
    """The optimizer and the per-device step of the loops below (``traces`` counts tracings).

    Gradient algorithms: reduce_gradients then adam (``sgd``: plain SGD, which, unlike
    Adam, shows a gradient of the wrong scale), or (``chain``)
    ``optax.chain(dp.gradient_transformation(), adam)``; weight algorithms:
    sync_params where their phase says; QAdam: ``dp.optimizer()`` as the optimizer
    (each call refuses the algorithms it does not communicate for).
    """
    import jax
    import optax

    from bagua_x.algorithms import Phase, Target

    target = dp.algorithm.target
    inner = optax.sgd(lr) if sgd else optax.adam(lr)
    if target is Target.MOMENTUM:
        tx = dp.optimizer()
    else:
        tx = optax.chain(dp.gradient_transformation(), inner) if chain else inner
    weights = target is Target.WEIGHT
    sync_first = weights and dp.algorithm.phase is Phase.BEFORE_FORWARD

    def step(p, o, st, xb, yb):
        if traces is not None:
            traces.append(1)
        g = jax.grad(loss_fn)(p, xb, yb)
        if (target is Target.GRAD and not chain) or dp.algorithm.averages_gradients_in_node:  # DiLoCo: node mean
            g, st = dp.reduce_gradients(g, st)
        if sync_first:
            p, st = dp.sync_params(p, st)
        u, o = tx.update(g, o, p)
        p = optax.apply_updates(p, u)
        if weights and not sync_first:
            p, st = dp.sync_params(p, st)
        return p, o, st

    return tx, step


def bagua_pmap(dp, params, x, y, lr: float = 1e-2, chain: bool = False, traces: list | None = None,
               every_device: bool = False, sgd: bool = False):
    """Train with ``dp`` under pmap, as a user would (the demo's loop; see :func:`training_step`).
    Returns the first device's params, or with ``every_device`` all of them.
    """
    import jax

    tx, step = training_step(dp, lr, chain, traces, sgd)
    p = dp.replicate(params)
    o, st = dp.replicate(tx.init(params)), dp.init()
    f = jax.pmap(step, axis_name="batch")
    for s in range(x.shape[0]):
        p, o, st = jax.block_until_ready(f(p, o, st, x[s], y[s]))  # see _one_step_in_flight
    if every_device:
        return jax.tree.map(np.asarray, p)
    return jax.tree.map(np.asarray, dp.unreplicate(p))


def bagua_shard_map(dp, params, x, y, mesh, lr: float = 1e-2, through_step: bool = False):
    """The same training under jax.jit(jax.shard_map(...)) on ``mesh``, data sharded along "batch" (called
    through ``dp.step`` with ``through_step``).

    Gradient algorithms: params and optimizer state replicated (``P()``), the
    transformation chained.  Weight algorithms: params, optimizer state and
    bagua_x state per device (``P("batch")``, unstacked inside the step).
    Returns the first device's params.
    """
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bagua_x.algorithms import Phase, Target

    per_device = dp.algorithm.target is Target.WEIGHT
    # weight algorithms communicate in sync_params (their gradient_transformation() raises)
    tx = optax.adam(lr) if per_device else optax.chain(dp.gradient_transformation(), optax.adam(lr))
    sync_first = dp.algorithm.phase is Phase.BEFORE_FORWARD
    own = lambda t: jax.tree.map(lambda a: a[0], t) if per_device else t  # noqa: E731
    back = lambda t: jax.tree.map(lambda a: a[None], t) if per_device else t  # noqa: E731

    def step(p, o, st, xb, yb):
        p, o, st = own(p), own(o), jax.tree.map(lambda a: a[0], st)
        # each device's own gradient: jax.grad with respect to replicated params would sum it over the axis
        g = jax.grad(loss_fn)(p if per_device else jax.lax.pcast(p, "batch", to="varying"), xb[0], yb[0])
        if sync_first:
            p, st = dp.sync_params(p, st)
        u, o = tx.update(g, o, p)
        p = optax.apply_updates(p, u)
        if per_device and not sync_first:
            p, st = dp.sync_params(p, st)
        return back(p), back(o), jax.tree.map(lambda a: a[None], st)

    spec = P("batch") if per_device else P()
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec, P("batch"), P("batch"), P("batch")),
                              out_specs=(spec, spec, P("batch"))))
    if through_step:
        f = dp.step(f)
    p, o = dp.replicate(params, mesh, per_device), dp.replicate(tx.init(params), mesh, per_device)
    st = dp.init(mesh=mesh)
    data = NamedSharding(mesh, P("batch"))
    nlocal = len(mesh.local_devices)
    first = nlocal * jax.process_index()
    for s in range(x.shape[0]):
        xs, ys = (jax.make_array_from_process_local_data(data, a[s][first : first + nlocal], a[s].shape)
                  for a in (x, y))
        p, o, st = jax.block_until_ready(f(p, o, st, xs, ys))  # see _one_step_in_flight
    return jax.tree.map(np.asarray, dp.unreplicate(p))


def bagua_jit(dp, params, x, y, mesh, lr: float = 1e-2, seen: list | None = None):
    """:func:`bagua_pmap`'s training (``sgd=True``) in the jit-first style: ``jax.jit`` over ``mesh``, the
    global batch sharded along "batch", ``dp.value_and_grad`` in place of ``jax.value_and_grad``.  With
    ``seen``, called through ``dp.step``, each call's jitted step and arguments appended to it.

    Gradient algorithms: params and SGD state replicated; QAdam: ``dp.optimizer()``
    on per-device gradients; weight algorithms: params and SGD state one copy per
    device, the update vmapped over them, ``dp.sync_params`` where the phase says.
    Returns the first device's params and every step's loss (mean over the devices).
    """
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bagua_x.algorithms import Phase, Target

    target = dp.algorithm.target
    weights = target is Target.WEIGHT
    tx = dp.optimizer() if target is Target.MOMENTUM else optax.sgd(lr)
    update = jax.vmap(tx.update) if weights else tx.update
    sync_first = weights and dp.algorithm.phase is Phase.BEFORE_FORWARD

    @jax.jit
    def step(p, o, st, xb, yb):
        (loss, g), st = dp.value_and_grad(loss_fn)(p, xb, yb, state=st)
        if sync_first:
            p, st = dp.sync_params(p, st)
        u, o = update(g, o, p)
        p = optax.apply_updates(p, u)
        if weights and not sync_first:
            p, st = dp.sync_params(p, st)
        return p, o, st, loss.mean()

    def record(*args):
        seen.append((step, args))
        return step(*args)

    call = step if seen is None else dp.step(record)
    p = dp.replicate(params, mesh, per_device=weights)
    o = dp.replicate(tx.init(params), mesh, per_device=weights or target is Target.MOMENTUM)
    st = dp.init(mesh=mesh)
    data = NamedSharding(mesh, P(dp.axis_name))
    nlocal = len(mesh.local_devices)
    mine = slice(nlocal * jax.process_index(), nlocal * (jax.process_index() + 1))
    losses = []
    for s in range(x.shape[0]):
        xs, ys = (jax.make_array_from_process_local_data(data, a[s][mine].reshape((-1,) + a.shape[3:]),
                                                         (a.shape[1] * a.shape[2],) + a.shape[3:]) for a in (x, y))
        p, o, st, loss = jax.block_until_ready(call(p, o, st, xs, ys))  # see _one_step_in_flight
        losses.append(float(loss))
    return jax.tree.map(np.asarray, dp.unreplicate(p)), losses


# -- AxisCommunicator ops on every device, under pmap and shard_map -----------------------------------------

ROWS = 3  # payload per rank: (size, ROWS)


def rank_inputs(r: int, n: int):
    """Rank ``r``'s float and uint8 payloads (shape (n, ROWS)) and its scalar."""
    x = (np.arange(n * ROWS, dtype=np.float32).reshape(n, ROWS) + 1) * (r + 1) - 7 * r
    u = ((np.arange(n * ROWS).reshape(n, ROWS) * 37 + 101 * r) % 256).astype(np.uint8)
    return x, u


def _ops(x, u):
    import jax.numpy as jnp

    from bagua_x.algorithms import EmptyState, GradientAllReduce
    from bagua_x.core import ReduceOp
    from bagua_x.jax import AxisCommunicator

    c = AxisCommunicator("batch")
    h = AxisCommunicator("batch", local_size=2)  # 2 "nodes" of 2 devices (across processes: the default too)
    n = c.size
    ring = [(i, (i + 1) % n) for i in range(n)]
    # two levels under pmap, flat under shard_map: the same numbers
    hier = lambda v, average: jnp.reshape(GradientAllReduce(average, hierarchical=True).reduce(  # noqa: E731
        jnp.reshape(v, (-1,)), None, EmptyState(), h)[0], v.shape)
    return {
        "hier_sum": hier(x, False), "hier_avg": hier(x, True),
        "hier_odd": hier(x[0], False),  # 3 elements: padded to share among 2 devices
        "rank": c.rank,
        "sum": c.allreduce(x, ReduceOp.SUM), "avg": c.allreduce(x, ReduceOp.AVG),
        "min": c.allreduce(x, ReduceOp.MIN), "max": c.allreduce(x, ReduceOp.MAX),
        "allgather": c.allgather(x), "alltoall": c.alltoall(x),
        "rs_sum": c.reduce_scatter(x, ReduceOp.SUM), "rs_avg": c.reduce_scatter(x, ReduceOp.AVG),
        "rs_max": c.reduce_scatter(x, ReduceOp.MAX),
        "bcast": c.broadcast(x, root=1), "ring": c.permute(x, ring), "partial": c.permute(x, [(0, 2)]),
        "u8_allgather": c.allgather(u), "u8_alltoall": c.alltoall(u), "u8_ring": c.permute(u, ring),
        "u8_bcast": c.broadcast(u, root=n - 1),
        "switch": c.switch(c.rank % 2, [lambda v: v + 1, lambda v: v * 2], x),
        "switch_int": c.switch(1, [lambda v: v + 1, lambda v: v * 2], x),
        "switch_dtype": jnp.asarray(c.switch(c.rank % 2, [lambda v: v, lambda v: v + 1], u)),
    }


def expected_ops(n: int) -> dict:
    """What every rank must get, from numpy."""
    xs, us = zip(*(rank_inputs(r, n) for r in range(n)))
    xs, us = np.stack(xs), np.stack(us)
    every = lambda a: np.stack([a] * n)  # noqa: E731
    ring_src = [(r - 1) % n for r in range(n)]
    return {
        "rank": np.arange(n),
        "sum": every(xs.sum(0)), "avg": every(xs.mean(0)), "min": every(xs.min(0)), "max": every(xs.max(0)),
        "hier_sum": every(xs.sum(0)), "hier_avg": every(xs.mean(0)),
        "hier_odd": every(xs[:, 0].sum(0)),
        "allgather": every(xs), "alltoall": xs.transpose(1, 0, 2),
        "rs_sum": xs.sum(0), "rs_avg": xs.mean(0), "rs_max": xs.max(0),
        "bcast": every(xs[1]), "ring": xs[ring_src],
        "partial": np.stack([xs[0] if r == 2 else np.zeros_like(xs[0]) for r in range(n)]),
        "u8_allgather": every(us), "u8_alltoall": us.transpose(1, 0, 2), "u8_ring": us[ring_src],
        "u8_bcast": every(us[n - 1]),
        "switch": np.stack([xs[r] + 1 if r % 2 == 0 else xs[r] * 2 for r in range(n)]),
        "switch_int": xs * 2,
        "switch_dtype": np.stack([us[r] + (r % 2) for r in range(n)]).astype(np.uint8),
    }


def run_ops() -> dict:
    """``_ops`` under pmap and under shard_map on every device; full (all-rank) numpy results."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    n, nlocal, proc = jax.device_count(), jax.local_device_count(), jax.process_index()
    mine = [rank_inputs(r, n) for r in range(proc * nlocal, (proc + 1) * nlocal)]
    x, u = (np.stack(a) for a in zip(*mine))
    gather = lambda t: jax.tree.map(  # noqa: E731
        lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)) if jax.process_count() > 1
        else np.asarray(a), t)
    results = {"pmap": gather(jax.pmap(_ops, axis_name="batch")(x, u))}
    mesh = jax.make_mesh((n,), ("batch",))
    sharded = NamedSharding(mesh, P("batch"))
    xg, ug = (jax.make_array_from_process_local_data(sharded, a, (n,) + a.shape[1:]) for a in (x, u))
    body = lambda xb, ub: jax.tree.map(lambda v: v[None], _ops(xb[0], ub[0]))  # noqa: E731
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("batch"), P("batch")), out_specs=P("batch")))(xg, ug)
    results["shard_map"] = jax.tree.map(
        lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), out)
    return results


def _multiprocess(fn):
    """Run ``fn`` between ``init_distributed()`` and ``jax.distributed.shutdown()``.

    The shutdown is a barrier: tests/launch.py ends workers with ``os._exit``,
    which skips JAX's atexit shutdown, and a process that exits while its peer
    still reads from it resets the peer's gloo connection.
    """

    @functools.wraps(fn)
    def run(*args):
        import jax

        import bagua_x.jax as bxj

        bxj.init_distributed()
        assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
        try:
            return fn(*args)
        finally:
            jax.distributed.shutdown()

    return run


# -- multi-process workers (2 processes x 2 CPU devices) --------------------------------------------------


@_multiprocess
def communicator_worker():
    """Every AxisCommunicator op across processes, under pmap and shard_map (all ranks' outputs)."""
    return run_ops()


@_multiprocess
def parity_worker(steps: int):
    """bagua_x training vs the plain pmean loop, pmap / chain / shard_map, from per-process random params."""
    import jax

    import bagua_x.jax as bxj
    from bagua_x.jax.placement import from_process0

    rank = jax.process_index()
    params = make_params(seed=100 + rank)  # processes start apart: replicate() must broadcast process 0's
    x, y = make_data(steps, 4)
    local = slice(2 * rank, 2 * rank + 2)
    ref = reference_pmap(from_process0(params), x[:, local], y[:, local])
    dp = bxj.wrap(params)
    out = {
        "ref": ref,
        "pmap": bagua_pmap(dp, params, x[:, local], y[:, local]),
        "chain": bagua_pmap(dp, params, x[:, local], y[:, local], chain=True),
        "packed": dp.pack_buckets,
    }
    mesh = jax.make_mesh((4,), ("batch",))
    out["shard_map"] = bagua_shard_map(dp, params, x, y, mesh)
    from bagua_x.algorithms import ByteGrad, GradientAllReduce

    out["bytegrad"] = bagua_pmap(bxj.wrap(params, algorithm=ByteGrad()), params, x[:, local], y[:, local])
    hierarchical = bxj.wrap(params, algorithm=GradientAllReduce(hierarchical=True))  # LOCAL_WORLD_SIZE=1: 2 nodes
    out["hierarchical"] = bagua_pmap(hierarchical, params, x[:, local], y[:, local])
    out["node_size"] = int(jax.pmap(lambda v: v * 0 + bxj.AxisCommunicator("batch").local_size,
                                    axis_name="batch")(np.zeros(2, np.int32))[0])
    return out


def max_difference(a, b) -> float:
    """The largest difference between two trees of :func:`make_params`'s four leaves, shapes checked first."""
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) == 4
    assert all(np.shape(x) == np.shape(y) for x, y in zip(la, lb))
    return max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y)).max()) for x, y in zip(la, lb))


def jit_first_algorithms() -> dict:
    """One of each kind for the jit-first tests: gradient, momentum (QAdam) and weight algorithms, flat (a 1-D
    mesh has no node groups; the pmap loop they are compared with might otherwise run over nodes)."""
    import dataclasses

    from bagua_x.algorithms import (ByteGrad, Decentralized, DiLoCo, GradientAllReduce, LowPrecisionDecentralized,
                                    ModelAverage, PowerSGD, QAdam, SparseLoCo)

    algorithms = {"allreduce": GradientAllReduce(), "bytegrad": ByteGrad(),
                  "powersgd": PowerSGD(min_compression_rate=1.0), "qadam": QAdam(lr=1e-2, warmup_steps=2),
                  "decentralized": Decentralized(), "low_precision": LowPrecisionDecentralized(),
                  "model_average": ModelAverage(period=2), "diloco": DiLoCo(sync_every=2),
                  "sparseloco": SparseLoCo(sync_every=2, fraction=0.1, chunk=64)}
    return {name: dataclasses.replace(a, hierarchical=False) if hasattr(a, "hierarchical") else a
            for name, a in algorithms.items()}


@_multiprocess
def jit_first_worker(steps: int, lr: float):
    """Every algorithm of :func:`jit_first_algorithms` trained jit-first (:func:`bagua_jit`) and under pmap
    (:func:`bagua_pmap`, SGD) across 2 processes x 2 devices; both results per algorithm."""
    import jax

    import bagua_x.jax as bxj

    params = make_params(seed=100 + jax.process_index())  # replicate() broadcasts process 0's
    x, y = make_data(steps, 4)
    mine = slice(2 * jax.process_index(), 2 * jax.process_index() + 2)
    mesh = jax.make_mesh((4,), ("batch",))
    out = {}
    for name, algorithm in jit_first_algorithms().items():
        jit_params, losses = bagua_jit(bxj.wrap(params, algorithm=algorithm, mesh=mesh), params, x, y, mesh, lr)
        out[name] = {"jit": jit_params, "losses": losses,
                     "pmap": bagua_pmap(bxj.wrap(params, algorithm=algorithm), params, x[:, mine], y[:, mine], lr,
                                        sgd=True)}
        if algorithm.branch_key(0) is not None:  # through dp.step: one branch per program, decided on the host
            seen = []
            out[name]["dp.step"] = bagua_jit(bxj.wrap(params, algorithm=algorithm, mesh=mesh), params, x, y, mesh, lr,
                                             seen=seen)[0]
            out[name]["conditionals"] = [conditionals(fn, args) for fn, args in seen]
    return out


def conditionals(fn, args) -> int:
    """Conditionals (``lax.cond`` / ``lax.switch``) in the program of ``fn(*args)``."""
    import jax

    return str(jax.make_jaxpr(fn)(*args)).count("cond[")


def two_level_algorithms() -> dict:
    """Algorithms with a two-level form, asked for it (hierarchical=True), for the 2-D mesh tests."""
    from bagua_x.algorithms import ByteGrad, Decentralized, DiLoCo, GradientAllReduce, QAdam, SparseLoCo

    return {"allreduce": GradientAllReduce(hierarchical=True), "bytegrad": ByteGrad(hierarchical=True),
            "decentralized": Decentralized(hierarchical=True),
            "qadam": QAdam(lr=1e-2, warmup_steps=2, hierarchical=True),
            "diloco": DiLoCo(sync_every=2, hierarchical=True),
            "sparseloco": SparseLoCo(sync_every=2, fraction=0.1, chunk=64, hierarchical=True)}


def node_mesh():
    """A ("node", "local") mesh with a process's devices as one node (node-major, as the pmap axis)."""
    import jax

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices).reshape(jax.process_count(), -1), ("node", "local"))


@_multiprocess
def two_level_mesh_worker(steps: int, lr: float):
    """Each algorithm of :func:`two_level_algorithms` jit-first on a 2 x 2 ("node", "local") mesh whose nodes
    are the processes, and under pmap with node groups (LOCAL_WORLD_SIZE=1: a process is a node)."""
    import jax

    import bagua_x.jax as bxj

    params = make_params(seed=100 + jax.process_index())
    x, y = make_data(steps, 4)
    mine = slice(2 * jax.process_index(), 2 * jax.process_index() + 2)
    mesh = node_mesh()
    out = {}
    for name, algorithm in two_level_algorithms().items():
        dp = bxj.wrap(params, algorithm=algorithm, axis_name=("node", "local"), mesh=mesh)
        jit_params, losses = bagua_jit(dp, params, x, y, mesh, lr)
        out[name] = {"jit": jit_params, "losses": losses,
                     "pmap": bagua_pmap(bxj.wrap(params, algorithm=algorithm), params, x[:, mine], y[:, mine], lr,
                                        sgd=True)}
    return out


@_multiprocess
def mismatch_worker():
    """Process 1 has a differently shaped leaf: wrap must raise on both processes, naming it."""
    import jax

    import bagua_x.jax as bxj

    params = make_params(0)
    if jax.process_index() == 1:
        params["l2"]["b"] = np.zeros(OUT + 1, np.float32)
    bxj.wrap(params)
    return "no error"


def algorithm_inputs(step: int, n: int, numel: int = 32):
    """Every rank's flat input at ``step`` (the same on every process)."""
    rng = np.random.default_rng(step)
    return [rng.normal(size=numel).astype(np.float32) * (1 + r) for r in range(n)]


@_multiprocess
def algorithms_worker(steps: int):
    """ByteGrad, Decentralized (shift_one), LowPrecisionDecentralized, ModelAverage across processes.

    Returns, per algorithm, every step's outputs of all 4 ranks (gathered), for
    comparison with tests/algorithms/reference.py.
    """
    import jax
    from jax.experimental import multihost_utils

    from bagua_x.algorithms import ByteGrad, Decentralized, LowPrecisionDecentralized, ModelAverage
    from bagua_x.core.bucket import BucketLayout
    from bagua_x.jax import AxisCommunicator

    n, nlocal = jax.device_count(), jax.local_device_count()
    mine = slice(jax.process_index() * nlocal, (jax.process_index() + 1) * nlocal)
    algorithms = {
        "bytegrad": ByteGrad(), "shift_one": Decentralized(peer_selection_mode="shift_one"),
        "lowprec": LowPrecisionDecentralized(), "model_average": ModelAverage(period=2),
    }
    results = {}
    for name, algorithm in algorithms.items():
        layout = BucketLayout(["x"], [(len(algorithm_inputs(0, n)[0]),)], "float32")
        reduce = jax.pmap(lambda x, st, a=algorithm, lay=layout: a.reduce(x, lay, st, AxisCommunicator("batch")),
                          axis_name="batch")
        first = np.stack(algorithm_inputs(0, n)[mine])
        # (a multi-process pmap with no outputs fails in jax 0.10.2: ByteGrad's state is {})
        state = {} if name == "bytegrad" else jax.pmap(lambda x, a=algorithm: a.init(x, layout, n), axis_name="batch")(first)
        outs = []
        for s in range(steps):
            out, state = jax.block_until_ready(reduce(np.stack(algorithm_inputs(s, n)[mine]), state))
            outs.append(np.asarray(multihost_utils.process_allgather(out, tiled=True)))
        results[name] = outs
    return results


# -- checkpoint and resume ------------------------------------------------------------------------


def _host_local(a) -> np.ndarray:
    """This process's rows of a pmap-layout array (all rows in one process), as numpy."""
    shards = sorted(a.addressable_shards, key=lambda s: s.index[0].start or 0)
    # each shard's rows counted from its shape, not reshape(-1, ...): that is ambiguous for an empty leaf
    rows = lambda d: d.shape[0] if d.ndim == a.ndim else 1  # noqa: E731
    return np.concatenate([np.asarray(s.data).reshape((rows(s.data),) + a.shape[1:]) for s in shards])


def resumable_pmap(dp, params, x, y, start: int, stop: int, load: str | None = None, save: str | None = None,
                   lr: float = 1e-2):
    """Steps ``start..stop`` of :func:`bagua_pmap`'s loop, optionally starting from / ending with a checkpoint.

    The checkpoint is what a user would write: ``np.savez`` of the leaves of
    params, optimizer state and bagua_x state (this process's devices), put
    back with the tree structure of a fresh ``replicate`` / ``init``.
    Returns this process's devices' params.
    """
    import jax

    tx, step = training_step(dp, lr)
    carry = (dp.replicate(params), dp.replicate(tx.init(params)), dp.init())
    if load is not None:
        with np.load(load) as saved:
            leaves = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        carry = jax.tree.unflatten(jax.tree.structure(carry), leaves)
    f = jax.pmap(step, axis_name="batch")
    for s in range(start, stop):
        carry = jax.block_until_ready(f(*carry, x[s], y[s]))  # see _one_step_in_flight
    if save is not None:
        np.savez(save, *[_host_local(a) for a in jax.tree.leaves(carry)])
    return jax.tree.map(_host_local, carry[0])


@_multiprocess
def resume_worker(algorithm, total: int, k: int, directory: str):
    """Uninterrupted vs stopped at ``k`` and resumed, across 2 processes (fresh wrap for the resumed part)."""
    import os

    import jax

    import bagua_x.jax as bxj

    rank = jax.process_index()
    params = make_params(0)
    x, y = make_data(total, 4)
    x, y = x[:, 2 * rank:2 * rank + 2], y[:, 2 * rank:2 * rank + 2]
    path = os.path.join(directory, f"process{rank}.npz")
    full = resumable_pmap(bxj.wrap(params, algorithm=algorithm), params, x, y, 0, total)
    resumable_pmap(bxj.wrap(params, algorithm=algorithm), params, x, y, 0, k, save=path)
    resumed = resumable_pmap(bxj.wrap(params, algorithm=algorithm), make_params(1), x, y, k, total, load=path)
    return full, resumed
