"""Core behaviour that mutation testing found unchecked: exact messages, boundaries, numpy paths."""

import numpy as np
import pytest

from bagua_x.core import BaguaXError, Bucket, BucketDispatcher, BucketLayout, RegisteredTensor, plan_buckets
from bagua_x.core import wire
from bagua_x.core.tensor import TensorRegistry


def np_grad_tensor(name, holder):
    return RegisteredTensor(name, holder, lambda h: h["g"], lambda h, t: h.__setitem__("g", t))


# -- readiness ----------------------------------------------------------------------------------
def test_unfinished_dispatch_message_and_reset():
    holders = [{"g": np.zeros(2, np.float32)} for _ in range(2)]
    tensors = [np_grad_tensor(f"t{i}", h) for i, h in enumerate(holders)]
    buckets = [Bucket("b0", tensors[:1]), Bucket("b1", tensors[1:])]
    order = []
    d = BucketDispatcher(buckets, lambda b: order.append(b.name))
    assert d.pending() == buckets and not d.all_dispatched
    with pytest.raises(BaguaXError) as e:
        d.check_all_dispatched()
    assert str(e.value) == (
        "bucket 'b0' was never dispatched: tensors ['t0'] were not marked ready this step (a parameter unused "
        "in forward? wrap with find_unused_parameters=True)")
    tensors[0].mark_ready()
    tensors[1].mark_ready()
    assert order == ["b0", "b1"] and d.all_dispatched and d.pending() == []
    d.check_all_dispatched()
    d.reset()
    assert d.unready_tensors() == tensors and d.pending() == buckets
    tensors[0].mark_ready()
    assert order == ["b0", "b1", "b0"]


def test_marking_ready_without_a_dispatcher_is_refused():
    t = np_grad_tensor("t", {"g": np.zeros(2, np.float32)})
    b = Bucket("b", [t])
    assert b.on_ready is None and b.buffer is None
    with pytest.raises(BaguaXError, match="^tensor 't' was marked ready, but bucket 'b' has no dispatcher"):
        t.mark_ready()


def test_mark_ready_in_another_bucket_is_refused():
    t0, t1 = (np_grad_tensor(n, {"g": np.zeros(2, np.float32)}) for n in "ab")
    b0, _ = Bucket("b0", [t0]), Bucket("b1", [t1])
    with pytest.raises(BaguaXError, match="^tensor 'b' is not in bucket 'b0'$"):
        b0.mark_ready(t1)


# -- buckets ------------------------------------------------------------------------------------
def test_layout_defaults_and_description():
    layout = BucketLayout(["a", "b"], [(2, 3), (1,)], "float32")
    assert layout.alignment == 1 and layout.padded_numel == layout.numel == 7 and layout.dtype == "float32"
    assert layout.describe() == ("float32", 7, (("a", (2, 3), 0), ("b", (1,), 6)))
    assert BucketLayout(["a"], [(5,)], "f", alignment=4).padded_numel == 8
    assert BucketLayout([], [], "f", alignment=3).padded_numel == 3  # empty: one aligned block
    with pytest.raises(BaguaXError, match="^bucket alignment must be >= 1, got 0$"):
        BucketLayout(["a"], [(1,)], "f", alignment=0)


def test_pack_one_unpadded_array_and_padding_dtype():
    layout = BucketLayout(["a"], [(2, 2)], "float64")
    flat = layout.pack([np.ones((2, 2))])
    assert flat.shape == (4,) and flat.dtype == np.float64
    padded = BucketLayout(["a"], [(3,)], "float16", alignment=4).pack([np.ones(3, np.float16)])
    assert padded.dtype == np.float16 and list(padded) == [1, 1, 1, 0]
    with pytest.raises(BaguaXError, match=r"^bucket of \['a'\] got 2 arrays to pack, expected 1$"):
        layout.pack([np.ones((2, 2)), np.ones(1)])


def test_numpy_bucket_flatten_unpack_through_setters_and_in_place():
    holders = [{"g": np.full((2, 2), 1.0, np.float32)}, {"g": np.full(3, 2.0, np.float32)}]
    tensors = [np_grad_tensor(f"t{i}", h) for i, h in enumerate(holders)]
    bucket = Bucket("b", tensors, alignment=4)
    assert not bucket.is_flattened()
    assert bucket.nbytes == 8 * 4 and repr(bucket) == "Bucket('b', 2 tensors, 8 x float32)"
    bucket.flatten()
    assert bucket.is_flattened() and list(bucket.buffer) == [1, 1, 1, 1, 2, 2, 2, 0]
    assert bucket.ensure_flattened() == 0
    holders[1]["g"] = np.full(3, 5.0, np.float32)  # recreated
    assert not bucket.is_flattened() and bucket.ensure_flattened() == 1 and bucket.buffer[4] == 5
    bucket.unpack(np.arange(8, dtype=np.float32))
    assert holders[0]["g"].tolist() == [[0, 1], [2, 3]] and holders[1]["g"].tolist() == [4, 5, 6]
    # without a setter the effective tensor is written in place
    proxy = np.zeros(3, np.float32)
    plain = Bucket("p", [RegisteredTensor("x", proxy)])
    plain.unpack(np.arange(3, dtype=np.float32))
    assert proxy.tolist() == [0, 1, 2]


