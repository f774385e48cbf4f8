import numpy as np
import pytest

from bagua_x.core import BaguaXError, buffer_info, check_writable, data_pointer, is_jax_owned


def test_numpy_strided_view():
    a = np.zeros((4, 6), np.float32)
    info = buffer_info(a[:, ::2])
    assert info.device == "cpu:0" and info.dtype == "float32"
    assert info.shape == (4, 3) and info.strides == (6, 2)
    assert not info.is_contiguous
    assert info.data_ptr == a.ctypes.data
    assert buffer_info(a).is_contiguous and buffer_info(a).nbytes == 96


def test_numpy_offset_pointer():
    a = np.arange(10, dtype=np.int64)
    assert buffer_info(a[3:]).data_ptr == a.ctypes.data + 3 * 8
    assert buffer_info(a).dtype == "int64"


def test_torch_tensors_and_parameters():
    torch = pytest.importorskip("torch")
    t = torch.zeros(3, 5, dtype=torch.bfloat16)
    info = buffer_info(t[1:])
    assert info.dtype == "bfloat16" and info.shape == (2, 5) and info.itemsize == 2
    assert info.data_ptr == t.data_ptr() + 5 * 2
    p = torch.nn.Parameter(torch.ones(4))  # requires grad: read through detach
    assert buffer_info(p).data_ptr == p.data_ptr() == data_pointer(p)


def test_jax_arrays_are_read_and_protected():
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.ones((2, 3), dtype=jnp.float32)
    info = buffer_info(x)
    assert info.shape == (2, 3) and info.dtype == "float32" and info.device == "cpu:0"
    assert is_jax_owned(x)
    with pytest.raises(BaguaXError, match="JAX array"):
        check_writable(x, "params['w']")
    check_writable(np.zeros(3), "numpy buffer")  # numpy is writable


def test_zero_copy_exchange_between_frameworks():
    torch = pytest.importorskip("torch")
    a = np.arange(6, dtype=np.float32)
    t = torch.from_dlpack(a)
    assert buffer_info(t).data_ptr == buffer_info(a).data_ptr


def test_non_array_is_rejected():
    with pytest.raises(BaguaXError, match="__dlpack__"):
        buffer_info([1, 2, 3])
