"""Bagua's tensor API (after its PR #271), opt-in, backed by core RegisteredTensor.

Code written for Bagua's custom algorithms calls methods on ``torch.Tensor``.
``enable_bagua_api()`` installs them (nothing is patched until you call it)::

    import bagua_x.torch as bxt
    from bagua_x.core import Bucket

    bxt.enable_bagua_api()
    for name, p in model.named_parameters():
        p.ensure_bagua_tensor(name, module_name="model",
                              getter_closure=lambda p: p.grad,
                              setter_closure=lambda p, t: setattr(p, "grad", t))
    p.bagua_ensure_grad()                 # zero grad if none; returns p
    p.bagua_getter_closure()              # the effective tensor (here p.grad)
    p.bagua_setter_closure(t)             # replace it (here p.grad = t)
    p.bagua_set_registered_storage(buf, offset)   # make it a view of buf[offset:]
    bucket = Bucket("b0", [p.bagua_registered_tensor() for p in params])  # core bucket
    bucket.flatten()
    p.bagua_mark_communication_ready()    # once p's value is final this step

Each method is also a plain function of this module taking the tensor first.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ...core.errors import BaguaXError
from ...core.tensor import RegisteredTensor

__all__ = [
    "enable_bagua_api", "ensure_bagua_tensor", "bagua_registered_tensor", "is_bagua_tensor", "bagua_getter_closure",
    "bagua_setter_closure", "bagua_ensure_grad", "bagua_set_registered_storage", "bagua_mark_communication_ready",
]

_ATTR = "_bagua_x_registered"


def ensure_bagua_tensor(tensor: torch.Tensor, name: str, module_name: Optional[str] = None,
                        getter_closure: Optional[Callable] = None,
                        setter_closure: Optional[Callable] = None) -> torch.Tensor:
    """Register ``tensor`` (idempotent) under ``module_name.name``; returns the tensor itself."""
    full = f"{module_name}.{name}" if module_name else name
    known = getattr(tensor, _ATTR, None)
    if known is not None:
        if known.name != full or known.getter is not getter_closure or known.setter is not setter_closure:
            raise BaguaXError(
                f"tensor {known.name!r} is already a bagua tensor; it cannot be registered again as {full!r} "
                "or with other closures"
            )
        return tensor
    setattr(tensor, _ATTR, RegisteredTensor(full, tensor, getter_closure, setter_closure))
    return tensor


def bagua_registered_tensor(tensor: torch.Tensor) -> RegisteredTensor:
    """The core RegisteredTensor behind a bagua tensor (to build core Buckets from)."""
    registered = getattr(tensor, _ATTR, None)
    if registered is None:
        raise BaguaXError("this tensor is not a bagua tensor; call tensor.ensure_bagua_tensor(name, ...) first")
    return registered


def is_bagua_tensor(tensor: torch.Tensor) -> bool:
    return getattr(tensor, _ATTR, None) is not None


def bagua_getter_closure(tensor: torch.Tensor) -> torch.Tensor:
    return bagua_registered_tensor(tensor).effective()


def bagua_setter_closure(tensor: torch.Tensor, value: torch.Tensor) -> None:
    bagua_registered_tensor(tensor).set_effective(value)


def bagua_ensure_grad(tensor: torch.Tensor) -> torch.Tensor:
    bagua_registered_tensor(tensor).ensure_grad()
    return tensor


def bagua_set_registered_storage(tensor: torch.Tensor, storage: torch.Tensor, storage_offset: int = 0) -> None:
    """Make the effective tensor a view of the flat ``storage`` at element ``storage_offset``, keeping its value."""
    bagua_registered_tensor(tensor).set_registered_storage(storage, storage_offset)


def bagua_mark_communication_ready(tensor: torch.Tensor) -> None:
    bagua_registered_tensor(tensor).mark_ready()


def enable_bagua_api() -> None:
    """Install the functions above as ``torch.Tensor`` methods (idempotent)."""
    for name in __all__[1:]:
        setattr(torch.Tensor, name, globals()[name])
