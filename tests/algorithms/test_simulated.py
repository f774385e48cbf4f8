"""The simulated communicator itself, against numpy: shape conventions of core/comm.py, bytes, failures."""

import time

import numpy as np
import pytest

from bagua_x.core import Communicator, ReduceOp
from bagua_x.testing import CollectiveError, run

SIZES = [1, 2, 3, 4]


def inputs(n, shape=(3, 5), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op, fn", [(ReduceOp.SUM, np.sum), (ReduceOp.AVG, np.mean),
                                    (ReduceOp.MIN, np.min), (ReduceOp.MAX, np.max)])
def test_allreduce(n, op, fn):
    xs = inputs(n)
    out, _ = run(n, lambda c: c.allreduce(xs[c.rank], op))
    want = fn(np.stack(xs).astype(np.float64), axis=0)
    assert len(out) == n
    for o in out:
        assert o.shape == xs[0].shape and o.dtype == np.float32
        assert np.abs(o - want).max() <= 1e-6  # float32 sums of <= 4 values ~ N(0,1): seen <= 5e-7


def test_integer_average_floors():
    out, _ = run(3, lambda c: c.allreduce(np.array([c.rank, 7], np.int32), ReduceOp.AVG))
    assert all(np.array_equal(o, [1, 7]) and o.dtype == np.int32 for o in out)


@pytest.mark.parametrize("n", SIZES)
def test_allgather_alltoall_reduce_scatter_broadcast(n):
    xs = inputs(n, (n, 4))
    def job(c):
        return (c.allgather(xs[c.rank]), c.alltoall(xs[c.rank]), c.reduce_scatter(xs[c.rank], ReduceOp.SUM),
                c.reduce_scatter(xs[c.rank], ReduceOp.MAX), c.broadcast(xs[c.rank], root=n - 1))
    out, _ = run(n, job)
    for r, (gathered, a2a, rs_sum, rs_max, bcast) in enumerate(out):
        assert np.array_equal(gathered, np.stack(xs))  # (size, *x.shape), row i from rank i
        assert np.array_equal(a2a, np.stack([xs[src][r] for src in range(n)]))  # row i came from rank i
        assert np.abs(rs_sum - np.sum([x[r] for x in xs], axis=0)).max() <= 1e-6  # seen <= 5e-7
        assert np.array_equal(rs_max, np.max([x[r] for x in xs], axis=0))
        assert np.array_equal(bcast, xs[n - 1])


def test_permute_sends_to_listed_destinations_and_zeros_elsewhere():
    xs = inputs(4)
    pairs = [(0, 1), (1, 0), (2, 2)]  # rank 3 receives nothing, rank 2 keeps its own
    out, comms = run(4, lambda c: c.permute(xs[c.rank], pairs))
    assert np.array_equal(out[0], xs[1]) and np.array_equal(out[1], xs[0])
    assert np.array_equal(out[2], xs[2]) and np.array_equal(out[3], np.zeros_like(xs[3]))
    assert [c.bytes_sent() for c in comms] == [xs[0].nbytes, xs[0].nbytes, 0, 0]


def test_switch_runs_the_indexed_branch():
    out, comms = run(2, lambda c: c.switch(np.int32(c.rank), [lambda o: o + 1, lambda o: o * 10], 3))
    assert out == [4, 30] and all(c.sent == [] for c in comms)  # not a collective


def test_inputs_are_copied_and_results_are_fresh():
    def job(c):
        x = np.ones(4, np.float32)
        y = c.allreduce(x, ReduceOp.SUM)
        x[:] = 100  # changing the input afterwards changes neither the result nor the record
        return y, c.sent[0].data
    out, _ = run(2, job)
    for y, recorded in out:
        assert np.array_equal(y, [2, 2, 2, 2]) and np.array_equal(recorded, np.ones(4))


@pytest.mark.parametrize("n", [2, 4])
def test_bytes_sent(n):
    x = np.zeros((n, 10), np.float32)  # 40 n bytes
    def job(c):
        c.allreduce(x)
        c.allgather(x)
        c.alltoall(x)
        c.reduce_scatter(x)
        c.broadcast(x, root=1)
        return None
    _, comms = run(n, job)
    b = x.nbytes
    for c in comms:
        assert c.ops() == ["allreduce", "allgather", "alltoall", "reduce_scatter", "broadcast"]
        assert [s.nbytes for s in c.sent] == pytest.approx(
            [2 * (n - 1) / n * b, (n - 1) * b, (n - 1) / n * b, (n - 1) / n * b, b if c.rank == 1 else 0])


def test_has_every_member_of_the_protocol():
    # the protocol's own members (not isinstance: mutmut adds members to the class it mutates)
    members = [m for m in vars(Communicator) if not m.startswith("_") and m.isascii() and "mutmut" not in m]
    assert sorted(members) == sorted(["rank", "size", "features", "allreduce", "allgather", "alltoall", "reduce_scatter",
                                      "broadcast", "permute", "switch", "counter"])
    out, _ = run(1, lambda c: all(hasattr(c, m) for m in members))
    assert out == [True]


def test_mismatched_collectives_fail_on_every_rank():
    def job(c):
        x = np.zeros(3, np.float32)
        return c.allreduce(x) if c.rank == 0 else c.allgather(x)
    with pytest.raises(CollectiveError, match="mismatched collectives.*allreduce.*allgather"):
        run(2, job)


def test_mismatched_shapes_fail():
    with pytest.raises(CollectiveError, match="mismatched"):
        run(2, lambda c: c.allreduce(np.zeros(3 + c.rank, np.float32)))


def test_a_rank_that_skips_a_collective_fails_fast_instead_of_hanging():
    def job(c):
        if c.rank == 0:
            c.allreduce(np.zeros(3, np.float32))
    start = time.monotonic()
    with pytest.raises(CollectiveError, match="did not complete within 0.2 s"):
        run(2, job, timeout=0.2)
    assert time.monotonic() - start < 2


def test_a_rank_error_is_raised_and_releases_the_others():
    def job(c):
        if c.rank == 1:
            raise ValueError("boom")
        return c.allreduce(np.zeros(3, np.float32))
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom"):
        run(3, job, timeout=3)
    assert time.monotonic() - start < 1  # aborted, not timed out


def test_rows_checked():
    with pytest.raises(CollectiveError, match="first dimension of 2"):
        run(2, lambda c: c.alltoall(np.zeros((3, 2), np.float32)))


def test_nodes_are_consecutive_ranks_and_places_across_them():
    out, comms = run(8, lambda c: (c.within.allgather(np.array([c.rank])), c.across.allgather(np.array([c.rank]))),
                     local_size=4)
    for r, (within, across) in enumerate(out):
        assert within.ravel().tolist() == list(range(r - r % 4, r - r % 4 + 4))  # this rank's node
        assert across.ravel().tolist() == [r % 4, r % 4 + 4]  # this rank's place in each node
        assert (comms[r].within.rank, comms[r].across.rank) == (r % 4, r // 4)


def test_switch_wants_an_integer_index_in_range():
    with pytest.raises(CollectiveError, match="not an integer"):
        run(1, lambda c: c.switch(np.float64(1.0), [lambda o: o, lambda o: o], 0))
    with pytest.raises(CollectiveError, match="outside 2 branches"):
        run(1, lambda c: c.switch(2, [lambda o: o, lambda o: o], 0))
