"""Each algorithm traced by JAX (pmap over 4 CPU devices) against the numpy references, and converging.

``algorithm.reduce`` runs on per-device flat buffers through AxisCommunicator;
``tests/algorithms/reference.py`` simulates every rank in numpy from the
formulas in DESIGN.md.  Inputs change every step (as training would), and each
run must trace once.
"""

import jax
import numpy as np
import pytest

import bx_jax_workers as w
from algorithms import reference as ref
from bagua_x.algorithms import (
    ByteGrad, Decentralized, GradientAllReduce, LowPrecisionDecentralized, ModelAverage, QAdam,
)
from bagua_x.jax import AxisCommunicator, wrap

N, NUMEL, STEPS = 4, 64, 6


def inputs(step, seed=0):
    rng = np.random.default_rng(1000 * seed + step)
    return [rng.normal(size=NUMEL).astype(np.float32) * (1 + r) for r in range(N)]


class Traced:
    """``algorithm.reduce`` under pmap, its state kept on the devices between calls."""

    def __init__(self, algorithm, first_xs):
        self.traces = 0

        def reduce(x, st):
            self.traces += 1
            return algorithm.reduce(x, st, AxisCommunicator("batch"))

        self.algorithm = algorithm
        self.reduce = jax.pmap(reduce, axis_name="batch")
        self.state = jax.pmap(lambda x: algorithm.init(x, N), axis_name="batch")(np.stack(first_xs))

    def __call__(self, xs):
        out, self.state = self.reduce(np.stack(xs), self.state)
        return [np.asarray(o) for o in out]


@pytest.mark.parametrize("average", [True, False])
def test_gradient_allreduce(average):
    xs = inputs(0)
    run = Traced(GradientAllReduce(average=average), xs)
    for s in range(3):
        xs = inputs(s)
        for got, want in zip(run(xs), ref.allreduce(xs, average)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert run.traces == 1


@pytest.mark.parametrize("average", [True, False])
def test_bytegrad_within_one_quantization_step_and_really_quantized(average):
    xs = inputs(0)
    run = Traced(ByteGrad(average=average), xs)
    for s in range(STEPS):
        xs = inputs(s)
        got, want = run(xs), ref.bytegrad(xs, average)
        exact = ref.allreduce(xs, average)[0]
        for g in got[1:]:
            np.testing.assert_array_equal(g, got[0])  # all ranks bitwise identical
        for chunk_got, chunk_want in zip(np.split(got[0], N), np.split(want[0], N)):
            np.testing.assert_allclose(chunk_got, chunk_want, atol=1.01 * ref.step_size(chunk_want))
            assert len(np.unique(chunk_got)) <= 256
        assert np.abs(got[0] - exact).max() > 1e-4, "ByteGrad returned the exact mean: nothing was quantized"
    assert run.traces == 1


@pytest.mark.parametrize("mode", ["all", "shift_one"])
@pytest.mark.parametrize("interval", [1, 2])
def test_decentralized(mode, interval):
    xs = inputs(0)
    run = Traced(Decentralized(peer_selection_mode=mode, communication_interval=interval), xs)
    for s in range(STEPS):
        xs = inputs(s)
        for got, want in zip(run(xs), ref.decentralized(xs, mode, s, interval)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert run.traces == 1


@pytest.mark.parametrize("interval", [1, 2])
def test_low_precision_decentralized(interval):
    rng = np.random.default_rng(5)
    xs = inputs(0)
    run = Traced(LowPrecisionDecentralized(communication_interval=interval), xs)
    states = ref.low_precision_init(xs)
    for s in range(STEPS):
        got = run(xs)
        want, states = ref.low_precision_decentralized(xs, states, s, interval)
        for r in range(N):
            tol = 2.01 * ref.step_size(want[r] - states[r]["left"] / 3) + 1e-5
            np.testing.assert_allclose(got[r], want[r], atol=tol)
            for key in ("w", "left", "right"):
                np.testing.assert_allclose(np.asarray(run.state[key][r]), states[r][key], atol=4 * tol)
        xs = [x - 0.05 * rng.normal(size=NUMEL).astype(np.float32) for x in got]  # an optimizer step
    assert run.traces == 1


@pytest.mark.parametrize("period", [1, 3])
def test_model_average(period):
    xs = inputs(0)
    run = Traced(ModelAverage(period=period), xs)
    for s in range(STEPS):
        xs = inputs(s)
        for got, want in zip(run(xs), ref.model_average(xs, s, period)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert run.traces == 1


CONVERGENCE = {
    "allreduce": GradientAllReduce(),
    "bytegrad": ByteGrad(),
    "decentralized-all": Decentralized(),
    "decentralized-shift_one": Decentralized(peer_selection_mode="shift_one"),
    "lowprec": LowPrecisionDecentralized(),
    "model_average": ModelAverage(period=4),
    "qadam": QAdam(lr=1e-2, warmup_steps=10),
}


@pytest.mark.parametrize("name", list(CONVERGENCE))
def test_converges(name):
    params = w.make_params(0)
    x, y = w.make_data(60, N, per_device=16, seed=2)
    dp = wrap(params, algorithm=CONVERGENCE[name])
    traces = []
    every = w.bagua_pmap(dp, params, x, y, lr=2e-2, every_device=True, traces=traces)
    assert len(traces) == 1, "the step must compile once"
    xe, ye = x[-1].reshape(-1, w.IN), y[-1].reshape(-1, w.OUT)
    start = float(w.loss_fn(params, xe, ye))
    final = [float(w.loss_fn(jax.tree.map(lambda a: a[r], every), xe, ye)) for r in range(N)]
    assert max(final) < 0.1 * start, (name, start, final)


def test_across_two_processes():
    """The same algorithms with their collectives crossing processes (gloo), against the references."""
    import os

    from launch import run_workers

    steps = 3
    env = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)),
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    res = run_workers("bx_jax_workers:algorithms_worker", nproc=2, args=(steps,), timeout=240, env=env)
    for r in res:
        states = ref.low_precision_init(w.algorithm_inputs(0, N))
        for s in range(steps):
            xs = w.algorithm_inputs(s, N)
            got = {name: list(outs[s]) for name, outs in r.items()}
            for g, want in zip(got["bytegrad"], ref.bytegrad(xs)):
                np.testing.assert_allclose(g, want, atol=1.01 * ref.step_size(want))
            for g, want in zip(got["shift_one"], ref.decentralized(xs, "shift_one", s, 1)):
                np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
            for g, want in zip(got["model_average"], ref.model_average(xs, s, 2)):
                np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
            want, states = ref.low_precision_decentralized(xs, states, s, 1)
            for g, wv in zip(got["lowprec"], want):
                np.testing.assert_allclose(g, wv, atol=0.05)
