import numpy as np
import pytest

from bagua_x.core import BaguaXError, Bucket, RegisteredTensor, TensorRegistry, data_pointer

torch = pytest.importorskip("torch")


def grad_tensor(name, p):
    return RegisteredTensor(name, p, lambda p: p.grad, lambda p, t: setattr(p, "grad", t))


def test_setter_without_getter_is_an_error():
    with pytest.raises(BaguaXError, match="'w'.*setter was given without a getter"):
        RegisteredTensor("w", torch.zeros(1), setter=lambda p, t: None)


def test_getter_returning_none_or_non_array_names_the_tensor():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(BaguaXError, match="'layer.w'.*returned None"):
        grad_tensor("layer.w", p).effective()
    bad = RegisteredTensor("layer.b", p, getter=lambda p: [1.0])
    with pytest.raises(BaguaXError, match="'layer.b'.*returned a list"):
        bad.effective()


def test_proxy_is_its_own_effective_tensor_without_getter():
    p = torch.zeros(3)
    assert RegisteredTensor("p", p).effective() is p


def test_ensure_grad_creates_zeros_and_returns_itself():
    p = torch.nn.Parameter(torch.ones(2, 3))
    t = grad_tensor("w", p)
    assert t.ensure_grad() is t
    assert p.grad is not None and torch.equal(p.grad, torch.zeros(2, 3))
    g = p.grad
    t.ensure_grad()
    assert p.grad is g  # an existing gradient is kept


def test_set_registered_storage_with_setter_installs_a_view():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    p.grad = torch.arange(4.0).view(2, 2)
    buf = torch.zeros(10)
    t = grad_tensor("w", p)
    t.set_registered_storage(buf, 3)
    assert p.grad.data_ptr() == buf.data_ptr() + 3 * 4
    assert torch.equal(buf[3:7], torch.arange(4.0))
    buf[3] = 42.0
    assert p.grad[0, 0] == 42.0


def test_set_registered_storage_without_setter_repoints_in_place():
    w = torch.arange(3.0)
    t = RegisteredTensor("w", w)
    buf = torch.zeros(5)
    t.set_registered_storage(buf, 2)
    assert w.data_ptr() == buf.data_ptr() + 8 and torch.equal(buf[2:], torch.arange(3.0))


def test_numpy_without_setter_cannot_be_repointed():
    t = RegisteredTensor("n", np.ones(3, np.float32))
    with pytest.raises(BaguaXError, match="'n'.*cannot be re-pointed"):
        t.set_registered_storage(np.zeros(3, np.float32), 0)


def test_numpy_with_getter_and_setter_swaps_storage():
    holder = {"x": np.arange(4, dtype=np.float32)}
    t = RegisteredTensor("x", holder, lambda h: h["x"], lambda h, v: h.__setitem__("x", v))
    b = Bucket("b", [t])
    b.flatten()
    assert data_pointer(holder["x"]) == data_pointer(b.buffer)
    assert np.array_equal(b.buffer, np.arange(4))


def test_registry_tied_and_duplicate_names():
    reg = TensorRegistry()
    p, q = torch.zeros(1), torch.zeros(1)
    a = reg.register("enc.w", p)
    assert reg.register("enc.w", p) is a  # tied weight: registered once
    with pytest.raises(BaguaXError, match="'enc.w'.*'dec.w'"):
        reg.register("dec.w", p)
    with pytest.raises(BaguaXError, match="'enc.w'"):
        reg.register("enc.w", q)
    assert len(reg) == 1 and reg["enc.w"] is a


def test_mark_ready_outside_a_bucket_is_an_error():
    with pytest.raises(BaguaXError, match="'w'.*not in a bucket"):
        RegisteredTensor("w", torch.zeros(1)).mark_ready()
