import gc
import weakref

import numpy as np
import pytest

from bagua_x.core import BaguaXError, buffer_info, check_writable, data_pointer, is_jax_owned
from bagua_x.core.dlpack import DLPACK_DTYPES, DLPackExport, contiguous_strides, numel


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


def test_numel_and_contiguous_strides():
    assert numel(()) == 1 and numel((3, 4)) == 12 and numel((2, 0, 5)) == 0
    assert contiguous_strides(()) == () and contiguous_strides((3, 4, 5)) == (20, 5, 1)
    assert contiguous_strides((3, 4)) == np.zeros((3, 4), np.int8).strides


def test_dlpack_codes_agree_with_buffer_info():
    a = np.zeros(8, dtype=np.uint8)
    for name in DLPACK_DTYPES:
        assert buffer_info(DLPackExport(a.ctypes.data, (2,), name, (1, 0), a)).dtype == name


# ============================================================================================
# DLPack export of bagua_x-owned memory
# ============================================================================================
class _Owner:
    def __init__(self, array):
        self.array = array


def test_dlpack_export_is_zero_copy_and_releases_its_owner_numpy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    owner = _Owner(a)
    alive = weakref.ref(owner)
    export = DLPackExport(a.ctypes.data, a.shape, "float32", (1, 0), owner)
    del owner
    b = np.from_dlpack(export)
    del export
    gc.collect()
    np.testing.assert_array_equal(b, a)
    assert b.ctypes.data == a.ctypes.data and alive() is not None
    del b
    gc.collect()
    assert alive() is None


def test_dlpack_export_unconsumed_capsule_releases_owner():
    a = np.ones(4, dtype=np.int32)
    owner = _Owner(a)
    alive = weakref.ref(owner)
    capsule = DLPackExport(a.ctypes.data, a.shape, "int32", (1, 0), owner).__dlpack__()
    del owner
    gc.collect()
    assert alive() is not None
    del capsule
    gc.collect()
    assert alive() is None


def test_dlpack_export_to_torch_and_jax_keeps_dtype_and_shape():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    src = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    t = torch.from_dlpack(DLPackExport(src.data_ptr(), src.shape, "bfloat16", (1, 0), src))
    assert t.dtype == torch.bfloat16 and t.shape == (2, 3) and torch.equal(t, src)
    j = jnp.from_dlpack(DLPackExport(src.data_ptr(), src.shape, "bfloat16", (1, 0), src))
    assert j.dtype == jnp.bfloat16 and j.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(j, dtype=np.float32), src.float().numpy())
    e = np.from_dlpack(DLPackExport(0, (0, 3), "int32", (1, 0), None))
    assert e.shape == (0, 3)


def test_dlpack_export_refuses_copy_and_unknown_dtype():
    a = np.zeros(2, dtype=np.float32)
    with pytest.raises(BufferError):
        DLPackExport(a.ctypes.data, (2,), "float32", (1, 0), a).__dlpack__(copy=True)
    with pytest.raises(BaguaXError):
        DLPackExport(a.ctypes.data, (2,), "float8", (1, 0), a)
