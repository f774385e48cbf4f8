"""wrap()'s surface: clear errors on every rank, checkpoints, algorithm state, Bagua's tensor API."""

import os

import numpy as np

from launch import run_workers

ENV = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}


def test_model_mismatch_fails_on_every_rank():
    results = run_workers("bx_torch_workers:mismatch_error", nproc=2, timeout=60, env=ENV, expect_failure=True)
    messages = []
    for kind, value in results:
        assert kind == "error"
        assert "BaguaXError" in value
        messages.append(value[value.rindex("BaguaXError: "):])
    assert messages[0] == messages[1]
    assert "rank 0: '0.weight' shape (16, 8)" in messages[0]
    assert "rank 1: '0.weight' shape (17, 8)" in messages[0]


def test_algorithm_mismatch_fails_on_every_rank():
    results = run_workers("bx_torch_workers:algorithm_mismatch_error", nproc=2, timeout=60, env=ENV,
                          expect_failure=True)
    for kind, value in results:
        assert kind == "error" and "BaguaXError" in value and "GradientAllReduce" in value and "ByteGrad" in value


def test_api():
    for out in run_workers("bx_torch_workers:api_checks", nproc=2, timeout=90, env=ENV):
        assert out["same_keys"] and out["wrapped_to_bare"] and out["bare_to_wrapped"] and out["module"]
        assert "unused.weight" in out["unused_error"] or "unused.bias" in out["unused_error"]
        assert "find_unused_parameters=True" in out["unused_error"]
        assert "boom" in out["worker_error"] and "communication thread" in out["worker_error"]
        assert "needs the optimizer" in out["no_optimizer_error"]
        assert set(next(iter(out["algo_state_keys"].values()))) == {"step", "w", "left", "right"}
        assert out["algo_step"] == 2 and out["algo_step_restored"] == 2
        assert "nope" in out["bad_algo_state"]
        assert out["decentralized_equal"]


def test_bagua_api():
    for out in run_workers("bx_torch_workers:bagua_api", nproc=2, timeout=60, env=ENV):
        assert not out["installed_before"], "the Bagua API must be opt-in"
        for key in ("returns_self", "ensure_grad_self", "getter", "setter", "storage_view", "dispatched",
                    "summed_equal"):
            assert out[key], key
        assert out["names"] == ["model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"]


def test_wrap_initialises_from_torchrun_environment():
    assert run_workers("bx_torch_workers:self_init", nproc=2, timeout=60, env=ENV) == [("gloo", 2)] * 2


def test_wrap_without_launcher_says_how_to_launch(monkeypatch):
    import pytest
    import torch

    import bagua_x.torch as bxt
    from bagua_x.core import BaguaXError

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(BaguaXError, match="torchrun"):
        bxt.wrap(torch.nn.Linear(2, 2))
    with pytest.raises(BaguaXError, match="torch.nn.Module"):
        bxt.wrap(lambda x: x)


def test_buffer_broadcast_waits_for_the_exchange_in_flight():
    """The buffer broadcast of a second forward must not overtake the exchange launched by the first."""
    out = run_workers("bx_torch_workers:buffer_broadcast_during_exchange", nproc=2, timeout=90, env=ENV)
    assert len(out) == 2
    assert len(out[0]["params"]) == len(out[1]["params"]) == 4
    for a, b in zip(out[0]["params"], out[1]["params"]):
        np.testing.assert_array_equal(a, b)  # weights averaged: rank 0's + 0 and rank 1's + 1
    assert len(out[0]["buffers"]) == len(out[1]["buffers"]) == 3
    for a, b in zip(out[0]["buffers"], out[1]["buffers"]):
        np.testing.assert_array_equal(a, b)  # buffers broadcast from rank 0 after the second forward's stats


def test_ranks_sharing_a_gpu_are_named_with_the_fix():
    from bagua_x.torch.distributed import shared_gpus

    gpus = [("GPU-a", "cuda:0"), ("GPU-a", "cuda:0"), ("GPU-b", "cuda:1"), ("GPU-a", "cuda:0")]
    problem = shared_gpus(gpus, [0, 1, 2, 3])
    assert problem.startswith("ranks [0, 1, 3] are all on cuda:0, the same GPU")
    assert "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))" in problem
    assert shared_gpus(gpus[1:3], [4, 5]) is None  # ranks of a subgroup, each on its own GPU


def test_wrap_gives_the_process_group_it_initialises_its_timeout():
    # the group's own waits (NCCL's watchdog, gloo's collectives) then end when wrap's do, not after 10-30 min
    assert run_workers("bx_torch_workers:wrap_initialises_with_its_timeout", nproc=2, timeout=60, env=ENV) == [7.5, 7.5]
