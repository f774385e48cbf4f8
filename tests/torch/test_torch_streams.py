"""The torch engines' CUDA stream protocol, checked on the CPU by tracing the stream functions
(``stream_trace``), and the deadline that bounds waits when a collective's ``wait()`` returns at once (NCCL)."""

import os

import pytest

from launch import run_workers

ENV = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
SIDES = {"grad": ["bagua_x-grad-comm"], "decentralized": ["bagua_x-weight-comm"],
         "model_average": ["bagua_x-weight-comm"], "qadam": ["bagua_x-grad-comm", "bagua_x-momentum-comm"],
         "hook": ["bagua_x-comm-hook"]}


def check_stream_order(trace, sides):
    """Every job: an event recorded on the submitting thread's current stream, then the side stream waits for
    it, runs the job and records its completion; every wait_stream of the current stream on a side stream comes
    once all jobs submitted so far were launched. Returns (jobs, wait_streams)."""
    for side in sides:
        ops = [op for op, stream in trace if stream == side and op not in ("keep_for", "mark")]
        assert ops[0] == "use" and "use" not in ops[1:], ops  # every job runs inside use(side)
        assert ops[1:] == ["wait", "record"] * ((len(ops) - 1) // 2) and len(ops) > 1, ops
    recorded = waits = done = wait_streams = 0
    for op, stream in trace:
        if stream == "current" and op == "record":
            recorded += 1
        elif stream in sides and op == "wait":
            waits += 1
            assert waits <= recorded, "the side stream waited before the bucket's event was recorded"
        elif stream in sides and op == "record":
            done += 1
        elif stream == "current" and op.startswith("wait_stream "):
            assert op.split()[1] in sides
            assert done == recorded, "the compute stream waited before every job was launched"
            wait_streams += 1
    assert done == waits == recorded
    return recorded, wait_streams


@pytest.mark.parametrize("kind", ["grad", "decentralized", "model_average", "qadam"])
def test_engines_hand_buckets_over_through_stream_events(kind):
    """A bucket's collective waits for the stream that produced it, runs on the engine's own stream, and the
    caller's stream waits for that stream once per step (end of backward, or after the step) with no host sync."""
    steps = 3
    for out in run_workers("bx_stream_workers:stream_order", nproc=2, timeout=120, env=ENV, args=(kind, steps)):
        jobs, wait_streams = check_stream_order(out["trace"], SIDES[kind])
        assert out["buckets"] >= 2
        assert wait_streams == steps
        if kind != "qadam":  # QAdam's warmup step has gradient buckets, the others momentum buckets
            assert jobs == steps * out["buckets"]
        # Decentralized's snapshot is made on the compute stream and exchanged on the side stream; the weight
        # algorithms' state (a step counter per bucket, made once) too; the gradient ones here keep no tensors
        kept = [op for op, stream in out["trace"] if op == "keep_for" and stream == SIDES[kind][0]]
        snapshots = jobs if kind == "decentralized" else 0
        assert len(kept) == snapshots + (out["buckets"] if kind in ("decentralized", "model_average") else 0)


def test_comm_hook_runs_on_its_stream_after_ddps():
    """The DDP hook: each bucket's event recorded on DDP's stream before the hook's stream waits for it (DDP's
    own consumer then waits through the CUDA-aware future, not through us)."""
    for out in run_workers("bx_stream_workers:stream_order", nproc=2, timeout=120, env=ENV, args=("hook", 3)):
        jobs, wait_streams = check_stream_order(out["trace"], SIDES["hook"])
        assert jobs > 3 and wait_streams == 0  # several buckets (after DDP regroups them) over 3 steps


def test_collective_past_its_deadline_on_the_device_is_reported():
    """NCCL's wait returns at once: a collective that never finishes on the device is found by the communication
    thread polling its completion event while idle, and the next bagua_x call (a forward) raises the stall report
    naming the bucket, about `timeout` after the collective was launched."""
    timeout = 3.0
    for out in run_workers("bx_stream_workers:device_deadline", nproc=2, timeout=120, env=ENV, args=(timeout,)):
        assert out["type"] == "BaguaXError", out
        assert timeout - 0.5 < out["seconds"] < timeout + 3, out
        message = out["message"]
        assert "grad_bucket_0 did not complete within 3 s" in message, message
        assert "still running on the device" in message, message
        assert "'0.weight'" in message, message  # the report names the bucket's tensors


def test_host_runs_at_most_one_step_ahead_of_unfinished_communication():
    """On CUDA nothing blocks the host, so a loop behind a stuck collective would queue work until a kernel
    launch blocks in C, past any deadline.  The first step behind it returns; the second backward waits for
    the first step's communication and raises the report at its deadline instead of returning."""
    timeout = 3.0
    for out in run_workers("bx_stream_workers:run_ahead", nproc=2, timeout=120, env=ENV, args=(timeout,)):
        assert out["type"] == "BaguaXError", out
        assert len(out["steps"]) == 1 and out["steps"][0] < 1.0, out  # one step ahead is allowed, at once
        assert timeout - 0.5 < out["seconds"] < timeout + 3, out
        assert "still running on the device" in out["message"], out


def test_comm_hook_collective_past_its_deadline_on_the_device_is_reported():
    """The DDP hook has the same bound: its thread finds the collective still running on the device after
    `timeout`, and the next backward raises the report (the future of each later bucket fails with it)."""
    timeout = 3.0
    for out in run_workers("bx_stream_workers:hook_deadline", nproc=2, timeout=120, env=ENV, args=(timeout,)):
        message = out["message"]
        assert out["type"] is not None, out
        assert "DDP bucket 0 did not complete within 3 s" in message, message
        assert "still running on the device" in message, message


def test_algorithm_state_made_on_the_training_stream_is_kept_for_the_communication_stream():
    """State made or loaded on the training thread is read by reduce on the communication stream, and dropped
    there for the state reduce returns: every one of its tensors is marked for that stream (record_stream), so
    the caching allocator cannot hand its memory to backward while the communication stream still reads it."""
    for out in run_workers("bx_stream_workers:state_streams", nproc=2, timeout=120, env=ENV):
        for what, (tensors, all_kept) in out.items():
            assert tensors >= 2 and all_kept, (what, out)


def test_comm_hook_host_runs_at_most_one_step_ahead_of_unfinished_communication():
    """DDP never waits for the hook's thread: without a bound, a loop behind a collective stuck on the device
    queues work until a kernel launch blocks in C.  One step behind it returns at once; the next backward
    raises the BaguaXError at the deadline (from the hook, not through a future)."""
    timeout = 3.0
    for out in run_workers("bx_stream_workers:hook_run_ahead", nproc=2, timeout=120, env=ENV, args=(timeout,)):
        assert out["type"] == "BaguaXError", out
        assert len(out["steps"]) == 1 and out["steps"][0] < 1.0, out
        assert timeout - 0.5 < out["seconds"] < timeout + 3, out
        assert "DDP bucket" in out["message"] and "still running on the device" in out["message"], out


def test_comm_hook_dead_peer_is_reported_not_waited_for_bucket_by_bucket():
    """A peer that stops taking part: the backward behind it fails after one timeout with the report (the
    step's later buckets skipped, not each timing out in turn), and the next raises the BaguaXError at once."""
    timeout = 2.0
    out = run_workers("bx_stream_workers:hook_dead_peer", nproc=2, timeout=120, env=ENV, args=(timeout,))[0]
    assert out["buckets"] >= 2, out  # one timeout each would take at least 2 * timeout
    failed, after = out["steps"]
    assert failed["type"] is not None and "bagua_x comm hook: GradientAllReduce on DDP bucket 0 failed" in \
        failed["message"], out
    assert failed["seconds"] < 1.5 * timeout, out
    assert after["type"] == "BaguaXError" and after["seconds"] < 1.0, out
    assert "DDP bucket 0 failed" in after["message"], out
