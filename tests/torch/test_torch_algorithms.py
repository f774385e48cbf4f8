"""Every algorithm on TorchCommunicator against the independent numpy references
(tests/algorithms/reference.py), and a small convergence run of each through wrap()."""

import importlib.util
import os

import numpy as np
import pytest

from bagua_x import testing
from launch import run_workers

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {"PYTHONPATH": HERE}


def _reference():
    path = os.path.join(HERE, "..", "algorithms", "reference.py")
    spec = importlib.util.spec_from_file_location("bx_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ref = _reference()


def run(name, kwargs, steps=4, numel=24, nproc=2, chained=False):
    return run_workers("bx_torch_workers:algorithm_steps", nproc=nproc, timeout=120, env=ENV,
                       args=(name, kwargs, steps, numel, chained))


def test_gradient_allreduce():
    res = run("GradientAllReduce", {}, steps=2)
    for s in range(2):
        expected = testing.reference.allreduce([r["ins"][s] for r in res])
        for r in res:
            np.testing.assert_allclose(r["outs"][s], expected[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("average", [True, False])
def test_bytegrad_matches_the_reference_and_sends_uint8(average):
    steps, numel, n = 3, 4000, 2
    res = run("ByteGrad", {"average": average}, steps=steps, numel=numel)
    assert len(res) == n
    chunk = numel // n
    for s in range(steps):
        xs = [r["ins"][s] for r in res]
        expected = ref.bytegrad(xs, average)[0]
        exact = testing.reference.allreduce(xs, average)[0]
        ours = res[0]["outs"][s]
        for r in res:
            np.testing.assert_array_equal(r["outs"][s], ours)  # all ranks bitwise identical
        # seen: up to 9.5e-7 (mean) and 1.9e-6 (sum), float32 rounding; one quantisation step is 0.018-0.036
        np.testing.assert_allclose(ours, expected, rtol=0, atol=2.5e-6)
        for part in np.split(ours, n):  # each chunk dequantised from 8 bits: at most 256 levels of ~2000 values
            assert 64 < len(np.unique(part)) <= 256
        assert np.max(np.abs(ours - exact)) > 1e-3, "no quantization error at all: not compressed?"
    # per step: an alltoall of n uint8 rows (payload + 8-byte min/max header), an allgather of one row
    for r in res:
        assert r["sent"] == [("alltoall", "uint8", n * (chunk + 8)), ("allgather", "uint8", chunk + 8)] * steps


@pytest.mark.parametrize("mode,interval,nproc",
                         [("all", 1, 4), ("all", 2, 2), ("shift_one", 1, 4), ("shift_one", 2, 4)])
def test_decentralized(mode, interval, nproc):
    steps = 5
    res = run("Decentralized", {"peer_selection_mode": mode, "communication_interval": interval}, steps=steps,
              nproc=nproc)
    for s in range(steps):
        expected = ref.decentralized([r["ins"][s] for r in res], mode, s, interval)
        for r, e in zip(res, expected):
            np.testing.assert_allclose(r["outs"][s], e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interval", [1, 2])
def test_low_precision_decentralized(interval):
    steps, nproc = 4, 4
    res = run("LowPrecisionDecentralized", {"communication_interval": interval}, steps=steps, nproc=nproc,
              numel=32, chained=True)
    states = ref.low_precision_init([r["initial"] for r in res])
    for s in range(steps):
        xs = [r["ins"][s] for r in res]
        expected, states = ref.low_precision_decentralized(xs, states, s, interval)
        for r, e in zip(res, expected):
            np.testing.assert_allclose(r["outs"][s], e, atol=1e-5)
    for r, st in zip(res, states):
        for k in ("w", "left", "right"):
            np.testing.assert_allclose(r["state"][k], st[k], atol=1e-5)


def test_model_average():
    period, steps = 2, 5
    res = run("ModelAverage", {"period": period}, steps=steps)
    for s in range(steps):
        expected = ref.model_average([r["ins"][s] for r in res], s, period)
        for r, e in zip(res, expected):
            np.testing.assert_allclose(r["outs"][s], e, rtol=1e-6, atol=1e-7)


CONVERGENCE = {
    "GradientAllReduce": {},
    "ByteGrad": {},
    "Decentralized": {},
    "DecentralizedShiftOne": {"peer_selection_mode": "shift_one"},
    "LowPrecisionDecentralized": {},
    "ModelAverage": {"period": 3},
    "AsyncModelAverage": {"sync_interval_ms": 5, "warmup_steps": 5},
    "AsyncModelAverageAllWarmup": {"sync_interval_ms": 5, "warmup_steps": 1000},
}


@pytest.mark.parametrize("case", list(CONVERGENCE))
def test_converges_through_wrap(case):
    name = {"DecentralizedShiftOne": "Decentralized", "AsyncModelAverageAllWarmup": "AsyncModelAverage"}.get(case, case)
    res = run_workers("bx_torch_workers:converge", nproc=2, timeout=120, env=ENV, args=(name, CONVERGENCE[case]))
    for r in res:
        assert r["final"] < 0.05 * r["first"] and r["final"] < 0.1, r
    spread = np.max(np.abs(res[0]["weights"] - res[1]["weights"]))
    if case in ("GradientAllReduce", "ByteGrad", "AsyncModelAverageAllWarmup"):
        assert spread == 0.0, "gradient allreduce (AsyncModelAverage's warm-up too) keeps ranks identical"
    else:
        assert spread < 0.01, "weight averaging keeps ranks close"
    if case == "AsyncModelAverage":
        assert all(r["rounds"] >= 3 for r in res), [r["rounds"] for r in res]
        assert all(r["rounds"] > r["rounds_at_abort"] for r in res), "no averaging after resume()"
    if case == "AsyncModelAverageAllWarmup":
        assert all(r["rounds"] == 0 for r in res)


@pytest.mark.parametrize("name", ["Decentralized", "ModelAverage"])
def test_weight_algorithm_phase_through_wrap(name):
    """Decentralized averages the weights the gradient was computed at; ModelAverage the stepped weights."""
    for diff in run_workers("bx_torch_workers:weight_phase_semantics", nproc=2, timeout=60, env=ENV, args=(name,)):
        assert diff < 1e-6


def test_async_averaging_hands_the_weights_over_through_stream_events():
    """The weight lock orders the two threads on the host; on a GPU their streams must be ordered too: whoever
    takes the lock first waits for the event the other side recorded when it let go. On the CPU the stream layer
    does nothing but record, which is what this checks (the GPU check runs it on CUDA)."""
    for out in run_workers("bx_torch_workers:async_average_stream_order", nproc=2, timeout=120, env=ENV):
        assert out["rounds"] >= 3
        thread = [op for op, stream in out["trace"] if stream == "async-average"]
        training = [op for op, stream in out["trace"] if stream == "current"]
        assert thread[0] == "use" and "use" not in thread[1:]  # the whole loop runs on its own stream
        # two locked sections a round (snapshot, write-back): each starts waiting for training's event, ends recording
        assert thread[1:] == ["wait", "record"] * (2 * out["rounds"]), thread
        # every forward (the lock is taken in warm-up too) waits for the thread's event, every step records one;
        # the 2 warm-up steps' gradient bucket adds its ready event and the end-of-backward wait for its stream
        warmup = ["wait", "record", "wait_stream bagua_x-grad-comm", "record"]
        assert training == warmup * 2 + ["wait", "record"] * 28, training


def test_async_averaging_state_dict_waits_for_the_weight_lock():
    """While the averaging thread holds the weight lock (a round's write-back), state_dict() waits, then gives
    copies (every tensor from one round, not the live weights written on); weights_locked() holds that lock
    and orders the caller's stream after the thread's last write and the thread's next round after the reads."""
    for out in run_workers("bx_torch_workers:async_average_state_dict", nproc=2, timeout=120, env=ENV):
        assert out["waited"] and out["returned"], out
        assert out["keys"] and out["copies"], out
        assert out["locked"] and out["trace"] == ["wait", "record"], out
