"""Checkpoints through orbax: params, optimizer state and bagua_x state saved as one composite with
``ocp.CheckpointManager`` and restored into a fresh wrap with other initial params continue bitwise identically
to an uninterrupted run (pmap over 4 CPU devices, and over 2 processes), for the algorithms whose state carries
the training: LowPrecisionDecentralized (its weight copies w, left, right in the bagua_x state) and QAdam
(momentum and variance in ``dp.optimizer()``'s optimizer state)."""

import os

import jax
import numpy as np
import pytest

from bagua_x.algorithms import LowPrecisionDecentralized, QAdam

pytest.importorskip("orbax.checkpoint", reason="needs orbax-checkpoint: pip install -e '.[flax]'")
from bx_jax_orbax_workers import ITEMS, interrupted  # noqa: E402  (after the skip: it imports orbax)

CASES = {
    "lowprec": LowPrecisionDecentralized(),
    "qadam-stop-in-warmup": QAdam(lr=1e-2, warmup_steps=4),
    "qadam-stop-after-warmup": QAdam(lr=1e-2, warmup_steps=2),
}
TOTAL, K = 6, 3


def assert_items_equal(full, resumed, what, devices=4):
    assert jax.tree.structure(full) == jax.tree.structure(resumed), what
    leaves = jax.tree_util.tree_flatten_with_path(full)[0]
    # params (4 leaves), adam or QAdam state, and LowPrecisionDecentralized's step, w, left, right
    assert len(leaves) >= 4 + 3 + (4 if "lowprec" in what else 0), [jax.tree_util.keystr(p) for p, _ in leaves]
    for (path, a), b in zip(leaves, jax.tree.leaves(resumed)):
        assert a.shape[0] == devices and a.shape == b.shape and a.dtype == b.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(a, b, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("name", list(CASES))
def test_orbax_resume_is_bitwise_identical(name, tmp_path):
    full, resumed = interrupted(CASES[name], str(tmp_path), TOTAL, K, ITEMS)
    assert_items_equal(full, resumed, name)


def test_without_the_bagua_x_state_lowprec_resumes_elsewhere(tmp_path):
    """The control: its weight copies started afresh (from the step-0 params), the run continues differently."""
    full, resumed = interrupted(CASES["lowprec"], str(tmp_path), TOTAL, K, ("params", "opt_state"))
    differing = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(full["params"]),
                                                             jax.tree.leaves(resumed["params"]))]
    assert len(differing) == 4 and all(differing)


def test_orbax_resume_across_two_processes(tmp_path):
    from launch import run_workers

    env = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    results = run_workers("bx_jax_orbax_workers:orbax_resume_worker", nproc=2, timeout=240, env=env,
                          args=(CASES["lowprec"], TOTAL, K, str(tmp_path)))
    assert len(results) == 2
    for full, resumed in results:
        assert_items_equal(full, resumed, "lowprec, 2 processes", devices=2)
