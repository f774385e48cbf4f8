import numpy as np
import pytest

from bagua_x.core import BaguaXError, Bucket, BucketDispatcher, BucketLayout, RegisteredTensor, plan_buckets

torch = pytest.importorskip("torch")


def grad_tensors(params):
    return [
        RegisteredTensor(f"p{i}", p, lambda p: p.grad, lambda p, t: setattr(p, "grad", t))
        for i, p in enumerate(params)
    ]


def make_model_bucket(alignment=1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    tensors = grad_tensors(params)
    return model, params, tensors, Bucket("b0", tensors, alignment=alignment)


def test_layout_offsets_and_padding():
    layout = BucketLayout(["a", "b"], [(2, 3), (5,)], "float32", alignment=4)
    assert [s.offset for s in layout.slots] == [0, 6]
    assert layout.numel == 11 and layout.padded_numel == 12


def test_flatten_makes_gradients_views_of_the_buffer():
    _, params, tensors, bucket = make_model_bucket(alignment=4)
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.grad.clone() for p in params]
    bucket.flatten()
    assert bucket.is_flattened()
    assert bucket.buffer.numel() % 4 == 0
    for p, slot, old in zip(params, bucket.layout.slots, before):
        assert p.grad.data_ptr() == bucket.buffer.data_ptr() + slot.offset * 4
        assert torch.equal(p.grad, old)
    bucket.buffer.mul_(2)  # communicating the buffer updates the gradients, no copy
    assert all(torch.equal(p.grad, 2 * old) for p, old in zip(params, before))


def test_recreated_gradient_is_detected_and_reswapped():
    """zero_grad(set_to_none=True) + backward recreates p.grad outside the bucket."""
    model, params, tensors, bucket = make_model_bucket()
    bucket.flatten()
    x = torch.randn(5, 3)
    for p in params:
        p.grad = None
    model(x).sum().backward()
    fresh = [p.grad.clone() for p in params]
    assert not bucket.is_flattened()
    assert bucket.ensure_flattened() == len(params)  # one copy per recreated tensor
    assert bucket.is_flattened()
    flat = torch.cat([g.reshape(-1) for g in fresh])
    assert torch.equal(bucket.buffer[: flat.numel()], flat)  # the communicated buffer holds the new values
    assert all(torch.equal(p.grad, g) for p, g in zip(params, fresh))
    assert bucket.ensure_flattened() == 0


def test_only_the_replaced_tensor_is_copied():
    _, params, _, bucket = make_model_bucket()
    bucket.flatten()
    params[1].grad = torch.full_like(params[1], 7.0)
    assert bucket.ensure_flattened() == 1
    slot = bucket.layout.slots[1]
    assert torch.all(bucket.buffer[slot.offset : slot.offset + slot.numel] == 7.0)


def test_shape_change_of_effective_tensor_is_an_error():
    state = {"m": np.zeros(4, np.float32)}  # e.g. an optimizer state the user rebuilt wrongly
    t = RegisteredTensor("m", state, lambda s: s["m"], lambda s, v: s.__setitem__("m", v))
    bucket = Bucket("b", [t])
    bucket.flatten()
    state["m"] = np.zeros(7, np.float32)
    with pytest.raises(BaguaXError, match="'m' now has shape"):
        bucket.ensure_flattened()


def test_mixed_dtypes_are_refused_naming_the_tensors():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    a.grad, b.grad = torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)
    with pytest.raises(BaguaXError, match="'p0' is float32.*'p1' is bfloat16"):
        Bucket("mixed", grad_tensors([a, b]))


def test_pack_unpack_round_trip_numpy_and_jax():
    layout = BucketLayout(["a", "b"], [(2, 2), (3,)], "float32", alignment=4)
    arrays = [np.arange(4, dtype=np.float32).reshape(2, 2), np.ones(3, np.float32)]
    flat = layout.pack(arrays)
    assert flat.shape == (8,) and flat[-1] == 0
    assert all(np.array_equal(a, b) for a, b in zip(arrays, layout.unpack(flat)))
    jnp = pytest.importorskip("jax.numpy")
    jflat = layout.pack([jnp.asarray(a) for a in arrays])
    assert np.array_equal(np.asarray(jflat), flat)
    with pytest.raises(BaguaXError, match="'b'.*shape"):
        layout.pack([arrays[0], np.ones(4, np.float32)])


def test_bucket_unpack_writes_through_setters():
    _, params, _, bucket = make_model_bucket()
    flat = torch.arange(bucket.layout.padded_numel, dtype=torch.float32)
    bucket.unpack(flat)
    assert torch.equal(params[0].grad.reshape(-1), flat[:12])
    assert torch.equal(bucket.pack(), flat)


def test_plan_buckets_groups_by_dtype_and_caps_size():
    entries = [("f32", "a", 40), ("bf16", "b", 10), ("f32", "c", 40), ("f32", "d", 40), ("bf16", "e", 10)]
    plan = plan_buckets(entries, cap_bytes=100)
    assert plan == [[0, 2], [1, 4], [3]]
    assert plan_buckets([("f32", "big", 500)], cap_bytes=100) == [[0]]


def test_dispatch_is_in_fixed_order_whatever_the_readiness_order():
    tensors = [RegisteredTensor(f"t{i}", torch.zeros(1)) for i in range(4)]
    buckets = [Bucket("b0", tensors[:2]), Bucket("b1", tensors[2:3]), Bucket("b2", tensors[3:])]
    order = []
    d = BucketDispatcher(buckets, lambda b: order.append(b.name))
    tensors[3].mark_ready()
    tensors[2].mark_ready()
    assert order == []  # b1, b2 ready but b0 is not: they wait
    tensors[0].mark_ready()
    tensors[0].mark_ready()  # marking twice is harmless
    assert order == []
    assert d.unready_tensors() == [tensors[1]]
    with pytest.raises(BaguaXError, match="'b0'.*t1"):
        d.check_all_dispatched()
    tensors[1].mark_ready()
    assert order == ["b0", "b1", "b2"] and d.all_dispatched
    d.reset()
    assert not d.all_dispatched and d.pending() == buckets
