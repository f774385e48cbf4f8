"""DiLoCo and Streaming DiLoCo on N simulated ranks against the numpy reference (bagua_x.testing.reference)."""

import numpy as np
import pytest

from bagua_x.algorithms import DiLoCo, TopK
from bagua_x.algorithms.compression import codec
from bagua_x.core import BaguaXError
from bagua_x.testing import flat_layout, reference, run

NUMEL = 301  # not a multiple of any rank count or fragment count: padding and uneven fragments
STEPS = 13


def inner_step(x, rank, t):
    """A worker's inner optimizer step: a rank- and step-dependent move (what local training does)."""
    rng = np.random.default_rng(1000 * rank + t)
    return (x - 0.05 * rng.standard_normal(x.shape)).astype(np.float32)


def simulate(alg: DiLoCo, n: int, steps: int = STEPS, local_size=None):
    x0 = np.random.default_rng(7).standard_normal(NUMEL).astype(np.float32)

    def fn(c):
        x = x0.copy()
        state = alg.init(x, flat_layout(x), c.size)
        out = []
        for t in range(steps):
            x = inner_step(x, c.rank if local_size is None else c.rank // local_size, t)
            x, state = alg.reduce(x, flat_layout(x), state, c)
            out.append(np.asarray(x).copy())
        return out, state

    results, comms = run(n, fn, local_size=local_size)
    workers = n if local_size is None else n // local_size
    ref = reference.DiLoCoWorkers(x0, workers, alg.sync_every, alg.outer_lr, alg.outer_momentum, alg.nesterov,
                                  alg.fragments, alg.fragment_sync_delay, alg.fragment_update_alpha, alg.bits)
    xs, want = [x0.copy() for _ in range(workers)], []
    for t in range(steps):
        xs = ref.after_step([inner_step(x, w, t) for w, x in enumerate(xs)])
        want.append(xs)
    return results, comms, want


CASES = [
    dict(sync_every=3),
    dict(sync_every=4, nesterov=False, outer_momentum=0.5),
    dict(sync_every=4, fragments=2),
    dict(sync_every=6, fragments=3, fragment_sync_delay=1),
    dict(sync_every=4, fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5),
    dict(sync_every=5, fragment_sync_delay=4),
]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_full_precision_matches_reference(n, kw):
    alg = DiLoCo(**kw)
    results, comms, want = simulate(alg, n)
    assert len(results) == n
    moved = False
    for r, (got, state) in enumerate(results):
        assert len(got) == STEPS
        for t in range(STEPS):
            # float32 mean vs the float64 one, through <= 4 outer steps of size ~1: seen <= 4e-7
            assert np.abs(got[t] - want[t][r]).max() <= 2e-6, (r, t)
        assert int(state.step) == STEPS
        assert np.abs(np.asarray(state.global_weights) - np.asarray(got[-1])).max() >= 0  # held apart from local
    for t in range(1, STEPS):
        moved |= not np.array_equal(want[t][0], want[t][1])
    assert moved  # the workers do drift apart between syncs: a reference that synced every step would not
    syncs = sum(1 for t in range(1, STEPS + 1) for o in alg.offsets() if t >= o and (t - o) % alg.sync_every == 0)
    for c in comms:
        assert c.ops() == ["allreduce"] * syncs
        assert c.bytes_sent() == pytest.approx(
            syncs / alg.fragments * alg.sync_every * alg.wire_bytes(flat_layout(NUMEL), 4, n), rel=0.02)


def test_sync_lands_global_weights_on_every_rank():
    """After a sync step (delay 0, alpha 0) every rank holds the same weights, equal to the new global copy."""
    alg = DiLoCo(sync_every=3)
    results, _, _ = simulate(alg, 3, steps=6)
    for t in (2, 5):
        assert all(np.array_equal(results[0][0][t], results[r][0][t]) for r in range(3))
    assert not np.array_equal(results[0][0][3], results[1][0][3])  # and drift apart again in between
    assert np.array_equal(results[0][0][5], np.asarray(results[0][1].global_weights))


def test_sign_moves_towards_the_workers():
    """The pseudo-gradient is global - local: the outer step moves the global weights towards where the
    workers went (torchft once had it backwards)."""
    alg = DiLoCo(sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    x0 = np.zeros(4, np.float32)

    def fn(c):
        state = alg.init(x0, flat_layout(x0), c.size)
        return alg.reduce(x0 + 1.0 + c.rank, flat_layout(x0), state, c)[0]

    results, _ = run(2, fn)
    assert np.allclose(results[0], 1.5)  # lr 1, no momentum: exactly the workers' mean


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kw", [dict(sync_every=2), dict(sync_every=4, fragments=2, fragment_sync_delay=1)])
def test_quantized_matches_reference(bits, kw):
    alg = DiLoCo(bits=bits, **kw)
    results, comms, want = simulate(alg, 4, steps=8)
    exact = simulate(DiLoCo(**kw), 4, steps=8)[2]
    step = reference.step_size(np.concatenate([want[1][0] - exact[1][0], [0.0, 0.2]]), 255 if bits == 8 else 15)
    for r, (got, _) in enumerate(results):
        for t in range(8):
            # a code may round the other way between the float orders of numpy and the algorithm: one step of the
            # pseudo-gradient's range (<= 0.2 here), times the outer step's 0.7 (1 + 0.9 + 0.81) for momentum
            assert np.abs(got[t] - want[t][r]).max() <= 2.0 * step * 0.7 * 2.71 + 1e-6, (r, t)
    quantisation_error = max(np.abs(want[t][0] - exact[t][0]).max() for t in range(8))
    assert quantisation_error > 1e-5  # the quantised path really is quantised
    for c in comms:
        assert set(c.ops()) == {"alltoall", "allgather"}


def test_four_bits_send_half_of_eight():
    sent = {}
    for bits in (8, 4):
        _, comms, _ = simulate(DiLoCo(sync_every=2, bits=bits), 2, steps=2)
        sent[bits] = comms[0].bytes_sent()
    full = simulate(DiLoCo(sync_every=2), 2, steps=2)[1][0].bytes_sent()
    assert sent[8] == pytest.approx(full / 4, rel=0.1)
    assert sent[4] == pytest.approx(sent[8] / 2, rel=0.1)


def test_nibble_codec_roundtrip_is_reference():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 10)).astype(np.float32)
    forms = codec(4)
    packed = forms.compress(x)
    assert packed.shape == (3, 5 + 8) and packed.dtype == np.uint8
    got = forms.decompress(packed)
    for row in range(3):
        assert np.abs(got[row] - reference.roundtrip(x[row], 15)).max() <= 1e-6


