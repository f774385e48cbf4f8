"""Framework-agnostic DLPack: reading any producer's buffers, exporting bagua_x's own.

Core, algorithms and communicators hand buffers around as any object with
``__dlpack__`` / ``__dlpack_device__`` (numpy, torch, jax, cupy).  This module
reads what core needs -- device, dtype, shape, strides, data pointer,
contiguity -- straight from the DLPack capsule with ``ctypes``, so that no
framework has to be imported to inspect a buffer.  The capsule is never
consumed: it is dropped after reading, which lets the producer release it.

The other direction, with the same structures: :class:`DLPackExport` offers
memory that bagua_x owns (e.g. device memory a communicator allocated for a
result) to any consumer (``jnp.from_dlpack``, ``torch.from_dlpack``,
``np.from_dlpack``) without a copy, keeping the memory's owner alive until the
consumer releases it.

JAX assumes its arrays never change, yet a consumer such as torch can write
through a DLPack view of one; :func:`check_writable` refuses such writes.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Sequence

from .errors import BaguaXError

__all__ = [
    "BufferInfo", "buffer_info", "data_pointer", "is_jax_owned", "check_writable",
    "DLPackExport", "DLPACK_DTYPES", "numel", "contiguous_strides",
]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_READ_ONLY_FLAG = 1

_pythonapi = ctypes.pythonapi
_pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
_pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_pythonapi.PyCapsule_GetName.restype = ctypes.c_char_p
_pythonapi.PyCapsule_GetName.argtypes = [ctypes.py_object]

_DTYPE_NAMES = {
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16",
    (5, 64): "complex64", (5, 128): "complex128",
    (6, 8): "bool",
}
DLPACK_DTYPES = {name: code_bits for code_bits, name in _DTYPE_NAMES.items()}  # dtype name -> (code, bits)
_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan",
                 8: "metal", 10: "rocm", 11: "rocm_host", 13: "cuda_managed", 14: "oneapi"}


def numel(shape) -> int:
    """The number of elements of an array of ``shape``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def contiguous_strides(shape) -> tuple[int, ...]:
    """Strides (in elements) of a C-contiguous (row-major) array of ``shape``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= int(s)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class BufferInfo:
    """What core knows about a buffer, read from its DLPack capsule."""

    device: str  # e.g. "cpu:0", "cuda:1"
    dtype: str  # e.g. "float32", "bfloat16"
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    data_ptr: int  # address of the first element (byte_offset applied)
    itemsize: int
    read_only: bool

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def _exportable(x):
    """torch refuses to export tensors that require grad; read their data instead."""
    if getattr(x, "requires_grad", False) and hasattr(x, "detach"):
        return x.detach()
    return x


def buffer_info(x) -> BufferInfo:
    """Read device, dtype, shape, strides and data pointer of any DLPack producer."""
    x = _exportable(x)
    if not hasattr(x, "__dlpack__"):
        raise BaguaXError(
            f"expected an array with __dlpack__ (numpy, torch, jax), got {type(x).__name__}; "
            "convert it to one of those first"
        )
    capsule = x.__dlpack__()
    name = _pythonapi.PyCapsule_GetName(capsule)
    ptr = _pythonapi.PyCapsule_GetPointer(capsule, name)
    read_only = False
    if name == b"dltensor_versioned":
        managed = _DLManagedTensorVersioned.from_address(ptr)
        read_only = bool(managed.flags & _READ_ONLY_FLAG)
    else:
        managed = _DLManagedTensor.from_address(ptr)
    t = managed.dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides:
        strides = tuple(t.strides[i] for i in range(t.ndim))
    else:  # NULL strides mean compact row-major
        strides = contiguous_strides(shape)
    code, bits = t.dtype.code, t.dtype.bits
    dtype = _DTYPE_NAMES.get((code, bits), f"dlpack(code={code},bits={bits})")
    device = f"{_DEVICE_NAMES.get(t.device.device_type, t.device.device_type)}:{t.device.device_id}"
    info = BufferInfo(
        device=device,
        dtype=dtype,
        shape=shape,
        strides=strides,
        data_ptr=(t.data or 0) + t.byte_offset,
        itemsize=max(bits // 8, 1) * t.dtype.lanes,
        read_only=read_only,
    )
    del capsule  # unconsumed: its destructor hands the tensor back to the producer
    return info


def data_pointer(x) -> int:
    """Address of ``x``'s first element; uses a ``data_ptr()`` method when there is one (fast path)."""
    fast = getattr(x, "data_ptr", None)
    if callable(fast):
        return fast()
    return buffer_info(x).data_ptr


