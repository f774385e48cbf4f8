"""The orbax checkpoint loop of tests/jax/test_jax_orbax.py, importable by the 2-process workers too."""

from __future__ import annotations

import bx_jax_workers as w

ITEMS = ("params", "opt_state", "bagua_x")


def global_rows(tree, back: bool = False):
    """pmap-layout arrays as global arrays with one row per device of every process, or ``back`` again.

    The mesh lists ``jax.devices()`` in order, which puts each process's devices where pmap numbers them.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    specs = jax.tree.map(lambda _: PartitionSpec("batch"), tree)
    if back:
        return multihost_utils.global_array_to_host_local_array(tree, mesh, specs)
    return multihost_utils.host_local_array_to_global_array(tree, mesh, specs)


def orbax_pmap(dp, params, x, y, start: int, stop: int, directory, restore: tuple = (), save: bool = False):
    """Steps ``start..stop`` of the pmap loop of ``w.training_step``, with orbax checkpoints in ``directory``.

    ``restore`` names the items of step ``start``'s checkpoint to continue from (the others start fresh, from
    ``params`` and ``dp.init()``); ``save`` writes step ``stop``'s.

    pmap's arrays (a leading axis of this process's devices) are process-local: across processes orbax
    refuses them.  :func:`global_rows` makes them one global array whose rows are every device's copy
    (no host copy: each device's row becomes its shard), which orbax saves each process its own rows of,
    and restores onto the sharding of the fresh tree given as the target.
    Returns the items, this process's devices' copies, as numpy.
    """
    import jax
    import orbax.checkpoint as ocp

    tx, step = w.training_step(dp, 1e-2)
    carry = dict(zip(ITEMS, (dp.replicate(params), dp.replicate(tx.init(params)), dp.init())))
    with ocp.CheckpointManager(directory) as manager:
        if restore:
            targets = {name: jax.tree.map(ocp.utils.to_shape_dtype_struct, global_rows(carry[name]))
                       for name in restore}
            saved = manager.restore(start, args=ocp.args.Composite(
                **{name: ocp.args.StandardRestore(target) for name, target in targets.items()}))
            carry.update({name: global_rows(saved[name], back=True) for name in restore})
        f = jax.pmap(step, axis_name="batch")
        for s in range(start, stop):
            carry = dict(zip(ITEMS, jax.block_until_ready(f(*carry.values(), x[s], y[s]))))  # w._one_step_in_flight
        if save:
            manager.save(stop, args=ocp.args.Composite(
                **{name: ocp.args.StandardSave(global_rows(t)) for name, t in carry.items()}))
    return jax.tree.map(w._host_local, carry)


def interrupted(algorithm, directory, total: int, k: int, restore: tuple = ITEMS, ranks: int = 1):
    """The uninterrupted ``total`` steps, and ``k`` steps, a checkpoint, and the rest from its ``restore`` items.

    With ``ranks`` processes each feeds its own devices' part of the batch.
    """
    import os

    import jax

    import bagua_x.jax as bxj

    params = w.make_params(0)
    x, y = w.make_data(total, 4)
    local = 4 // ranks
    x, y = (a[:, local * jax.process_index():local * (jax.process_index() + 1)] for a in (x, y))
    full = orbax_pmap(bxj.wrap(params, algorithm=algorithm), params, x, y, 0, total,
                      os.path.join(directory, "uninterrupted"))
    run = os.path.join(directory, "run")
    orbax_pmap(bxj.wrap(params, algorithm=algorithm), params, x, y, 0, k, run, save=True)
    # a fresh wrap and other initial params: what matters must come from the checkpoint
    resumed = orbax_pmap(bxj.wrap(params, algorithm=algorithm), w.make_params(1), x, y, k, total, run, restore=restore)
    return full, resumed


@w._multiprocess
def orbax_resume_worker(algorithm, total: int, k: int, directory: str):
    """:func:`interrupted` across 2 processes writing one checkpoint (each its own devices' rows)."""
    return interrupted(algorithm, directory, total, k, ranks=2)
