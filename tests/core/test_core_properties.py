"""Property tests: bucket layout, pack/unpack and flatten/re-swap under random shapes and recreations."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bagua_x.core import Bucket, BucketLayout, RegisteredTensor, plan_buckets

torch = pytest.importorskip("torch")

shapes = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, alignment=st.integers(1, 8))
def test_layout_is_contiguous_and_padded(shapes, alignment):
    layout = BucketLayout([f"t{i}" for i in range(len(shapes))], shapes, "float32", alignment)
    end = 0
    for slot in layout.slots:
        assert slot.offset == end
        end += slot.numel
    assert layout.numel == end and layout.padded_numel % alignment == 0
    assert 0 <= layout.padded_numel - layout.numel < alignment or layout.numel == 0


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, alignment=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(shapes, alignment, seed):
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    layout = BucketLayout([f"t{i}" for i in range(len(shapes))], shapes, "float32", alignment)
    flat = layout.pack(arrays)
    assert flat.shape == (layout.padded_numel,)
    assert np.all(flat[layout.numel :] == 0)
    for a, b in zip(arrays, layout.unpack(flat)):
        assert b.shape == a.shape and np.array_equal(a, b)


@settings(max_examples=60, deadline=None)
@given(
    shapes=shapes,
    dtype=st.sampled_from(sorted(DTYPES)),
    alignment=st.integers(1, 4),
    rounds=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_flatten_then_random_recreations_never_lose_a_value(shapes, dtype, alignment, rounds, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s, dtype=DTYPES[dtype])) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    tensors = [RegisteredTensor(f"p{i}", p, lambda p: p.grad, lambda p, t: setattr(p, "grad", t))
               for i, p in enumerate(params)]
    bucket = Bucket("b", tensors, alignment)
    bucket.flatten()
    for recreate in rounds:
        expected = []
        for p, again in zip(params, recreate):
            if again:  # as zero_grad(set_to_none=True) + backward, or a user assignment
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            else:  # in-place accumulation keeps the view
                p.grad.add_(1)
            expected.append(p.grad.clone())
        n_recreated = sum(recreate[: len(params)])
        assert bucket.ensure_flattened() == n_recreated
        assert bucket.is_flattened()
        for p, slot, e in zip(params, bucket.layout.slots, expected):
            assert torch.equal(p.grad, e)
            assert torch.equal(bucket.buffer[slot.offset : slot.offset + slot.numel], e.reshape(-1))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.tuples(st.sampled_from(["f32", "bf16"]), st.integers(1, 50)), min_size=1, max_size=20),
       cap=st.integers(1, 120))
def test_plan_buckets_is_a_partition_respecting_the_cap(sizes, cap):
    entries = [(k, f"t{i}", n) for i, (k, n) in enumerate(sizes)]
    plan = plan_buckets(entries, cap)
    assert sorted(i for b in plan for i in b) == list(range(len(entries)))
    for b in plan:
        assert len({entries[i][0] for i in b}) == 1
        assert len(b) == 1 or sum(entries[i][2] for i in b) <= cap
        assert b == sorted(b)
