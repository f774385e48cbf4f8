"""The same inputs through the torch and the JAX frontend give the same outputs.

Torch runs each algorithm on 2 gloo ranks (``TorchCommunicator``); JAX replays
exactly the torch ranks' inputs under ``pmap`` over 2 devices
(``AxisCommunicator``).  Plain allreduce must agree bit for bit, compressed
algorithms within one quantisation step.
"""

import os

import jax
import numpy as np
import pytest

from bagua_x import algorithms
from bagua_x.core.bucket import BucketLayout
from bagua_x.jax import AxisCommunicator
from launch import run_workers

TORCH_WORKERS = {"PYTHONPATH": os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch")}
CASES = {
    "GradientAllReduce": ({}, False, 0.0),
    "ByteGrad": ({}, False, 1.0),
    "Decentralized": ({"peer_selection_mode": "all"}, True, 0.0),
    "LowPrecisionDecentralized": ({}, True, 1.0),
    "ModelAverage": ({"period": 2}, True, 0.0),
}


def _jax_replay(name, kwargs, initial, ins):
    algorithm = getattr(algorithms, name)(**kwargs)
    devices = jax.devices()[:2]
    layout = BucketLayout(["x"], [(len(initial[0]),)], "float32")
    reduce = jax.pmap(lambda x, st: algorithm.reduce(x, layout, st, AxisCommunicator("batch")), axis_name="batch",
                      devices=devices)
    state = jax.pmap(lambda x: algorithm.init(x, layout, 2), axis_name="batch", devices=devices)(np.stack(initial))
    outs = []
    for step_inputs in ins:
        out, state = reduce(np.stack(step_inputs), state)
        outs.append([np.asarray(o) for o in out])
    return outs


@pytest.mark.parametrize("name", list(CASES))
def test_torch_and_jax_agree(name):
    kwargs, chained, steps_tolerance = CASES[name]
    ranks = run_workers("bx_torch_workers:algorithm_steps", nproc=2, timeout=120, env=TORCH_WORKERS,
                        args=(name, kwargs, 4, 24, chained))
    initial = [r["initial"] for r in ranks]
    ins = [[r["ins"][s] for r in ranks] for s in range(4)]
    jax_outs = _jax_replay(name, kwargs, initial, ins)
    for s in range(4):
        for rank, r in enumerate(ranks):
            got, want = jax_outs[s][rank], r["outs"][s]
            if steps_tolerance == 0.0:
                np.testing.assert_array_equal(got, want, err_msg=f"{name} step {s} rank {rank}")
            else:  # one quantisation step of the compressed values
                step = (max(np.ptp(x) for x in ins[s]) * 2 + 1e-7) / 255
                np.testing.assert_allclose(got, want, rtol=0, atol=steps_tolerance * step,
                                           err_msg=f"{name} step {s} rank {rank}")