def test_plan_buckets_cap_is_inclusive_and_order_by_first_index():
    assert plan_buckets([("f", "a", 50), ("f", "b", 50)], cap_bytes=100) == [[0, 1]]  # exactly the cap: one
    assert plan_buckets([("f", "a", 50), ("f", "b", 51)], cap_bytes=100) == [[0], [1]]
    assert plan_buckets([("h", "a", 1), ("f", "b", 1), ("h", "c", 200), ("f", "d", 1)], cap_bytes=100) == [
        [0], [1, 3], [2]]


# -- registered tensors -------------------------------------------------------------------------
def test_registered_tensor_defaults_and_messages():
    t = RegisteredTensor("w", np.zeros(2))
    assert (t.bucket, t.offset, t.getter, t.setter) == (None, 0, None, None) and repr(t) == "RegisteredTensor('w')"
    with pytest.raises(BaguaXError) as e:
        RegisteredTensor("w", np.zeros(2), setter=lambda p, v: None)
    assert str(e.value).startswith("tensor 'w': a setter was given without a getter") and \
        str(e.value).endswith("pass both (or neither, to communicate the proxy itself)")
    with pytest.raises(BaguaXError, match=r"call ensure_grad\(\) first or make the getter return an array$"):
        RegisteredTensor("w", {}, getter=lambda p: None).effective()
    with pytest.raises(BaguaXError, match=r"returned a list, not an array; it must return an array with __dlpack__ "
                                          r"\(numpy, torch, jax\)$"):
        RegisteredTensor("w", {}, getter=lambda p: [1]).effective()
    with pytest.raises(BaguaXError, match="^tensor 'w' has no setter, so its effective tensor cannot be replaced; "
                                          "register it with a setter$"):
        t.set_effective(np.ones(2))
    with pytest.raises(BaguaXError, match="^tensor 'w' is not in a bucket yet"):
        t.mark_ready()


def test_ensure_grad_on_numpy_and_registered_storage_offset():
    holder = {"p": np.ones(3, np.float32), "g": None}
    t = RegisteredTensor("w", holder, lambda h: h["g"], lambda h, v: h.__setitem__("g", v))
    t.proxy = np.ones(3, np.float32)  # an array proxy without requires_grad
    t.getter, t.setter = (lambda p: holder["g"]), (lambda p, v: holder.__setitem__("g", v))
    assert t.ensure_grad() is t and holder["g"].tolist() == [0, 0, 0] and holder["g"].dtype == np.float32
    holder["g"] = np.full(3, 7.0, np.float32)
    t.ensure_grad()
    assert holder["g"].tolist() == [7, 7, 7]  # kept
    buffer = np.zeros(6, np.float32)
    t.set_registered_storage(buffer, 2)
    assert t.offset == 2 and buffer.tolist() == [0, 0, 7, 7, 7, 0]
    assert t.is_view_of(buffer, 2) and t.is_view_of(buffer, 2, 4) and not t.is_view_of(buffer, 1)


def test_numpy_cannot_be_repointed_message():
    t = RegisteredTensor("w", np.ones(2, np.float32))
    with pytest.raises(BaguaXError, match="^tensor 'w': a ndarray cannot be re-pointed to new storage in place; "
                                          "register it with a getter and setter so a view can be installed instead$"):
        t.set_registered_storage(np.zeros(2, np.float32), 0)


def test_registry_iteration_and_messages():
    reg = TensorRegistry()
    a, b = np.zeros(1), np.zeros(1)
    ta = reg.register("a", a)
    assert reg.register("a", a) is ta
    tb = reg.register("b", b, getter=lambda p: p, setter=lambda p, v: None)
    assert list(reg) == [ta, tb] and len(reg) == 2 and reg["b"] is tb and tb.proxy is b
    assert tb.getter is not None and tb.setter is not None
    with pytest.raises(BaguaXError, match="^the same proxy is registered twice, as 'a' and as 'c'; register a shared "
                                          r"\(tied\) tensor once, under one name$"):
        reg.register("c", a)
    with pytest.raises(BaguaXError, match="^two different tensors are registered under the name 'a'"):
        reg.register("a", np.zeros(1))


# -- wire ---------------------------------------------------------------------------------------
def test_wire_exact_messages():
    data = b"\x80" + b"x" * 40
    with pytest.raises(BaguaXError) as e:
        wire.decode(data, "src")
    assert str(e.value).endswith(
        f"first bytes {data[:32]!r}); something other than a bagua_x rank wrote to this job's store or "
        "collective, or the ranks run different bagua_x versions")
    with pytest.raises(BaguaXError, match="^src: received data that is not"):
        wire.decode_description(b"\x80", "src")
    long = ["x" * 300]
    with pytest.raises(BaguaXError) as e:
        wire.decode_description(wire.encode(long), "src")
    assert str(e.value) == f"src: received {str(('x' * 300,))[:200]!r}, not a list of (name, value) pairs"
    with pytest.raises(BaguaXError, match="^bagua_x.core.wire: received a JSON object; bagua_x sends only arrays "
                                          "and scalars$"):
        wire.decode(b"{}", "src")