def is_jax_owned(x) -> bool:
    """True for JAX arrays (and tracers): JAX assumes these never change."""
    return type(x).__module__.split(".")[0] in ("jax", "jaxlib")


def check_writable(x, name: str) -> None:
    """Refuse to write into a buffer that JAX owns or that its producer marked read-only."""
    if is_jax_owned(x):
        raise BaguaXError(
            f"refusing to write into {name!r}: it is a JAX array, and JAX assumes its arrays never change "
            "(a write through DLPack would silently alter it); use pack/unpack to build a new array instead"
        )
    if hasattr(x, "__dlpack__") and buffer_info(x).read_only:
        raise BaguaXError(f"refusing to write into {name!r}: its producer marked the buffer read-only")


# --------------------------------------------------------------------------------------------
# Export: a DLPack producer for memory bagua_x owns
# --------------------------------------------------------------------------------------------
_CAPSULE_NAME = b"dltensor"  # must outlive every capsule: module constant
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_PyCapsule_GetPointerRaw = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

# address of a live DLManagedTensor -> what must stay alive with it (struct, shape, strides, owner)
_EXPORTED: dict = {}


def _release(address) -> None:
    _EXPORTED.pop(address, None)


# The consumer calls the deleter when it is done with the memory (from any thread:
# ctypes takes the GIL); an unconsumed capsule (still named "dltensor") calls it itself.
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_release)


def _capsule_destructor(capsule) -> None:
    if _PyCapsule_IsValid(capsule, _CAPSULE_NAME):
        _release(_PyCapsule_GetPointerRaw(capsule, _CAPSULE_NAME))


_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_capsule_destructor)


class DLPackExport:
    """Memory at ``ptr`` (C-contiguous ``shape`` of ``dtype``) offered through ``__dlpack__``.

    ``owner`` is kept alive until every consumer has released the capsule, then
    dropped (for a ``cuda.core`` Buffer, that frees the memory).  The ``stream``
    argument of ``__dlpack__`` is ignored: the data must be complete when a
    consumer imports it.  ``device`` is a DLPack ``(device_type, device_id)``,
    e.g. ``(1, 0)`` for the CPU, ``(2, n)`` for CUDA device ``n``.
    """

    __slots__ = ("ptr", "shape", "dtype", "device", "owner")

    def __init__(self, ptr: int, shape: Sequence[int], dtype: str, device: tuple, owner: Any):
        if dtype not in DLPACK_DTYPES:
            raise BaguaXError(f"cannot export dtype {dtype!r} through DLPack; known: {sorted(DLPACK_DTYPES)}")
        self.ptr, self.shape, self.dtype = int(ptr), tuple(int(s) for s in shape), dtype
        self.device, self.owner = (int(device[0]), int(device[1])), owner

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError("bagua_x's DLPack export never copies; call with copy=None or False")
        if dl_device is not None and (int(dl_device[0]), int(dl_device[1])) != self.device:
            raise BufferError(f"buffer lives on DLPack device {self.device}, not {tuple(dl_device)}")
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * max(ndim, 1))(*self.shape)
        strides = (ctypes.c_int64 * max(ndim, 1))(*contiguous_strides(self.shape))
        managed = _DLManagedTensor()
        t = managed.dl_tensor
        t.data = self.ptr or None
        t.device = _DLDevice(*self.device)
        t.ndim = ndim
        code, bits = DLPACK_DTYPES[self.dtype]
        t.dtype = _DLDataType(code, bits, 1)
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
        t.byte_offset = 0
        managed.manager_ctx = None
        managed.deleter = ctypes.cast(_DELETER, ctypes.c_void_p).value
        address = ctypes.addressof(managed)
        _EXPORTED[address] = (managed, shape, strides, self.owner)
        try:
            return _PyCapsule_New(address, _CAPSULE_NAME, ctypes.cast(_CAPSULE_DESTRUCTOR, ctypes.c_void_p).value)
        except BaseException:
            _release(address)
            raise
