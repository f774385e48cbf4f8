"""TopK (SparseLoCo's compression) against the numpy reference, and DiLoCo with it on simulated ranks."""

import math

import numpy as np
import pytest

from bagua_x.algorithms import DiLoCo, SparseLoCo, TopK
from bagua_x.core import BaguaXError
from bagua_x.testing import flat_layout, reference, run

SHAPES = [  # (numel, chunk): a short last chunk, a buffer shorter than one chunk, whole chunks
    (301, 64), (50, 64), (256, 64), (4096 + 7, 4096),
]


def sample(numel, seed=0):
    return np.random.default_rng(seed).standard_normal(numel).astype(np.float32)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel, chunk", SHAPES)
def test_codec_is_the_reference(numel, chunk, bits):
    """What is sent equals the reference exactly (same float32 formula), the payload decodes to it, and its size
    is the analytic one."""
    tk = TopK(fraction=0.05, bits=bits, chunk=chunk)
    x = sample(numel)
    payload, sent = tk.encode(x)
    want = reference.topk_sent(x, tk.fraction, bits, chunk)
    np.testing.assert_array_equal(sent, want)
    np.testing.assert_array_equal(tk.decode(payload, numel), want)
    assert payload.dtype == np.uint8 and payload.shape == (tk.payload_bytes(numel),)
    lengths = [min(chunk, numel - start) for start in range(0, numel, chunk)]
    assert len(lengths) == math.ceil(numel / chunk)
    assert np.count_nonzero(want) == sum(min(n, tk.k) for n in lengths)  # k per chunk, a short one up to k
    steps = max(1, 2 ** (bits - 1) - 1)
    for start in range(0, numel, chunk):  # each value's sign right, its magnitude within half a level
        part, got = x[start:start + chunk], want[start:start + chunk]
        sent = got != 0
        size = np.abs(part[sent])
        assert np.array_equal(np.sign(got[sent]), np.sign(part[sent]))
        assert np.abs(np.abs(got[sent]) - size).max() <= (size.max() - size.min()) / steps / 2 * (1 + 1e-6) + 1e-7


@pytest.mark.parametrize("framework", ["torch", "jax", "jax.jit"])
def test_frameworks_send_the_same_bytes(framework):
    """The payload is bit-identical on numpy, torch and JAX (traced too): ranks on any of them agree."""
    tk = TopK(fraction=0.03, bits=2, chunk=128)
    x = sample(1000, seed=3)
    want, _ = tk.encode(x)
    if framework == "torch":
        import torch
        got = tk.encode(torch.from_numpy(x))[0].numpy()
    else:
        import jax
        import jax.numpy as jnp
        encode = jax.jit(tk.encode) if framework == "jax.jit" else tk.encode
        got = np.asarray(encode(jnp.asarray(x))[0])
    np.testing.assert_array_equal(got, want)


def test_ties_go_to_the_lower_position():
    tk = TopK(fraction=0.25, bits=8, chunk=8)  # k = 2
    x = np.array([1, -1, 1, -1, 0.5, 1, 1, -1, 0, 0, 0, 0, 0, 0, 0, 0], np.float32)
    _, sent = tk.encode(x)
    assert np.flatnonzero(sent).tolist() == [0, 1]  # the second chunk is all zeros: nothing nonzero from it
    np.testing.assert_array_equal(sent[:2], [1, -1])
    np.testing.assert_array_equal(reference.topk_sent(x, 0.25, 8, 8), sent)


def test_all_zero_chunks_send_zeros_not_nan():
    tk = TopK(fraction=0.1, bits=2, chunk=16)
    x = np.zeros(40, np.float32)
    x[20] = 3.0
    payload, sent = tk.encode(x)
    assert np.all(np.isfinite(sent)) and np.flatnonzero(sent).tolist() == [20] and sent[20] == 3.0  # 16 sent as 0
    np.testing.assert_array_equal(tk.decode(payload, 40), sent)


def test_nan_is_refused_not_left_unsent():
    """The reference refuses a NaN; the codec sends every value it picks from the chunk that holds it as NaN (what
    check_finite names on every rank), instead of leaving it in the error buffer and training on as if all were
    well."""
    tk = TopK(fraction=0.1, bits=2, chunk=16)
    x = sample(48)
    x[20] = np.nan
    with pytest.raises(ValueError, match="NaN or infinity at positions \\[20\\]"):
        reference.topk_sent(x, tk.fraction, tk.bits, tk.chunk)
    _, sent = tk.encode(x)
    got = tk.decode(tk.encode(x)[0], 48)
    assert np.isnan(sent[16:32]).sum() == np.isnan(got[16:32]).sum() == tk.k
    clean = np.delete(np.arange(48), np.arange(16, 32))
    np.testing.assert_array_equal(sent[clean], reference.topk_sent(x[clean], tk.fraction, tk.bits, tk.chunk))


def test_payload_is_under_a_fiftieth_of_fp32():
    tk = TopK(fraction=0.02, bits=2, chunk=4096)
    assert tk.k == 82 and tk.index_bits == 12
    numel = 1_000_000
    assert tk.payload_bytes(numel) <= 4 * numel / 50
    assert tk.payload_bytes(numel) == pytest.approx(numel * (0.02 * 14 / 8 + 8 / 4096), rel=0.01)


