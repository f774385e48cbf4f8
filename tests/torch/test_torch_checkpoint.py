"""Stopping after k steps and resuming in fresh processes (model, optimizer and algorithm state dicts)
continues bitwise identically to an uninterrupted run, for every algorithm with deterministic results;
so does loading the checkpoint back into the live wrapper."""

import os

import numpy as np
import pytest

from launch import run_workers

ENV = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}

CASES = {
    "GradientAllReduce": ("GradientAllReduce", {}),
    "ByteGrad": ("ByteGrad", {}),
    "Decentralized": ("Decentralized", {}),
    "DecentralizedShiftOne": ("Decentralized", {"peer_selection_mode": "shift_one", "communication_interval": 2}),
    "LowPrecisionDecentralized": ("LowPrecisionDecentralized", {}),
    "ModelAverage": ("ModelAverage", {"period": 2}),
    "QAdamStopInWarmup": ("QAdam", {"warmup_steps": 4}),  # resumes in warmup, switches afterwards
    "QAdamStopAfterWarmup": ("QAdam", {"warmup_steps": 2}),  # resumes straight into compressed momentum
    # buckets rebuilt in ready order after step 1; PowerSGD's per-bucket state only fits the rebuilt buckets
    "PowerSGDOutOfOrder": ("PowerSGD", {"start_powerSGD_iter": 2}, "out_of_order"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_bitwise_identical(case, tmp_path):
    name, kwargs, *model = CASES[case]
    total, k = 7, 3
    args = (name, kwargs, total, k, str(tmp_path), *model)
    full = run_workers("bx_checkpoint_workers:uninterrupted_and_first_part", nproc=2, timeout=120, env=ENV, args=args)
    resumed = run_workers("bx_checkpoint_workers:resume", nproc=2, timeout=120, env=ENV, args=args)
    assert len(full) == len(resumed) == 2
    for rank, ((uninterrupted, rolled_back), b) in enumerate(zip(full, resumed)):
        assert len(uninterrupted) == len(b) == len(rolled_back) > 0, (len(uninterrupted), len(b), len(rolled_back))
        for i, (x, y, z) in enumerate(zip(uninterrupted, b, rolled_back)):
            np.testing.assert_array_equal(x, y, err_msg=f"{case}: resumed, rank {rank}, parameter {i}")
            np.testing.assert_array_equal(x, z, err_msg=f"{case}: rolled back in place, rank {rank}, parameter {i}")
