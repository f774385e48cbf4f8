"""TorchCommunicator against numpy, on 2 real gloo ranks (shape conventions of core/comm.py)."""

import os

import numpy as np
import pytest

from launch import run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": HERE}


@pytest.fixture(scope="module")
def results():
    return run_workers("bx_torch_workers:communicator_ops", nproc=2, timeout=120, env=ENV)


def test_communicator_matches_numpy(results):
    from bx_torch_workers import rank_data

    size = 2
    xs = [rank_data(r, (size, 6)) for r in range(size)]
    us = [rank_data(r, (size, 5), "uint8") for r in range(size)]
    stack = np.stack(xs)
    for r, out in enumerate(results):
        assert (out["rank"], out["size"]) == (r, size)
        np.testing.assert_allclose(out["allreduce_sum"], stack.sum(0), rtol=1e-6)
        np.testing.assert_allclose(out["allreduce_avg"], stack.mean(0), rtol=1e-6)
        np.testing.assert_array_equal(out["allreduce_min"], stack.min(0))
        np.testing.assert_array_equal(out["allreduce_max"], stack.max(0))
        np.testing.assert_allclose(out["reduce_scatter_sum"], stack.sum(0)[r], rtol=1e-6)
        np.testing.assert_allclose(out["reduce_scatter_avg"], stack.mean(0)[r], rtol=1e-6)
        np.testing.assert_array_equal(out["reduce_scatter_min"], stack.min(0)[r])
        np.testing.assert_array_equal(out["reduce_scatter_max"], stack.max(0)[r])
        np.testing.assert_array_equal(out["allreduce_int_avg"], [(1 + 4) // 2])
        np.testing.assert_array_equal(out["allgather"], stack)
        np.testing.assert_array_equal(out["allgather_u8"], np.stack(us))
        assert out["allgather_u8"].dtype == np.uint8
        np.testing.assert_array_equal(out["alltoall"], np.stack([xs[i][r] for i in range(size)]))
        np.testing.assert_array_equal(out["alltoall_u8"], np.stack([us[i][r] for i in range(size)]))
        assert out["alltoall_u8"].dtype == np.uint8
        np.testing.assert_array_equal(out["broadcast"], xs[1])
        np.testing.assert_array_equal(out["permute_ring"], xs[(r - 1) % size])
        np.testing.assert_array_equal(out["permute_ring_u8"], us[(r - 1) % size])
        np.testing.assert_array_equal(out["permute_self"], xs[r])
        np.testing.assert_array_equal(out["permute_partial"], xs[0] if r == 1 else np.zeros_like(xs[r]))
        np.testing.assert_array_equal(out["switch"], [2.0, 2.0])
        assert out["input_untouched"], "a collective modified its (undonated) input"
        assert out["donated_in_place"]
        assert "world size 2" in out["bad_rows"] and "BaguaXError" in out["bad_rows"]
        assert out["bf16_avg"][0] == "torch.bfloat16"
        np.testing.assert_array_equal(out["bf16_avg"][1], [1.5] * 3)
