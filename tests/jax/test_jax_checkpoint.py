"""Resuming from a checkpoint of params, optimizer state and bagua_x state (``np.savez`` of their leaves)
continues bitwise identically to an uninterrupted run, for every algorithm (pmap over 4 CPU devices)."""

import os

import jax
import numpy as np
import pytest

import bx_jax_workers as w
from bagua_x.algorithms import (
    ByteGrad, Decentralized, GradientAllReduce, LowPrecisionDecentralized, ModelAverage, QAdam,
)
from bagua_x.jax import wrap

CASES = {
    "allreduce": GradientAllReduce(),
    "bytegrad": ByteGrad(),
    "decentralized-all": Decentralized(),
    "decentralized-shift_one-2": Decentralized(peer_selection_mode="shift_one", communication_interval=2),
    "lowprec": LowPrecisionDecentralized(),
    "model_average-2": ModelAverage(period=2),
    "qadam-stop-in-warmup": QAdam(lr=1e-2, warmup_steps=4),
    "qadam-stop-after-warmup": QAdam(lr=1e-2, warmup_steps=2),
}


def assert_trees_equal(a, b, what):
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    assert jax.tree.leaves(a), f"{what}: no leaves to compare"
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("name", list(CASES))
def test_resume_is_bitwise_identical(name, tmp_path):
    total, k = 6, 3
    params = w.make_params(0)
    x, y = w.make_data(total, 4)
    path = str(tmp_path / "checkpoint.npz")
    full = w.resumable_pmap(wrap(params, algorithm=CASES[name]), params, x, y, 0, total)
    w.resumable_pmap(wrap(params, algorithm=CASES[name]), params, x, y, 0, k, save=path)
    # a fresh wrap and other initial params: everything must come from the checkpoint
    resumed = w.resumable_pmap(wrap(params, algorithm=CASES[name]), w.make_params(1), x, y, k, total, load=path)
    assert_trees_equal(full, resumed, name)


def test_resume_across_two_processes(tmp_path):
    from launch import run_workers

    env = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    algorithm = QAdam(lr=1e-2, warmup_steps=2)
    results = run_workers("bx_jax_workers:resume_worker", nproc=2, timeout=240, env=env,
                          args=(algorithm, 5, 3, str(tmp_path)))
    assert len(results) == 2
    for full, resumed in results:
        assert_trees_equal(full, resumed, "2 processes")
