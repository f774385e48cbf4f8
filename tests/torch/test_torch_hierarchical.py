"""GradientAllReduce(hierarchical=True): node-local reduce, leaders' allreduce, node-local broadcast."""

import os

import numpy as np

from launch import run_workers

ENV = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)), "LOCAL_WORLD_SIZE": "2"}  # 4 ranks = 2 "nodes"


def test_hierarchical_allreduce_and_training_match_flat():
    results = run_workers("bx_hierarchical_workers:hierarchical", nproc=4, timeout=180, env=ENV)
    inputs = [np.arange(6, dtype=np.float32) * (r + 1) for r in range(4)]
    for r in results:
        np.testing.assert_allclose(r["ops"]["sum"], np.sum(inputs, axis=0), rtol=1e-6)
        np.testing.assert_allclose(r["ops"]["avg"], np.mean(inputs, axis=0), rtol=1e-6)
        np.testing.assert_array_equal(r["ops"]["max"], np.max(inputs, axis=0))
        assert len(r["params"]["ddp"]) == len(r["params"]["bagua_x"]) > 0
        for a, b in zip(r["params"]["ddp"], r["params"]["bagua_x"]):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-6)
