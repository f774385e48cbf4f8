"""Checkpoints through orbax: params, optimizer state and bagua_x state saved as one composite with
``ocp.CheckpointManager`` and restored into a fresh wrap with other initial params continue bitwise identically
to an uninterrupted run (pmap over 4 CPU devices), for the algorithms whose state carries the training:
LowPrecisionDecentralized (its weight copies w, left, right in the bagua_x state) and QAdam (momentum and
variance in ``dp.qadam()``'s optimizer state)."""

import jax
import numpy as np
import pytest

import bx_jax_workers as w
from bagua_x.algorithms import LowPrecisionDecentralized, QAdam
from bagua_x.jax import wrap

ocp = pytest.importorskip("orbax.checkpoint", reason="needs orbax-checkpoint: pip install -e '.[flax]'")

ITEMS = ("params", "opt_state", "bagua_x")
CASES = {
    "lowprec": LowPrecisionDecentralized(),
    "qadam-stop-in-warmup": QAdam(lr=1e-2, warmup_steps=4),
    "qadam-stop-after-warmup": QAdam(lr=1e-2, warmup_steps=2),
}
TOTAL, K = 6, 3


def orbax_pmap(dp, params, x, y, start: int, stop: int, directory, restore: tuple = (), save: bool = False):
    """Steps ``start..stop`` of the pmap loop of ``w.training_step``, with orbax checkpoints in ``directory``.

    ``restore`` names the items of step ``start``'s checkpoint to continue from (the others start fresh, from
    ``params`` and ``dp.init()``); ``save`` writes step ``stop``'s.  The pmap layout (a leading device axis,
    sharded along it) round-trips as it is, no host copy: orbax saves each device's row as a shard of a
    global array and restores onto the sharding of the fresh tree given as the target.
    Returns the items, every device's copy, as numpy.
    """
    tx, step = w.training_step(dp, 1e-2)
    carry = dict(zip(ITEMS, (dp.replicate(params), dp.replicate(tx.init(params)), dp.init())))
    with ocp.CheckpointManager(directory) as manager:
        if restore:
            targets = {name: jax.tree.map(ocp.utils.to_shape_dtype_struct, carry[name]) for name in restore}
            saved = manager.restore(start, args=ocp.args.Composite(
                **{name: ocp.args.StandardRestore(target) for name, target in targets.items()}))
            carry.update({name: saved[name] for name in restore})
        f = jax.pmap(step, axis_name="batch")
        for s in range(start, stop):
            carry = dict(zip(ITEMS, jax.block_until_ready(f(*carry.values(), x[s], y[s]))))  # w._one_step_in_flight
        if save:
            manager.save(stop, args=ocp.args.Composite(**{name: ocp.args.StandardSave(t) for name, t in carry.items()}))
    return jax.tree.map(np.asarray, carry)


def interrupted(name, tmp_path, restore: tuple):
    """The uninterrupted ``TOTAL`` steps, and ``K`` steps, a checkpoint, and the rest from its ``restore`` items."""
    params = w.make_params(0)
    x, y = w.make_data(TOTAL, 4)
    full = orbax_pmap(wrap(params, algorithm=CASES[name]), params, x, y, 0, TOTAL, tmp_path / "uninterrupted")
    orbax_pmap(wrap(params, algorithm=CASES[name]), params, x, y, 0, K, tmp_path / "run", save=True)
    # a fresh wrap and other initial params: what matters must come from the checkpoint
    resumed = orbax_pmap(wrap(params, algorithm=CASES[name]), w.make_params(1), x, y, K, TOTAL, tmp_path / "run",
                         restore=restore)
    return full, resumed


@pytest.mark.parametrize("name", list(CASES))
def test_orbax_resume_is_bitwise_identical(name, tmp_path):
    full, resumed = interrupted(name, tmp_path, ITEMS)
    assert jax.tree.structure(full) == jax.tree.structure(resumed), name
    leaves = jax.tree_util.tree_flatten_with_path(full)[0]
    # params (4 leaves), adam or QAdam state, and LowPrecisionDecentralized's step, w, left, right
    assert len(leaves) >= 4 + 3 + (4 if name == "lowprec" else 0), [jax.tree_util.keystr(p) for p, _ in leaves]
    for (path, a), b in zip(leaves, jax.tree.leaves(resumed)):
        assert a.shape[0] == 4 and a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: {jax.tree_util.keystr(path)}")


def test_without_the_bagua_x_state_lowprec_resumes_elsewhere(tmp_path):
    """The control: its weight copies started afresh (from the step-0 params), the run continues differently."""
    full, resumed = interrupted("lowprec", tmp_path, ("params", "opt_state"))
    differing = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(full["params"]),
                                                             jax.tree.leaves(resumed["params"]))]
    assert len(differing) == 4 and all(differing)
