"""bagua_x's gradient algorithms as a DDP comm hook: same numbers as wrap(), compressed bytes really sent."""

import os

import numpy as np
import pytest

from launch import run_workers

ENV = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}


def _assert_same_steps(a, b, atol=0.0):
    assert len(a) == len(b) > 0
    for step_a, step_b in zip(a, b):
        assert len(step_a) == len(step_b) > 0
        for x, y in zip(step_a, step_b):
            if atol:
                np.testing.assert_allclose(x, y, rtol=0, atol=atol)
            else:
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("odd", [False, True], ids=["even", "padded"])
def test_bytegrad_hook_equals_wrap_and_sends_uint8(odd):
    out = run_workers("bx_ecosystem_workers:hook_vs_wrap", nproc=2, args=("ByteGrad", odd), timeout=120, env=ENV)
    for r in out:
        assert r["ddp_buckets"] == r["wrap_buckets"] == 1
        _assert_same_steps(r["hook"], r["wrap"])  # bitwise: same bucket, same algorithm
        padded = r["numel"] + r["numel"] % 2
        assert (r["numel"] % 2 == 1) == odd
        # per step: alltoall of 2 uint8 rows (a chunk + its 8-byte min/max header each), allgather of one row
        assert r["calls"] == [("alltoall", "uint8", padded + 16), ("allgather", "uint8", padded // 2 + 8)] * 4
    _assert_same_steps(out[0]["hook"], out[1]["hook"])  # every rank ends identical


def test_allreduce_hook_equals_wrap():
    out = run_workers("bx_ecosystem_workers:hook_vs_wrap", nproc=2, args=("GradientAllReduce", False), timeout=120,
                      env=ENV)
    for r in out:
        _assert_same_steps(r["hook"], r["wrap"])
        assert r["calls"] == [("allreduce", "float32", r["numel"])] * 4


def test_powersgd_hook_equals_wrap_and_sends_the_factors():
    """PowerSGD through the hook: the DDP bucket's layout (one 7 x 10 matrix) reaches the algorithm."""
    out = run_workers("bx_ecosystem_workers:hook_vs_wrap", nproc=2, args=("PowerSGD", False), timeout=120, env=ENV)
    for r in out:
        _assert_same_steps(r["hook"], r["wrap"])  # bitwise: same bucket, same seeded Q
        # one plain step, then per step the rank-1 factors: P (7 x 1) summed, Q (10 x 1) averaged
        assert r["calls"] == [("allreduce", "float32", 70)] + [("allreduce", "float32", 7),
                                                                ("allreduce", "float32", 10)] * 3, r["calls"]


def test_powersgd_resumes_bitwise_through_the_hook():
    """Train 4 steps (compressed from step 2, error feedback live), save model, optimizer and hook state, train
    4 more; against loading the save into a fresh DDP + hook for the same 4 steps.  The fresh DDP runs its first
    step on one bucket in parameter order and then regroups into two in gradient order, so the state must follow
    each parameter, and each matrix must compute the same wherever it sits in a bucket."""
    out = run_workers("bx_powersgd_workers:hook_resume", nproc=2, args=(4, 4, 2), timeout=120, env=ENV)
    for r in out:
        assert r["seen"] == [[0], [0, 1], [0, 1], [0, 1]]  # one bucket, then DDP's regrouping into two
        assert r["saved"] == list(range(6)) and r["saved_steps"] == [4]  # every parameter, 4 steps each
        assert r["saved_error"] > 1e-3  # error feedback to carry over
        _assert_same_steps(r["resumed"], r["continued"])  # bitwise
    _assert_same_steps(out[0]["resumed"], out[1]["resumed"])


def test_hook_refuses_a_state_saved_for_another_model():
    for load, backward in run_workers("bx_powersgd_workers:hook_refuses_foreign_state", nproc=2, timeout=60, env=ENV):
        assert "not a CommHookState.algorithm_state_dict() (keys [0]" in load
        assert "do not load it" in load
        assert ("the loaded state of parameter 0 has shapes {'step': (), 'q': (7,), 'error': (70,)}, but this DDP "
                "model and PowerSGD's settings need {'step': (), 'q': (10,), 'error': (80,)}") in backward
        assert "load it into the same ones, or do not load the hook state" in backward


def test_hook_on_many_buckets_equals_ddp():
    out = run_workers("bx_ecosystem_workers:hook_many_buckets", nproc=2, timeout=120, env=ENV)
    for r in out:
        assert len(r["bucket_indices"]) >= 3
        assert r["bucket_indices"] == list(range(len(r["bucket_indices"])))
        _assert_same_steps(r["hook"], r["ddp"])
        sizes = [n for _, _, n in r["calls"]]
        assert sum(sizes) == sum(p.size for p in r["ddp"][0]) * 3  # every gradient, every step


def test_hook_failure_raises_from_backward():
    for message in run_workers("bx_ecosystem_workers:hook_error_reaches_backward", nproc=2, timeout=60, env=ENV):
        # torch's future turns the BaguaXError into a RuntimeError carrying its message
        assert "bagua_x comm hook: GradientAllReduce on DDP bucket 0 failed: RuntimeError: boom" in message


@pytest.mark.parametrize("name", ["Decentralized", "LowPrecisionDecentralized", "ModelAverage", "QAdam",
                                  "AsyncModelAverage"])
def test_hook_refuses_non_gradient_algorithms(name):
    import bagua_x.algorithms as algorithms
    import bagua_x.torch as bxt
    from bagua_x.core import BaguaXError

    algorithm = getattr(algorithms, name)(**({"lr": 0.1} if name == "QAdam" else {}))
    with pytest.raises(BaguaXError, match=f"{name}.*DDP comm hook.*bagua_x.torch.wrap"):
        bxt.CommHookState(algorithm)


def test_hook_refuses_hierarchical():
    import bagua_x.torch as bxt
    from bagua_x.algorithms import GradientAllReduce
    from bagua_x.core import BaguaXError

    with pytest.raises(BaguaXError, match=r"hierarchical=None or False \(flat\)"):
        bxt.CommHookState(GradientAllReduce(hierarchical=True))