@pytest.mark.parametrize("kw, words", [
    (dict(fraction=0.0), "fraction must be in (0, 1]"),
    (dict(fraction=1.5), "fraction must be in (0, 1]"),
    (dict(bits=3), "bits must be 1, 2, 4 or 8"),
    (dict(chunk=0), "chunk must be an int >= 1"),
    (dict(error_decay=1.2), "error_decay must be in [0, 1]"),
])
def test_bad_keywords_refused(kw, words):
    with pytest.raises(BaguaXError, match="TopK: " + words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        TopK(**kw)


def test_diloco_refuses_two_ways_of_sending():
    with pytest.raises(BaguaXError, match="give the bits to TopK"):
        DiLoCo(bits=8, compression=TopK())
    with pytest.raises(BaguaXError, match="compression must be a bagua_x.algorithms.TopK"):
        DiLoCo(compression=0.02)


# -- DiLoCo with TopK on simulated ranks ---------------------------------------------------------------------

NUMEL, STEPS = 301, 13


def inner_step(x, worker, t):
    rng = np.random.default_rng(1000 * worker + t)
    return (x - 0.05 * rng.standard_normal(x.shape)).astype(np.float32)


def simulate(alg, n, steps=STEPS, local_size=None):
    x0 = sample(NUMEL, seed=7)

    def fn(c):
        x, out = x0.copy(), []
        state = alg.init(x, flat_layout(x), c.size)
        for t in range(steps):
            x = inner_step(x, c.rank if local_size is None else c.rank // local_size, t)
            x, state = alg.reduce(x, flat_layout(x), state, c)
            out.append(np.asarray(x).copy())
        return out, state

    results, comms = run(n, fn, local_size=local_size)
    workers = n if local_size is None else n // local_size
    ref = reference.DiLoCoWorkers.like(alg, x0, workers)
    xs, want = [x0.copy() for _ in range(workers)], []
    for t in range(steps):
        xs = ref.after_step([inner_step(x, w, t) for w, x in enumerate(xs)])
        want.append(xs)
    return results, comms, want, ref


CASES = {
    "sparseloco": SparseLoCo(sync_every=3, fraction=0.1, chunk=32),
    "momentum-4bit": DiLoCo(sync_every=3, compression=TopK(fraction=0.05, bits=4, chunk=64, error_decay=0.9)),
    "streaming": SparseLoCo(sync_every=4, fraction=0.1, chunk=32, fragments=2, fragment_sync_delay=1,
                            fragment_update_alpha=0.5),
}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, n):
    alg = CASES[name]
    results, comms, want, ref = simulate(alg, n)
    assert len(results) == n
    for r, (got, state) in enumerate(results):
        assert len(got) == STEPS
        for t in range(STEPS):
            # the same float32 formula; the mean summed in float32 here, float64 there: seen <= 2.4e-7
            assert np.abs(got[t] - want[t][r]).max() <= 2e-6, (r, t)
        np.testing.assert_allclose(state.error, ref.errors[r], rtol=0, atol=2e-6)
    assert np.abs(ref.errors[0]).max() > 1e-3  # the buffer does hold what was not sent
    syncs = sum(1 for t in range(1, STEPS + 1) for o in alg.offsets() if t >= o and (t - o) % alg.sync_every == 0)
    for c in comms:
        assert c.ops() == ["allgather"] * syncs
        assert c.bytes_sent() == pytest.approx(
            syncs / alg.fragments * alg.sync_every * alg.wire_bytes(flat_layout(NUMEL), 4, n), rel=0.02)


def test_sparse_is_not_dense():
    """The sparse run really sends less than everything: it lands away from dense DiLoCo with the same outer step."""
    alg = SparseLoCo(sync_every=3, fraction=0.1, chunk=32)
    sparse = simulate(alg, 2)[2]
    dense = simulate(DiLoCo(sync_every=3, outer_lr=1.0, outer_momentum=0.0), 2)[2]
    assert np.abs(sparse[2][0] - dense[2][0]).max() > 1e-2
    # fraction 1 and 8 bits: within 8-bit rounding of dense (error feedback on top of an almost exact send)
    full = simulate(SparseLoCo(sync_every=3, fraction=1.0, bits=8, chunk=32, error_decay=0.0), 2)[2]
    assert np.abs(full[2][0] - dense[2][0]).max() <= 2 * 0.3 / 255


def test_two_levels_node_is_one_worker():
    """2 nodes of 2 ranks: a 2-worker SparseLoCo; each rank sends half the node's chunks across, and both ranks
    of a node keep the same weights and error buffer."""
    alg = SparseLoCo(sync_every=3, fraction=0.1, chunk=32)
    results, comms, want, ref = simulate(alg, 4, local_size=2)
    for r, (got, state) in enumerate(results):
        for t in range(STEPS):
            assert np.abs(got[t] - want[t][r // 2]).max() <= 2e-6, (r, t)
        np.testing.assert_array_equal(state.error, results[r // 2 * 2][1].error)
    flat = simulate(alg, 2)[1][0].bytes_sent()
    assert comms[0].across.bytes_sent() == pytest.approx(flat / 2, rel=0.1)


def test_a_diloco_state_saved_before_the_error_buffer_still_loads():
    """Checkpoints of dense DiLoCo made before the ``error`` field existed load (the field is empty there); a
    sparse DiLoCo, whose buffer has to come from the checkpoint, refuses them by name."""
    from bagua_x.algorithms.base import state_from_dict

    flat = sample(10)
    old = {k: v for k, v in DiLoCo(sync_every=2).init(flat, flat_layout(flat), 2)._asdict().items() if k != "error"}
    dense = DiLoCo(sync_every=2).init(flat, flat_layout(flat), 2)
    loaded = state_from_dict(dense, old, "bucket 'b'")
    assert type(loaded) is type(dense) and loaded.error.shape == (0,)
    np.testing.assert_array_equal(loaded.global_weights, old["global_weights"])
    sparse = SparseLoCo(sync_every=2).init(flat, flat_layout(flat), 2)
    with pytest.raises(BaguaXError, match=r"missing \['error'\]"):
        state_from_dict(sparse, old, "bucket 'b'")
