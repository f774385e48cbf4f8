"""Decentralized ("all" / "shift_one") on N simulated ranks against the numpy reference, over many steps."""

import numpy as np
import pytest

import reference as ref
from bagua_x.algorithms import Decentralized, Phase, Target
from bagua_x.algorithms.decentralized import shift_one_pairs, shift_one_peer
from bagua_x.core import BaguaXError
from bagua_x.testing import flat_layout, run

NUMEL = 500
STEPS = 7


def noise(n, step):
    """What each rank's optimizer adds between two exchanges (different on every rank)."""
    rng = np.random.default_rng(10 * n + step)
    return [rng.standard_normal(NUMEL).astype(np.float32) for _ in range(n)]


def simulate(alg, n):
    """Each rank: x += noise, reduce; returns per-rank lists of x after every step and the states."""
    def fn(c):
        x = noise(n, -1)[c.rank]
        state = alg.init(x, flat_layout(x), n)
        xs, steps = [], []
        for t in range(STEPS):
            x, state = alg.reduce(x + noise(n, t)[c.rank], flat_layout(x + noise(n, t)[c.rank]), state, c)
            xs.append(x)
            steps.append(state.step)
        return xs, steps
    return run(n, fn)


def reference(mode, n, interval):
    xs, history = noise(n, -1), []
    for t in range(STEPS):
        xs = ref.decentralized([x + e for x, e in zip(xs, noise(n, t))], mode, t, interval)
        history.append(xs)
    return history


@pytest.mark.parametrize("mode, n", [("all", 2), ("all", 3), ("all", 4), ("all", 8),
                                     ("shift_one", 2), ("shift_one", 4), ("shift_one", 8)])
@pytest.mark.parametrize("interval", [1, 2, 3])
def test_matches_reference_over_steps(mode, n, interval):
    alg = Decentralized(peer_selection_mode=mode, communication_interval=interval)
    out, comms = simulate(alg, n)
    want = reference(mode, n, interval)
    assert len(out) == n
    for r in range(n):
        xs, steps = out[r]
        assert len(xs) == len(want) == STEPS
        for t in range(STEPS):
            assert xs[t].shape == (NUMEL,) and xs[t].dtype == np.float32
            # "all": float32 sum vs the correctly rounded reference, compounded over 7 steps: seen <= 1.43e-6
            # (N = 4, interval 1) on values up to ~5; shift_one: the same float32 (x + y) / 2: seen 0
            assert np.abs(xs[t] - want[t][r]).max() <= (1.5e-6 if mode == "all" else 0)
        assert [int(s) for s in steps] == list(range(1, STEPS + 1))  # the counter counts every call
        assert all(np.asarray(s).dtype == np.int32 and np.ndim(s) == 0 for s in steps)
    communications = len(range(0, STEPS, interval))  # steps 0, interval, 2 interval, ...
    for c in comms:
        assert c.ops() == ["allreduce" if mode == "all" else "permute"] * communications
        assert c.bytes_sent() == pytest.approx(communications * interval * alg.wire_bytes(flat_layout(NUMEL), 4, n))


@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_shift_one_pairs_are_symmetric_and_rotate(n):
    seen = set()
    for s in range(3 * n):
        pairs = shift_one_pairs(n, s)
        assert [d for _, d in pairs] == [ref.shift_one_peer(r, n, s) for r in range(n)]
        assert all(type(s_) is int and type(d) is int for s_, d in pairs)  # ranks, not floats
        peer = dict(pairs)
        assert all(peer[peer[r]] == r and peer[r] != r for r in range(n))  # a perfect matching
        assert all((r < n // 2) != (peer[r] < n // 2) for r in range(n))  # across the two halves
        seen.add(peer[0])
    assert seen == set(range(n // 2, n))  # rank 0 meets every rank of the other half in turn


def test_shift_one_peer_formula():
    assert [shift_one_peer(r, 4, 0) for r in range(4)] == [2, 3, 0, 1]
    assert [shift_one_peer(r, 4, 1) for r in range(4)] == [3, 2, 1, 0]
    assert [shift_one_peer(r, 6, 2) for r in range(6)] == [5, 3, 4, 1, 2, 0]


@pytest.mark.parametrize("n", [3, 5])
def test_shift_one_refuses_an_odd_number_of_ranks(n):
    alg = Decentralized(peer_selection_mode="shift_one")
    with pytest.raises(BaguaXError, match=rf"even number of ranks.*got {n}.*peer_selection_mode='all' instead"):
        alg.init(np.zeros(4, np.float32), flat_layout(np.zeros(4, np.float32)), n)
    assert Decentralized().init(np.zeros(4, np.float32), flat_layout(np.zeros(4, np.float32)), n).step == 0  # "all" takes any N


def test_refuses_bad_settings():
    with pytest.raises(BaguaXError, match="'all' or 'shift_one', got 'ring'"):
        Decentralized(peer_selection_mode="ring")
    with pytest.raises(BaguaXError, match="communication_interval must be >= 1, got 0"):
        Decentralized(communication_interval=0)
    Decentralized(communication_interval=1)


def test_declarations():
    all_, shift = Decentralized(), Decentralized("shift_one", 4)
    assert (all_.peer_selection_mode, all_.communication_interval) == ("all", 1)
    assert (all_.target, all_.phase) == (Target.WEIGHT, Phase.BEFORE_FORWARD)
    assert all_.donates_input is True and shift.donates_input is False  # shift_one reads x after the exchange
    assert all_.wire_bytes(flat_layout(1000), 4, 4) == 2 * 3 / 4 * 4000
    assert Decentralized("all", 2).wire_bytes(flat_layout(1000), 4, 4) == 2 * 3 / 4 * 4000 / 2
    assert shift.wire_bytes(flat_layout(1000), 4, 4) == 4000 / 4