def test_two_levels_node_is_one_worker():
    """On 2 nodes of 2 ranks, a node's ranks (kept identical by the frontend's in-node gradient averaging) are
    one worker: the result is 2-worker DiLoCo, and each rank carries half the node's exchange."""
    alg = DiLoCo(sync_every=3, fragments=3, fragment_sync_delay=0)
    results, comms, want = simulate(alg, 4, local_size=2)
    for r, (got, _) in enumerate(results):
        for t in range(STEPS):
            assert np.abs(got[t] - want[t][r // 2]).max() <= 2e-6, (r, t)
    flat_bytes = simulate(alg, 2)[1][0].bytes_sent()
    assert comms[0].across.bytes_sent() == pytest.approx(flat_bytes / 2, rel=0.05)


@pytest.mark.parametrize("kw, words", [
    (dict(sync_every=4, fragments=2, fragment_sync_delay=2), "fragment_sync_delay must be"),
    (dict(sync_every=2, fragments=3), "fragments must be between 1 and sync_every"),
    (dict(sync_every=0), "sync_every must be >= 1"),
    (dict(bits=16), "bits must be 32, 8 or 4"),
    (dict(fragment_update_alpha=1.5), "fragment_update_alpha must be in [0, 1]"),
    (dict(outer_momentum=1.0), "outer_momentum in [0, 1)"),
])
def test_bad_keywords_refused(kw, words):
    with pytest.raises(BaguaXError, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        DiLoCo(**kw)


@pytest.mark.parametrize("kw", [dict(sync_every=6, fragments=3, fragment_sync_delay=1),
                                dict(sync_every=4, fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5),
                                dict(sync_every=5, fragment_sync_delay=4, bits=4)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_the_exchange_can_stay_in_flight_for_its_lag(kw):
    """What a frontend overlapping the exchange does (torch's WeightEngine): ``apply`` on the live weights, then
    ``exchange`` on a snapshot while the next inner step already moves the weights, its state taken back only
    before the next ``apply``.  The contract that allows it: apply sends nothing, exchange changes only
    ``pending`` and never the weights; and the result is the reference's, step by step."""
    alg = DiLoCo(**kw)
    assert alg.exchange_lag == alg.fragment_sync_delay >= 1
    n = 2
    _, _, want = simulate(alg, n)
    x0 = np.random.default_rng(7).standard_normal(NUMEL).astype(np.float32)

    def fn(c):
        x = x0.copy()
        state = alg.init(x, flat_layout(x), c.size)
        in_flight = None  # (snapshot, state) of the exchange launched at the previous step
        out, apply_sent = [], 0
        for t in range(STEPS):
            x = inner_step(x, c.rank, t)  # training goes on while the previous exchange is in flight
            if in_flight is not None:
                snapshot, before = in_flight
                state = alg.exchange(snapshot, flat_layout(x), before, c)  # lands before this step's apply
                assert all(np.array_equal(a, b) for a, b in zip(state[:3], before[:3]))  # only pending moved
            sent = len(c.sent)
            x, state = alg.apply(x, flat_layout(x), state, c)
            apply_sent += len(c.sent) - sent
            in_flight = (np.array(x, copy=True), state)
            out.append(np.asarray(x).copy())
        return out, apply_sent

    results, _ = run(n, fn)
    assert len(results) == n
    for r, (got, apply_sent) in enumerate(results):
        assert apply_sent == 0
        for t in range(STEPS):
            assert np.abs(got[t] - want[t][r]).max() <= (2e-6 if alg.bits == 32 else 1e-3), (r, t)


@pytest.mark.parametrize("kw", [dict(sync_every=4), dict(sync_every=6, fragments=3),
                                dict(sync_every=8, fragments=2, fragment_sync_delay=2)])
def test_communicates_exactly_at_the_steps_that_exchange(kw):
    """``communicates(state)`` (decided on the host) is True exactly before the reduces that make collectives:
    a frontend prepares the peers only then (fault-tolerant quorums), so a wrong answer would exchange unprepared
    or make every inner step wait for a quorum."""
    alg = DiLoCo(**kw)

    def job(c):
        x = np.linspace(-1, 1, 12).astype(np.float32) * (c.rank + 1)
        state = alg.init(x, flat_layout(x), c.size)
        seen = []
        for _ in range(3 * alg.sync_every):
            predicted, before = alg.communicates(state), len(c.ops())
            x, state = alg.reduce(x * np.float32(0.9), flat_layout(x), state, c)
            seen.append((predicted, len(c.ops()) > before))
        return seen

    seen = run(2, job)[0][0]
    assert len(seen) == 3 * alg.sync_every
    assert all(predicted == exchanged for predicted, exchanged in seen), seen
    # each fragment once per H steps; with a delay a fragment is sent at the step after its launch, so the one
    # launched at the last step (the last fragment's offset is H) is sent after this window
    assert sum(exchanged for _, exchanged in seen) == 3 * alg.fragments - (1 if alg.fragment_sync_delay else 0)


@pytest.mark.parametrize("kw", [dict(sync_every=6, fragments=3, fragment_sync_delay=1),
                                dict(sync_every=8, fragments=2, fragment_sync_delay=2, bits=8),
                                dict(sync_every=4, fragments=2, fragment_sync_delay=1, compression=TopK(0.1, 2, 16))],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_with_a_delay_reduce_sends_the_previous_launch_reading_the_state_alone(kw):
    """What lets XLA overlap a JAX step's exchange with its compute: with a delay, ``reduce`` makes no collective
    at a launch step, and at the step after it sends that fragment from the state alone.  So ``pending`` and
    ``error`` come out the same whatever weights that step is given; a send that read them would differ."""
    alg = DiLoCo(**kw)
    launch = alg.offsets()[0]  # 1-based step of the first launch

    def job(c):
        x = np.linspace(-1, 1, NUMEL).astype(np.float32) * (c.rank + 1)
        state = alg.init(x, flat_layout(x), c.size)
        collective = []
        for t in range(launch):
            before = len(c.ops())
            x, state = alg.reduce(inner_step(x, c.rank, t), flat_layout(x), state, c)
            collective.append(len(c.ops()) > before)
        before = len(c.ops())
        _, one = alg.reduce(inner_step(x, c.rank, launch), flat_layout(x), state, c)
        _, other = alg.reduce(x * np.float32(-3.0), flat_layout(x), state, c)
        return collective, len(c.ops()) > before, one, other

    results, _ = run(2, job)
    assert len(results) == 2
    for collective, sent, one, other in results:
        assert collective == [False] * launch and sent
        assert np.array_equal(one.pending, other.pending) and np.array_equal(one.error, other.error)
        assert np.any(one.pending != 0)  # the fragment's average arrived
