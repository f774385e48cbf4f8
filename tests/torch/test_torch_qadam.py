"""QAdam through bagua_x.torch.wrap: Adam during warmup, then 8-bit momentum from the optimizer state."""

import os

import numpy as np

import reference as ref
from launch import run_workers

ENV = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}


def test_warmup_equals_adam_on_averaged_gradients():
    for r in run_workers("bx_qadam_workers:warmup_vs_ddp_adam", nproc=2, timeout=120, env=ENV):
        assert len(r["ddp"]) == len(r["bagua_x"]) > 0
        for a, b in zip(r["ddp"], r["bagua_x"]):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_compressed_momentum_matches_the_reference():
    steps, warmup, lr = 6, 2, 1e-2
    res = run_workers("bx_qadam_workers:compressed_steps", nproc=2, timeout=120, env=ENV, args=(steps, warmup))
    r0 = res[0]
    for r in res[1:]:  # every rank ends with the same parameters (same dequantised momentum)
        np.testing.assert_array_equal(r["params"][-1], r0["params"][-1])
    expected = ref.qadam(r0["initial"], r0["grads"], lr=lr, warmup_steps=warmup, weight_decay=0.01)
    uncompressed = ref.qadam(r0["initial"], r0["grads"], lr=lr, warmup_steps=steps, weight_decay=0.01)
    assert len(r0["params"]) == len(expected) == len(uncompressed) == steps
    for t, (got, want, adam) in enumerate(zip(r0["params"], expected, uncompressed), start=1):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"step {t}")
        if t > warmup:  # and the 8-bit momentum really changed the result
            assert np.abs(got - adam).max() > 1e-3
    # after warmup the optimizer's exp_avg lives in the bucket buffer and is really quantised
    assert r0["momentum_views"] == [False] * warmup + [True] * (steps - warmup)
    # warmup: one float32 allreduce of the 32 gradients a step; then the momentum as uint8 only:
    # an alltoall of 2 rows of 16 + an 8-byte min/max header, an allgather of one row
    compressed = [("alltoall", "uint8", 2 * (16 + 8)), ("allgather", "uint8", 16 + 8)]
    for r in res:
        assert [s[1:] for s in r["sent"] if s[0] < warmup] == [("allreduce", "float32", 32)] * warmup, r["sent"]
        assert [s[1:] for s in r["sent"] if s[0] >= warmup] == compressed * (steps - warmup), r["sent"]


def test_converges():
    res = run_workers("bx_qadam_workers:converge", nproc=2, timeout=120, env=ENV)
    for r in res:
        assert np.mean(r["losses"][-5:]) < 0.05 * np.mean(r["losses"][:3]), r["losses"]
    np.testing.assert_array_equal(res[0]["weights"], res[1]["weights"])


def test_no_warmup_is_refused():
    """With warmup_steps=0 Adam's variance is frozen at 0: a Linear(8, 1) moved by 6.3e5 in two steps."""
    import pytest
    import torch

    from bagua_x.algorithms import QAdam
    from bagua_x.core.errors import BaguaXError
    from bagua_x.torch import QAdamOptimizer

    for make in (lambda: QAdamOptimizer(torch.nn.Linear(8, 1).parameters(), lr=1e-3, warmup_steps=0),
                 lambda: QAdam(warmup_steps=0), lambda: QAdam(warmup_steps=-3)):
        with pytest.raises(BaguaXError, match="warmup_steps >= 1"):
            make()
    assert QAdam(warmup_steps=1).warmup_steps == 1
