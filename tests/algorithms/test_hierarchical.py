"""Hierarchical variants on N simulated ranks in nodes of L, against the numpy reference's hierarchical math.

Each rank's ``within`` and ``across`` communicators record their own traffic, so
the tests also check what crosses between nodes: only the flat algorithm's
(compressed) exchange among the nodes, on one shard per rank.
"""

import numpy as np
import pytest

import reference as ref
from bagua_x import testing
from bagua_x.algorithms import ByteGrad, Decentralized, EmptyState, GradientAllReduce, LowPrecisionDecentralized, QAdam
from bagua_x.algorithms.base import compressed_bytes, over_nodes
from bagua_x.core import BaguaXError
from bagua_x.core.comm import Feature, ReduceOp
from bagua_x.testing import flat_layout, run

TOPOLOGIES = [(4, 2), (8, 2), (8, 4)]  # (ranks, ranks per node): 2x2, 4 nodes of 2, 2 nodes of 4
NUMEL = 1600  # a multiple of every world size here
STEPS = 4


def values(n, step, scale=0.05):
    rng = np.random.default_rng(100 * n + step)
    return [(rng.standard_normal(NUMEL) * scale).astype(np.float32) for _ in range(n)]


def gradient_job(alg, n, steps=STEPS):
    def fn(c):
        state = alg.init(values(n, 0)[c.rank], flat_layout(NUMEL), n)
        outs = []
        for t in range(steps):
            result, state = alg.reduce(values(n, t)[c.rank].copy(), flat_layout(NUMEL), state, c)
            outs.append(np.copy(result))
        return outs
    return fn


def check_nodes_agree(outs, n, local):
    for r in range(n):  # every rank of a node holds its node's result, bitwise
        assert np.array_equal(outs[r], outs[r - r % local])


