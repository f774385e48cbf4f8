"""``Algorithm.branch_key``: a frontend that compiles one program per key (JAX through ``dp.step``) hands
``comm.counter`` the first step it saw with the step's key, not the step itself.  Run here as it would be, on
simulated ranks, against the same run with the true step: every step's result and state must be bitwise
equal, so a key that lumps together steps taking different branches fails."""

import dataclasses

import numpy as np
import pytest

from bagua_x.algorithms import (DiLoCo, Decentralized, LowPrecisionDecentralized, ModelAverage, PowerSGD, QAdam,
                                SparseLoCo)
from bagua_x.core.bucket import BucketLayout
from bagua_x.testing import run

STEPS = 14
LAYOUT = BucketLayout(["w", "b"], [(12, 10), (8,)], "float32", 4)  # a matrix for PowerSGD, padded to 4 ranks


class FirstOfKey:
    """A rank's communicator whose ``counter`` answers the first step it saw with the same branch key."""

    def __init__(self, comm, algorithm):
        self._comm, self._algorithm = comm, algorithm
        self.first: dict = {}
        self.substituted = 0  # counters answered with another step: the test is not vacuous

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def counter(self, step):
        first = self.first.setdefault(self._algorithm.branch_key(int(step)), int(step))
        self.substituted += first != int(step)
        return np.asarray(first, np.int32)


def trajectory(algorithm, comm):
    """Each step's result and state leaves, the bucket moved by a rank- and step-dependent amount first."""
    x = np.random.default_rng(3).standard_normal(LAYOUT.padded_numel).astype(np.float32)
    state = algorithm.init(x, LAYOUT, comm.size)
    out = []
    for t in range(STEPS):
        g = np.random.default_rng(100 * comm.rank + t).standard_normal(x.shape).astype(np.float32)
        if isinstance(algorithm, QAdam):
            update, state = algorithm.step(g, x, LAYOUT, state, comm)
            x = x + update
        else:
            x, state = algorithm.reduce(x - 0.05 * g if algorithm.target.value == "weight" else g, LAYOUT, state,
                                        comm)
        out.append([np.asarray(x).copy()] + [np.asarray(a).copy() for a in state])
    return out


ALGORITHMS = [
    ModelAverage(period=3),
    LowPrecisionDecentralized(communication_interval=2),
    Decentralized(communication_interval=3),
    Decentralized(peer_selection_mode="shift_one", communication_interval=2),
    QAdam(warmup_steps=4),
    PowerSGD(start_powerSGD_iter=5),
    DiLoCo(sync_every=3),
    DiLoCo(sync_every=6, fragments=3, fragment_sync_delay=1),
    DiLoCo(sync_every=4, fragments=2, bits=8),
    SparseLoCo(sync_every=3, fragments=2),
]


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=repr)
@pytest.mark.parametrize("local_size", [None, 2], ids=["flat", "2x2"])
def test_a_step_of_the_same_key_takes_the_same_branches(algorithm, local_size):
    if local_size and "hierarchical" in {f.name for f in dataclasses.fields(algorithm)}:
        algorithm = dataclasses.replace(algorithm, hierarchical=True)

    def both(comm):
        keyed = FirstOfKey(comm, algorithm)
        return trajectory(algorithm, comm), trajectory(algorithm, keyed), keyed.substituted

    results, _ = run(4, both, local_size=local_size, timeout=30)
    for true, keyed, substituted in results:
        assert substituted >= STEPS // 2, substituted  # most counters were answered with another step
        assert len(true) == len(keyed) == STEPS
        for t, (a, b) in enumerate(zip(true, keyed)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y, err_msg=f"step {t}")


def test_a_key_that_lumps_branches_together_fails():
    """The check can fail: ModelAverage keyed by nothing (every step one key) averages at the first step's
    choice every time."""
    class Lumped(ModelAverage):
        def branch_key(self, step):
            return 0

    def both(comm):
        algorithm = Lumped(period=3)
        return trajectory(algorithm, comm), trajectory(algorithm, FirstOfKey(comm, algorithm))

    results, _ = run(2, both, timeout=30)
    true, keyed = results[0]
    assert any(not np.array_equal(a[0], b[0]) for a, b in zip(true, keyed))
