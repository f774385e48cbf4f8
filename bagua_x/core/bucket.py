"""Buckets: many registered tensors laid out back to back in one flat buffer.

Communicating one flat buffer instead of many small tensors amortises the
per-collective latency.  Two ways to fill it:

* :class:`Bucket` (frameworks with views, e.g. torch): ``flatten()`` swaps each
  effective tensor's storage into the flat buffer, so the buffer *is* the
  tensors and communicating it needs no copy.  If an effective tensor is
  recreated later, ``ensure_flattened()`` notices (data pointers) and re-swaps
  it with one copy, so a stale value is never communicated.
* :meth:`BucketLayout.pack` / :meth:`BucketLayout.unpack` (frameworks without
  views, e.g. JAX): copy in and out; under ``jit`` XLA fuses the copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import array_api_compat

from .dlpack import buffer_info, check_writable, numel
from .errors import BaguaXError
from .tensor import RegisteredTensor

__all__ = ["Slot", "BucketLayout", "Bucket", "plan_buckets"]


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in a bucket's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class BucketLayout:
    """Offsets of named tensors of one dtype in a flat buffer, padded to ``alignment`` elements."""

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: str, alignment: int = 1):
        if alignment < 1:
            raise BaguaXError(f"bucket alignment must be >= 1, got {alignment}")
        self.dtype = dtype
        self.alignment = alignment
        slots, offset = [], 0
        for name, shape in zip(names, shapes):
            shape = tuple(int(s) for s in shape)
            n = numel(shape)
            slots.append(Slot(name, shape, offset, n))
            offset += n
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.numel = offset
        self.padded_numel = -(-offset // alignment) * alignment if offset else alignment

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    def describe(self) -> tuple:
        """A plain, comparable description (for checking that ranks agree)."""
        return (self.dtype, self.padded_numel, tuple((s.name, s.shape, s.offset) for s in self.slots))

    def pack(self, arrays: Sequence, xp=None):
        """Copy ``arrays`` (in slot order) into one new flat array, zero padded."""
        if len(arrays) != len(self.slots):
            raise BaguaXError(f"bucket of {self.names} got {len(arrays)} arrays to pack, expected {len(self.slots)}")
        xp = xp or array_api_compat.array_namespace(*arrays)
        parts = []
        for slot, a in zip(self.slots, arrays):
            if tuple(a.shape) != slot.shape:
                raise BaguaXError(f"tensor {slot.name!r} has shape {tuple(a.shape)}, but was registered with {slot.shape}")
            parts.append(xp.reshape(a, (-1,)))
        pad = self.padded_numel - self.numel
        if pad:
            parts.append(xp.zeros((pad,), dtype=parts[0].dtype, device=array_api_compat.device(parts[0])))
        return xp.concat(parts) if len(parts) > 1 else parts[0]

    def unpack(self, flat, xp=None) -> list:
        """Split a flat array back into arrays of the registered shapes."""
        xp = xp or array_api_compat.array_namespace(flat)
        return [xp.reshape(flat[s.offset : s.offset + s.numel], s.shape) for s in self.slots]


class Bucket:
    """Registered tensors of one dtype and device sharing one flat buffer (frameworks with views)."""

    def __init__(self, name: str, tensors: Sequence[RegisteredTensor], alignment: int = 1):
        if not tensors:
            raise BaguaXError(f"bucket {name!r} has no tensors")
        infos = [buffer_info(t.effective()) for t in tensors]
        first = infos[0]
        for t, info in zip(tensors, infos):
            if (info.dtype, info.device) != (first.dtype, first.device):
                raise BaguaXError(
                    f"bucket {name!r} mixes tensors: {tensors[0].name!r} is {first.dtype} on {first.device} but "
                    f"{t.name!r} is {info.dtype} on {info.device}; a bucket holds one dtype on one device, "
                    "so put them in separate buckets (plan_buckets does this)"
                )
        self.name = name
        self.tensors = list(tensors)
        self.layout = BucketLayout([t.name for t in tensors], [i.shape for i in infos], first.dtype, alignment)
        self.dtype, self.device, self.itemsize = first.dtype, first.device, first.itemsize
        self.buffer = None
        #: set by a :class:`~.readiness.BucketDispatcher`: called with each tensor marked ready
        self.on_ready: Optional[Callable[[RegisteredTensor], None]] = None
        for t, slot in zip(self.tensors, self.layout.slots):
            t.bucket, t.offset = self, slot.offset

    def __repr__(self) -> str:
        return f"Bucket({self.name!r}, {len(self.tensors)} tensors, {self.layout.padded_numel} x {self.dtype})"

    @property
    def nbytes(self) -> int:
        return self.layout.padded_numel * self.itemsize

    # -- storage swapping ------------------------------------------------------------------
    def flatten(self) -> None:
        """Allocate the flat buffer and swap every effective tensor's storage into it."""
        first = self.tensors[0].effective()
        xp = array_api_compat.array_namespace(first)
        self.buffer = xp.zeros((self.layout.padded_numel,), dtype=first.dtype, device=array_api_compat.device(first))
        check_writable(self.buffer, f"bucket {self.name}")
        for t, slot in zip(self.tensors, self.layout.slots):
            self._check_shape(t, slot)
            t.set_registered_storage(self.buffer, slot.offset)

    def is_flattened(self) -> bool:
        """Every effective tensor is still the view at its offset of the flat buffer."""
        if self.buffer is None:
            return False
        return all(t.is_view_of(self.buffer, s.offset, self.itemsize) for t, s in zip(self.tensors, self.layout.slots))

    def ensure_flattened(self) -> int:
        """Re-swap every effective tensor that was recreated since ``flatten()``; returns how many.

        Each re-swap copies the new value into the flat buffer once and installs a
        view, so the buffer always holds the current values before communication.
        """
        if self.buffer is None:
            self.flatten()
            return len(self.tensors)
        swapped = 0
        for t, slot in zip(self.tensors, self.layout.slots):
            if not t.is_view_of(self.buffer, slot.offset, self.itemsize):
                self._check_shape(t, slot)
                t.set_registered_storage(self.buffer, slot.offset)
                swapped += 1
        return swapped

    def _check_shape(self, t: RegisteredTensor, slot: Slot) -> None:
        shape = tuple(t.effective().shape)
        if shape != slot.shape:
            raise BaguaXError(
                f"tensor {t.name!r} now has shape {shape}, but bucket {self.name!r} registered it with {slot.shape}; "
                "the effective tensor must keep its registered shape"
            )

    def pack(self):
        """Copy the effective tensors into a new flat array (no views needed)."""
        return self.layout.pack([t.effective() for t in self.tensors])

    def unpack(self, flat) -> None:
        """Write ``flat`` back into the effective tensors (through setters where present)."""
        for t, value in zip(self.tensors, self.layout.unpack(flat)):
            if t.setter is not None:
                t.set_effective(value)
            else:
                target = t.effective()
                check_writable(target, t.name)
                target[...] = value

    def mark_ready(self, tensor: RegisteredTensor) -> None:
        """Tell the bucket's dispatcher (:mod:`.readiness`, which counts readiness) that ``tensor`` is final."""
        if tensor.bucket is not self:
            raise BaguaXError(f"tensor {tensor.name!r} is not in bucket {self.name!r}")
        if self.on_ready is None:
            raise BaguaXError(f"tensor {tensor.name!r} was marked ready, but bucket {self.name!r} has no "
                              "dispatcher to count it; make a bagua_x.core.BucketDispatcher over the buckets first")
        self.on_ready(tensor)


def plan_buckets(entries: Sequence[tuple[str, str, int]], cap_bytes: float) -> list[list[int]]:
    """Group tensors into buckets: one dtype/device per bucket, at most ``cap_bytes`` each.

    ``entries`` are ``(group_key, name, nbytes)`` in registration order, where
    ``group_key`` identifies dtype and device.  Returns lists of entry indices;
    the order is deterministic, so every rank derives the same buckets.
    A tensor larger than the cap gets a bucket of its own.
    """
    open_buckets: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    done: list[list[int]] = []
    for i, (key, _name, nbytes) in enumerate(entries):
        current = open_buckets.get(key)
        if current and sizes[key] + nbytes > cap_bytes:
            done.append(current)
            current = None
        if not current:
            open_buckets[key], sizes[key] = [], 0
        open_buckets[key].append(i)
        sizes[key] += nbytes
    done.extend(b for b in open_buckets.values() if b)
    done.sort(key=lambda b: b[0])
    return done
