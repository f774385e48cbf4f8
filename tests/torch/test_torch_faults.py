"""Faults and bad input: a dead or stalled rank makes the others raise within wrap's timeout, naming the
bucket and the ranks behind; bad models are refused at wrap() by name."""

import os

import pytest

from launch import run_workers

ENV = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}


@pytest.mark.parametrize("algorithm", ["GradientAllReduce", "Decentralized", "ModelAverage", "AsyncModelAverage",
                                       "DiLoCo"])
def test_survivor_raises_when_a_rank_dies(algorithm):
    timeout = 5.0
    kwargs = {"sync_every": 8} if algorithm == "DiLoCo" else {}  # rank 1 dies after step 3, between two syncs
    results = run_workers("bx_fault_workers:rank_dies", nproc=2, timeout=90, env=ENV,
                          args=(algorithm, timeout, 3, kwargs), expect_failure=True)
    kind, out = results[0]
    assert kind == "ok", out
    assert out["type"] == "BaguaXError", out
    assert out["seconds"] < timeout + 10, out
    assert "bucket_0" in out["message"], out["message"]
    assert results[1][0] == "error"  # rank 1 exited without a result


@pytest.mark.parametrize("algorithm,bucket", [("GradientAllReduce", "grad_bucket_0"),
                                              ("ModelAverage", "weight_bucket_0")])
def test_skipped_step_names_bucket_and_rank(algorithm, bucket):
    timeout = 4.0
    results = run_workers("bx_fault_workers:rank_skips_backward", nproc=2, timeout=90, env=ENV,
                          args=(timeout, algorithm))
    out = results[0]
    assert out["type"] == "BaguaXError", out
    assert timeout - 0.5 < out["seconds"] < timeout + 10, out
    message = out["message"]
    assert f"{bucket} did not complete within 4 s" in message, message
    assert "'0.weight'" in message and "'2.bias'" in message, message
    assert "ranks [1] had not marked it ready" in message, message
    assert "rank 1: 2 times" in message and "this rank 0: 3 times" in message, message
    assert results[1]["type"] is None


def test_stall_report_at_four_ranks_names_the_lagging_rank():
    """Rank 2 skips a backward and idles: ranks 0, 1 and 3 each name bucket, tensors and rank 2 with its count.

    The counts reach the store only once a wait has failed: each report wakes every rank's responder thread.
    Ranks 1 and 3 exit after their reports, which may be before the others': their answers still count."""
    timeout = 4.0
    results = run_workers("bx_fault_workers:rank_skips_backward", nproc=4, timeout=120, env=ENV,
                          args=(timeout, "GradientAllReduce", 2))
    assert len(results) == 4 and results[2]["type"] is None
    for rank in (0, 1, 3):
        out = results[rank]
        assert out["type"] == "BaguaXError", out
        assert timeout - 0.5 < out["seconds"] < timeout + 10, out
        message = out["message"]
        # the wait's timeout or gloo's own (the same 4 s) may come first: either names the bucket
        assert ("grad_bucket_0 did not complete within 4 s" in message
                or "grad_bucket_0 failed on the communication thread" in message), message
        assert "'0.weight'" in message and "'2.bias'" in message, message
        assert f"ranks [2] had not marked it ready (rank 2: 2 times; this rank {rank}: 3 times)" in message, message


def test_stall_report_names_a_dead_rank_as_not_answering():
    """Rank 1 of 4 exits: a survivor's report names it as not answering; ranks 2 and 3 answered (alive)."""
    timeout = 5.0
    results = run_workers("bx_fault_workers:rank_dies", nproc=4, timeout=120, env=ENV,
                          args=("GradientAllReduce", timeout), expect_failure=True)
    kind, out = results[0]
    assert kind == "ok" and out["type"] == "BaguaXError", out
    message = out["message"]
    assert "rank 1: no answer within 2 s (dead, exited, or its process is frozen)" in message, message
    assert "rank 2: no answer" not in message and "rank 3: no answer" not in message, message


def test_the_timeout_bounds_each_job_not_the_sum_of_those_waited_for():
    """On a slow link a backward's buckets may take longer in all than the timeout while each finishes in time:
    the wait goes on; a job of its own past the timeout raises, naming it (the communication thread, in-process)."""
    import time

    import torch

    from bagua_x.core.errors import BaguaXError
    from bagua_x.torch.engine.comm_thread import CommWorker

    worker = CommWorker("test-comm", torch.device("cpu"), timeout=1.5)
    try:
        for i in range(7):
            worker.submit(f"bucket {i}", lambda: time.sleep(0.4))
        worker.wait()  # 2.8 s in all
        time.sleep(1.6)  # idle for longer than the timeout: the next job's clock starts when it is submitted
        worker.submit("bucket 7", lambda: time.sleep(0.4))
        worker.wait()
        worker.submit("the stuck bucket", lambda: time.sleep(3))
        start = time.monotonic()
        with pytest.raises(BaguaXError, match="the stuck bucket did not complete within 1.5 s"):
            worker.wait()
        assert time.monotonic() - start < 2.9
    finally:
        worker.close()


def test_no_store_request_per_step():
    """Steady-state training makes no store request at all: launch counts stay in memory until a wait fails."""
    for out in run_workers("bx_fault_workers:store_requests_during_training", nproc=2, timeout=120, env=ENV):
        assert out["buckets"] > 3, out  # several buckets per engine: per-bucket traffic would show
        assert "wait" in out["setup"], out  # the responder waits for an alarm (one request, before training)
        assert out["during"] == [], out


