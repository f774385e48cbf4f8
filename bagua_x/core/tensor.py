"""Registered tensors: a stable proxy and the effective tensor reached through it.

This is Bagua's "mutable bucket tensor" idea.  The backend never keeps the
tensor it communicates: whenever it needs it, it asks ``getter(proxy)`` for the
*effective* tensor (``p.grad``, an optimizer's ``exp_avg``...).  So when a
framework recreates that tensor at run time -- ``zero_grad(set_to_none=True)``,
an optimizer rebuilding its state, a user assigning ``p.grad`` -- communication
still uses the right one.  ``setter(proxy, t)`` installs a replacement.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import array_api_compat

from .dlpack import buffer_info, check_writable, data_pointer, numel
from .errors import BaguaXError

__all__ = ["RegisteredTensor", "TensorRegistry"]

Getter = Callable[[Any], Any]
Setter = Callable[[Any, Any], None]


def _namespace(x):
    return array_api_compat.array_namespace(x)


class RegisteredTensor:
    """A proxy registered for communication, with optional getter/setter closures."""

    def __init__(self, name: str, proxy: Any, getter: Optional[Getter] = None, setter: Optional[Setter] = None):
        if setter is not None and getter is None:
            raise BaguaXError(
                f"tensor {name!r}: a setter was given without a getter; the setter replaces the effective "
                "tensor that the getter returns, so pass both (or neither, to communicate the proxy itself)"
            )
        self.name = name
        self.proxy = proxy
        self.getter = getter
        self.setter = setter
        self.bucket = None  # set by Bucket
        self.offset = 0  # element offset inside the bucket's flat buffer

    def __repr__(self) -> str:
        return f"RegisteredTensor({self.name!r})"

    # -- effective tensor ---------------------------------------------------------------
    def effective(self):
        """The tensor communicated now: ``getter(proxy)``, or the proxy itself."""
        if self.getter is None:
            return self.proxy
        t = self.getter(self.proxy)
        if t is None:
            raise BaguaXError(
                f"the getter of tensor {self.name!r} returned None (e.g. a parameter with no gradient yet); "
                "call ensure_grad() first or make the getter return an array"
            )
        if not hasattr(t, "__dlpack__"):
            raise BaguaXError(
                f"the getter of tensor {self.name!r} returned a {type(t).__name__}, not an array; "
                "it must return an array with __dlpack__ (numpy, torch, jax)"
            )
        return t

    def set_effective(self, t) -> None:
        """Replace the effective tensor through the setter."""
        if self.setter is None:
            raise BaguaXError(
                f"tensor {self.name!r} has no setter, so its effective tensor cannot be replaced; "
                "register it with a setter"
            )
        self.setter(self.proxy, t)

    def ensure_grad(self):
        """Create a zero effective tensor if the getter returns None; returns ``self``."""
        if self.getter is not None and self.getter(self.proxy) is None:
            proxy = self.proxy.detach() if getattr(self.proxy, "requires_grad", False) else self.proxy
            self.set_effective(_namespace(proxy).zeros_like(proxy))
        return self

    # -- storage -------------------------------------------------------------------------
    def set_registered_storage(self, buffer, offset: int) -> None:
        """Make the effective tensor a view of ``buffer[offset:]``, keeping its value.

        With a setter a new view is installed through it; without one the effective
        tensor is re-pointed in place (frameworks with mutable tensors only).
        """
        t = self.effective()
        xp = _namespace(buffer)
        shape = tuple(t.shape)
        n = numel(shape)
        check_writable(buffer, f"bucket buffer of {self.name}")
        view = xp.reshape(buffer[offset : offset + n], shape)
        if data_pointer(view) != data_pointer(buffer) + offset * buffer_info(buffer).itemsize:
            raise BaguaXError(f"tensor {self.name!r}: could not take a view of the bucket buffer at offset {offset}")
        if data_pointer(t) != data_pointer(view):
            view[...] = _detached(t)
        if self.setter is not None:
            self.setter(self.proxy, view)
        else:
            _repoint(t, view, self.name)
        self.offset = offset

    def is_view_of(self, buffer, offset: int, itemsize: Optional[int] = None) -> bool:
        """True when the effective tensor currently lives in ``buffer`` at ``offset``.

        Pass ``itemsize`` when known (buckets cache it) to skip reading the buffer's DLPack header.
        """
        t = self.effective()
        itemsize = itemsize or buffer_info(buffer).itemsize
        return data_pointer(t) == data_pointer(buffer) + offset * itemsize

    def mark_ready(self) -> None:
        """Tell this tensor's bucket that its value is final for this step."""
        if self.bucket is None:
            raise BaguaXError(f"tensor {self.name!r} is not in a bucket yet; build the buckets before marking it ready")
        self.bucket.mark_ready(self)


def _detached(t):
    return t.detach() if getattr(t, "requires_grad", False) else t


def _repoint(t, view, name: str) -> None:
    """Point ``t`` at ``view``'s memory in place (torch: ``t.data = view``)."""
    try:
        t.data = view
    except (AttributeError, TypeError) as e:
        raise BaguaXError(
            f"tensor {name!r}: a {type(t).__name__} cannot be re-pointed to new storage in place; "
            "register it with a getter and setter so a view can be installed instead"
        ) from e
    if data_pointer(t) != data_pointer(view):
        raise BaguaXError(f"tensor {name!r}: re-pointing its storage in place did not take effect")


class TensorRegistry:
    """Name -> registered tensor, with each proxy registered once (tied weights)."""

    def __init__(self):
        self._by_name: dict[str, RegisteredTensor] = {}
        self._by_proxy: dict[int, RegisteredTensor] = {}

    def register(self, name: str, proxy: Any, getter: Optional[Getter] = None,
                 setter: Optional[Setter] = None) -> RegisteredTensor:
        known = self._by_proxy.get(id(proxy))
        if known is not None:
            if known.name != name:
                raise BaguaXError(
                    f"the same proxy is registered twice, as {known.name!r} and as {name!r}; "
                    "register a shared (tied) tensor once, under one name"
                )
            return known
        if name in self._by_name:
            raise BaguaXError(f"two different tensors are registered under the name {name!r}; give them distinct names")
        tensor = RegisteredTensor(name, proxy, getter, setter)
        self._by_name[name] = tensor
        self._by_proxy[id(proxy)] = tensor
        return tensor

    def __iter__(self):
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __getitem__(self, name: str) -> RegisteredTensor:
        return self._by_name[name]