@pytest.mark.parametrize("n, local", TOPOLOGIES)
@pytest.mark.parametrize("average", [True, False])
def test_bytegrad(n, local, average):
    alg = ByteGrad(average=average)  # hierarchical=None: on, with >= 2 nodes of >= 2 ranks
    out, comms = run(n, gradient_job(alg, n), local_size=local)
    assert len(out) == n
    for t in range(STEPS):
        want = ref.bytegrad_hierarchical(values(n, t), local, average)
        got = [out[r][t] for r in range(n)]
        check_nodes_agree(got, n, local)
        for r in range(n):
            assert got[r].shape == want[r].shape == (NUMEL,)
            # the same codes (float32 node means vs the reference's float64 ones): seen <= 8.9e-8 over every
            # topology and step; a flipped code is a step (~1e-3 here), a flat ByteGrad (other chunks) or no
            # compression is off in most elements
            assert np.abs(got[r] - want[r]).max() <= 1.5e-7
    for c in comms:  # the node's full-precision average, then its 8-bit results shared; only uint8 between nodes
        assert c.sent == [] and c.within.ops() == ["reduce_scatter", "allgather"] * STEPS
        assert [s.dtype for s in c.within.sent] == [np.float32, np.uint8] * STEPS
        assert c.across.ops() == ["alltoall", "allgather"] * STEPS and all(s.dtype == np.uint8 for s in c.across.sent)
        # the flat algorithm among the nodes on this rank's 1/L shard
        assert c.across.bytes_sent() == pytest.approx(STEPS * compressed_bytes(NUMEL // local, n // local))


def test_flat_when_asked_or_when_the_communicator_has_no_nodes():
    xs = values(4, 0)
    flat_ref = ref.bytegrad(xs)
    for alg, local in [(ByteGrad(hierarchical=False), 2), (ByteGrad(), None), (ByteGrad(hierarchical=True), None)]:
        out, comms = run(4, lambda c: alg.reduce(xs[c.rank].copy(), flat_layout(NUMEL), EmptyState(), c)[0], local_size=local)
        assert all(c.ops() == ["alltoall", "allgather"] for c in comms)
        assert all(np.abs(o - w).max() <= 1e-7 for o, w in zip(out, flat_ref))


def test_the_setting_read_back_from_the_features_and_the_layout_rule():
    from bagua_x.core.topology import two_level_on

    assert [ByteGrad(hierarchical=h).hierarchical_setting for h in (True, None, False)] == [True, None, False]
    assert [ByteGrad(hierarchical=h).timed_form for h in (True, None, False)] == [False, True, False]
    assert GradientAllReduce().hierarchical_setting is False and QAdam().hierarchical_setting is None
    # None: >= 2 nodes of >= 2 ranks; True: any >= 2 nodes; False: never
    assert [two_level_on(None, n, r) for n, r in ((2, 2), (2, 1), (1, 4))] == [True, False, False]
    assert [two_level_on(True, n, r) for n, r in ((2, 1), (1, 4))] == [True, False]
    assert not two_level_on(False, 4, 4)


def test_default_is_flat_with_one_rank_per_node_and_forced_runs_in_two_levels():
    out, comms = run(4, gradient_job(ByteGrad(), 4, steps=1), local_size=1)
    assert all(c.ops() == ["alltoall", "allgather"] and c.within.sent == [] for c in comms)
    out, comms = run(4, gradient_job(ByteGrad(hierarchical=True), 4, steps=1), local_size=1)
    assert all(c.sent == [] and len(c.across.sent) == 2 for c in comms)  # one rank per node: the flat exchange
    assert all(np.abs(o[0] - w).max() <= 1e-7 for o, w in zip(out, ref.bytegrad(values(4, 0))))


@pytest.mark.parametrize("n, local", TOPOLOGIES)
def test_gradient_allreduce(n, local):
    out, comms = run(n, gradient_job(GradientAllReduce(hierarchical=True), n, steps=1), local_size=local)
    want = testing.reference.allreduce(values(n, 0))
    for o, w, c in zip(out, want, comms):
        assert np.abs(o[0] - w).max() <= 1e-8  # another float32 summation order: seen <= 7.5e-9
        assert c.across.bytes_sent() == pytest.approx(2 * (n // local - 1) / (n // local) * NUMEL // local * 4)
    assert GradientAllReduce().uses == frozenset()  # off by default, as in Bagua


@pytest.mark.parametrize("n, local", TOPOLOGIES)
@pytest.mark.parametrize("mode, interval", [("all", 1), ("shift_one", 1), ("shift_one", 2)])
def test_decentralized(n, local, mode, interval):
    alg = Decentralized(peer_selection_mode=mode, communication_interval=interval)
    out, comms = run(n, gradient_job(alg, n), local_size=local)
    for t in range(STEPS):
        want = ref.decentralized_hierarchical(values(n, t), local, mode, t, interval)
        got = [out[r][t] for r in range(n)]
        if t % interval == 0:
            check_nodes_agree(got, n, local)
        for r in range(n):
            assert np.abs(got[r] - want[r]).max() <= 1e-8  # float32 node means: seen <= 7.5e-9
    exchanges = len(range(0, STEPS, interval))
    for c in comms:
        assert len(c.across.sent) == exchanges and c.sent == []
        assert c.across.ops() == ["allreduce" if mode == "all" else "permute"] * exchanges


def test_decentralized_shift_one_needs_an_even_number_of_nodes():
    alg = Decentralized(peer_selection_mode="shift_one")
    with pytest.raises(BaguaXError, match="even number of them, got 3; pass hierarchical=False"):
        run(6, gradient_job(alg, 6, steps=1), local_size=2)


@pytest.mark.parametrize("n, local", TOPOLOGIES)
@pytest.mark.parametrize("interval", [1, 2])
def test_low_precision_decentralized(n, local, interval):
    alg = LowPrecisionDecentralized(communication_interval=interval)
    start = [values(n, 99, scale=0.1)[0]] * n  # the same weights everywhere, as after wrap's broadcast

    def fn(c):
        x = start[c.rank]
        state = alg.init(x, flat_layout(NUMEL), n)
        history = []
        for t in range(STEPS):
            x, state = alg.reduce(x + values(n, t, 0.01)[c.rank], flat_layout(NUMEL), state, c)
            history.append((np.copy(x), type(state)(*map(np.copy, state))))
        return history

    out, comms = run(n, fn, local_size=local)
    xs = start
    node_states = [{"w": xs[k].copy(), "left": xs[k].copy(), "right": xs[k].copy()} for k in range(0, n, local)]
    for t in range(STEPS):
        moved = [x + e for x, e in zip(xs, values(n, t, 0.01))]
        xs, node_states = ref.low_precision_hierarchical(moved, local, node_states, t, interval)
        for r in range(n):
            x, state = out[r][t]
            # float32 node means vs the reference's float64 ones: seen <= 3e-8 after 4 steps; a flipped code
            # is a step (~1e-4 here) and a flat ring of ranks differs everywhere
            assert np.abs(x - xs[r]).max() <= 5e-8
            if t % interval == 0:  # after an exchange every rank of a node holds the node's state
                for key in ("w", "left", "right"):
                    assert np.abs(getattr(state, key) - node_states[r // local][key]).max() <= 5e-8, key  # seen 3e-8
                    assert np.array_equal(getattr(state, key), getattr(out[r - r % local][t][1], key))
    exchanges = len(range(0, STEPS, interval))
    neighbours = 1 if n // local == 2 else 2  # a ring of two nodes: the one neighbour's message once
    for c in comms:  # between nodes: this rank's 8-bit shard to both neighbouring nodes
        assert c.across.ops() == ["permute"] * neighbours * exchanges
        assert all(s.dtype == np.uint8 and s.shape == (1, NUMEL // local + 8) for s in c.across.sent)


@pytest.mark.parametrize("n, local", TOPOLOGIES)
@pytest.mark.parametrize("warmup_steps", [1, 2])
def test_qadam(n, local, warmup_steps):
    alg = QAdam(lr=0.01, warmup_steps=warmup_steps)
    rng = np.random.default_rng(7)
    sign = np.where(rng.random(NUMEL) < 0.5, -1, 1).astype(np.float32)  # averages away from 0 (v frozen)
    grads = [[(sign * rng.uniform(0.05, 0.15, NUMEL)).astype(np.float32) for _ in range(n)] for _ in range(STEPS)]
    start = (rng.standard_normal(NUMEL) * 0.5).astype(np.float32)

    def fn(c):
        p = start.copy()
        state = alg.init(p, flat_layout(NUMEL), n)
        history = []
        for t in range(STEPS):
            update, state = alg.step(grads[t][c.rank], p, flat_layout(NUMEL), state, c)
            p = p + update
            history.append(p)
        return history

    out, comms = run(n, fn, local_size=local)
    want = ref.qadam(start, grads, lr=0.01, warmup_steps=warmup_steps, local=local)
    flat = ref.qadam(start, grads, lr=0.01, warmup_steps=warmup_steps)
    for t in range(STEPS):
        for r in range(n):
            assert np.abs(out[r][t] - want[t]).max() <= 1e-6  # float32 Adam vs float64: seen <= 7.8e-7
    assert np.abs(want[-1] - flat[-1]).max() > 1e-4  # the hierarchical math is not the flat one: seen >= 3.7e-4
    for c in comms:
        warm = min(warmup_steps, STEPS)
        assert c.across.ops() == ["allreduce"] * warm + ["alltoall", "allgather"] * (STEPS - warm)
        assert all(s.dtype == np.uint8 for s in c.across.sent[warm:])


def test_declarations():
    for alg in (ByteGrad(), Decentralized(), LowPrecisionDecentralized(), QAdam()):
        assert alg.hierarchical is None and alg.uses == {Feature.HIERARCHICAL} and alg.requires == frozenset()
        assert type(alg)(hierarchical=True).requires == {Feature.HIERARCHICAL}
        assert type(alg)(hierarchical=False).uses == frozenset()
        assert alg.hyperparameters()["hierarchical"] is None
    assert Decentralized().alignment(8) == LowPrecisionDecentralized().alignment(8) == 8
    assert Decentralized(hierarchical=False).alignment(8) == 1


@pytest.mark.parametrize("n, local", TOPOLOGIES)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG])
def test_over_nodes_pads_a_bucket_for_the_shards_and_keeps_its_shape(n, local, op):
    """21 elements split over a node's 2 or 4 ranks: padded for the shards, cut back, the input's shape kept."""
    xs = [np.arange(21, dtype=np.float32).reshape(3, 7) * (r + 1) for r in range(n)]
    exchange = lambda shard, across: across.allreduce(shard, op)  # noqa: E731
    out, comms = run(n, lambda c: over_nodes(xs[c.rank], c, exchange, op), local_size=local)
    want = sum(xs) / (n if op is ReduceOp.AVG else 1)
    assert len(out) == n
    for o in out:  # integers, so the sums are exact; the means are within float32 rounding (seen 0)
        assert o.shape == (3, 7) and np.abs(o - want).max() <= 1e-6 * np.abs(want).max()
    for c in comms:  # the node's shards: 22 or 24 elements in rows of 11 or 6
        assert c.within.sent[0].shape == (local, -(-21 // local)) and c.within.sent[0].dtype == np.float32


@pytest.mark.parametrize("local", [2, None])
@pytest.mark.parametrize("average", [True, False])
def test_bytegrad_writes_over_a_writable_bucket_and_leaves_a_read_only_one(local, average):
    """torch and numpy buckets are overwritten in place (donates_input); a read-only one (JAX) gets a new array."""
    xs = values(4, 0)
    alg = ByteGrad(average=average)

    def fn(c):
        mutable, frozen = xs[c.rank].copy(), xs[c.rank].copy()
        frozen.flags.writeable = False
        a, _ = alg.reduce(mutable, flat_layout(NUMEL), EmptyState(), c)
        b, _ = alg.reduce(frozen, flat_layout(NUMEL), EmptyState(), c)
        return a is mutable, b is not frozen and np.array_equal(frozen, xs[c.rank]), a, b

    out, _ = run(4, fn, local_size=local)
    want = ref.bytegrad_hierarchical(xs, 2, average) if local else ref.bytegrad(xs, average)
    assert len(out) == len(want) == 4
    for (in_place, frozen_kept, a, b), w in zip(out, want):
        assert in_place and frozen_kept and np.array_equal(a, b) and a.dtype == b.dtype == np.float32
        assert np.abs(a - w).max() <= 1e-7  # seen 0 here; a flipped code is a step of ~1e-3


def test_bytegrad_pads_its_shard_when_the_nodes_do_not_divide_it():
    """Fault-tolerant replica groups lay buckets out for one node, then the number of nodes changes: 3 nodes of 2
    ranks on 20 elements (shards of 10, not a multiple of 3).  Each shard travels padded with zeros to 12 and comes
    back cut to 10: the reference's over-nodes ByteGrad on padded shards, bitwise across a node's ranks."""
    n, local, numel = 6, 2, 20
    rng = np.random.default_rng(7)
    xs = [(rng.standard_normal(numel) * 0.05).astype(np.float32) for _ in range(n)]
    out, comms = run(n, lambda c: ByteGrad(hierarchical=True).reduce(xs[c.rank].copy(), flat_layout(numel),
                                                                     EmptyState(), c)[0], local_size=local)
    pad = lambda ys: [np.concatenate([y, np.zeros(2, np.float32)]) for y in ys]  # noqa: E731
    want = ref.over_nodes(xs, local, lambda ys: [y[:10] for y in ref.bytegrad(pad(ys), True)])
    assert len(out) == n
    check_nodes_agree(out, n, local)
    for o, w in zip(out, want):
        assert o.shape == w.shape == (numel,)
        assert np.abs(o - w).max() <= 1e-7  # the same codes; the unpadded exchange would not even run (10 % 3)
    assert all(c.across.ops() == ["alltoall", "allgather"] for c in comms)


def test_replica_groups_always_run_over_nodes():
    """Over fault-tolerant replica groups a node is one worker whatever the count of nodes, even one."""
    from bagua_x.algorithms.base import hierarchical

    class Comm:
        def __init__(self, features, nodes, local):
            self.features = frozenset(features)
            self.across, self.within = type("C", (), {"size": nodes})(), type("C", (), {"size": local})()

    for nodes, local in [(1, 2), (2, 1), (3, 2)]:
        assert hierarchical(True, Comm({Feature.HIERARCHICAL, Feature.REPLICA_GROUPS}, nodes, local))
        assert hierarchical(None, Comm({Feature.HIERARCHICAL, Feature.REPLICA_GROUPS}, nodes, local))
        assert not hierarchical(False, Comm({Feature.HIERARCHICAL, Feature.REPLICA_GROUPS}, nodes, local))
    assert not hierarchical(True, Comm({Feature.HIERARCHICAL}, 1, 2))  # plain node groups: one node is flat