def test_stall_inspector_does_not_hang_when_the_store_host_has_gone():
    """Connecting to a store whose host has exited retries for the store's whole timeout (30 min): the engine is
    built at once, and the report says within seconds that the store is unreachable, naming the tensors."""
    results = run_workers("bx_fault_workers:store_host_gone_before_inspector", nproc=2, timeout=60, env=ENV,
                          expect_failure=True)
    kind, out = results[1]
    assert kind == "ok", out
    assert out["build_s"] < 1, out
    assert out["report_s"] < 10, out
    assert "'0.weight'" in out["message"] and "could not connect to the torch.distributed store" in out["message"], out


@pytest.mark.parametrize("case,expected", [
    ("complex", ["'weight'", "complex64", "view_as_real"]),
    ("sparse", ["'0.weight'", "sparse=True", "sparse=False"]),
    ("sparse_at_backward", ["'0.weight'", "sparse", "dense"]),
    ("devices", ["'0.weight' on cpu", "'1.weight' on meta", "model.to(device)"]),
    ("shape", ["'weight'", "(4, 5)", "(4, 4)"]),
    ("nonfinite", ["non-finite gradient", "tensors ['weight']"]),
])
def test_bad_input_is_named(case, expected):
    messages = run_workers("bx_fault_workers:bad_input", nproc=2, timeout=60, env=ENV, args=(case,))
    for message in messages:
        for piece in expected:
            assert piece in message, (piece, message)
    if case == "nonfinite":  # checked after the reduction: both ranks raise, each saying whose input was bad
        assert "this rank's own gradient was finite" in messages[0]
        assert "this rank's own gradient was already non-finite in ['weight']" in messages[1]
    elif case != "sparse_at_backward":
        assert messages[0] == messages[1]


def test_check_finite_is_off_by_default():
    assert run_workers("bx_fault_workers:bad_input", nproc=2, timeout=60, env=ENV, args=("nonfinite_off",)) == \
        [None, None]

@pytest.mark.parametrize("name, kwargs", [
    # communication_interval=2: step 1 exchanges nothing, so only rank 1 holds the NaN after it
    ("Decentralized", {"communication_interval": 2}),
    ("Decentralized", {"peer_selection_mode": "shift_one", "communication_interval": 2}),
    ("LowPrecisionDecentralized", {}),  # rank 0 gets 8-bit codes of the difference: its weights stay finite
])
def test_check_finite_on_weights_raises_on_every_rank(name, kwargs):
    """A NaN weight on rank 1 only: the ranks agree on the check, so both raise at the same step naming the
    tensor, at once (before the agreement, rank 0 went on and waited out the 20 s timeout in the next exchange)."""
    res = run_workers("bx_fault_workers:nonfinite_weights", nproc=2, timeout=90, env=ENV, args=(name, kwargs))
    for step, message, seconds in res:
        assert step == 1, res
        assert "non-finite weights after communication in bucket" in message and "'2.weight'" in message, message
        assert seconds < 10, res
    assert "this rank's own weights was finite" in res[0][1] and "already non-finite in ['2.weight']" in res[1][1]


def test_qadam_rebuild_is_checked_across_ranks():
    """QAdam rebuilds its buckets when warmup ends: ranks that switch at different steps fail within the timeout
    (the check goes through the store, so it cannot pair with rank 0's gradient allreduce)."""
    r0, r1 = run_workers("bx_fault_workers:qadam_switch_mismatch", nproc=2, timeout=90, env=ENV, args=(4.0,))
    assert r1["type"] == "BaguaXError" and "momentum buckets" in r1["message"], r1
    assert "ranks [0] did not arrive within 4 s" in r1["message"], r1
    # rank 0 waits for rank 1 at its first step's bucket rebuild (or, past it, in the gradient allreduce)
    assert r0["type"] == "BaguaXError" and ("ranks [1] had not marked it ready" in r0["message"]
                                            or "ranks [1] did not arrive within 4 s" in r0["message"]), r0
    names = run_workers("bx_fault_workers:qadam_switch_agrees", nproc=2, timeout=90, env=ENV)
    assert names[0] == names[1] and len(names[0]) > 1 and names[0][0].startswith("momentum_bucket_")


def test_crafted_pickle_from_the_network_is_refused(tmp_path):
    """What ranks exchange is JSON: a pickle planted in the store or sent in the model check never runs."""
    marker = tmp_path / "pwned"
    r0, r1 = run_workers("bx_fault_workers:crafted_pickle_refused", nproc=2, timeout=90, env=ENV,
                         args=(str(marker),))
    assert r1 == {}
    assert set(r0) == {"wrap", "store"}, r0
    assert "rank 1's description" in r0["wrap"] and "not bagua_x's JSON" in r0["wrap"], r0["wrap"]
    assert "rank 1's description" in r0["store"] and "not bagua_x's JSON" in r0["store"], r0["store"]
    assert not marker.exists()


def test_ranks_exit_cleanly_when_the_store_host_leaves_first():
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(here, "bx_clean_exit.py")]
    done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}, cwd=root,
                          capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "terminate called" not in output, output[-4000:]
    assert "rank 0 done" in output and "rank 1 done" in output, output[-4000:]
