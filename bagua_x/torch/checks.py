"""Checks on what the user hands to ``wrap``, and on what is communicated.

Bad input is reported at ``wrap()`` by name, before any bucket is built,
instead of surfacing later as a failed collective or a wrong result:

* trainable parameters must be real floating point (a complex parameter would
  be averaged as if its real and imaginary parts were unrelated numbers only
  by accident of layout; integer ones cannot have gradients);
* gradients must be dense (``nn.Embedding(sparse=True)`` produces sparse
  gradients, which buckets cannot hold);
* all trainable parameters on one device (one communication thread per device).

``check_finite`` runs on the communication thread *after* the reduction, so
every rank sees the same reduced values and raises the same error at the same
step (no rank is left waiting in the next collective); the message also says
whether this rank's own contribution was already non-finite.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core.bucket import Bucket
from ..core.errors import BaguaXError

__all__ = ["input_problem", "check_dense_grad", "non_finite_tensors", "check_finite"]

_SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def input_problem(module: torch.nn.Module) -> Optional[str]:
    """What is wrong with the model's trainable parameters for wrap(), or None."""
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    for name, p in trainable:
        if not p.is_floating_point():
            return (f"parameter {name!r} is {p.dtype}; bagua_x communicates real floating-point tensors only: "
                    f"freeze it (requires_grad_(False)) or store it as real numbers (torch.view_as_real)")
    for mod_name, mod in module.named_modules():
        if isinstance(mod, _SPARSE_MODULES) and mod.sparse and mod.weight.requires_grad:
            name = f"{mod_name}.weight" if mod_name else "weight"
            return (f"parameter {name!r} gets sparse gradients ({type(mod).__name__}(sparse=True)); bagua_x buckets "
                    "hold dense gradients only: build it with sparse=False")
    devices: dict[torch.device, str] = {}
    for name, p in trainable:
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        where = ", ".join(f"{n!r} on {d}" for d, n in devices.items())
        return (f"trainable parameters are on several devices ({where}); wrap() needs the whole model on one "
                "device per process: move it with model.to(device)")
    return None


def check_dense_grad(name: str, grad: Optional[torch.Tensor]) -> None:
    """Raise for a sparse gradient that a module made without saying so at wrap()."""
    if grad is not None and grad.layout is not torch.strided:
        raise BaguaXError(
            f"parameter {name!r} got a {grad.layout} gradient; bagua_x buckets hold dense gradients only: "
            "use dense gradients (e.g. nn.Embedding(sparse=False))"
        )


def non_finite_tensors(bucket: Bucket, flat: torch.Tensor) -> list[str]:
    """Names of the bucket's tensors with a NaN or infinity in ``flat`` (one pass when all is finite)."""
    if bool(torch.isfinite(flat).all()):
        return []
    return [s.name for s in bucket.layout.slots
            if not bool(torch.isfinite(flat[s.offset:s.offset + s.numel]).all())]


def check_finite(bucket: Bucket, flat: torch.Tensor, local_bad: list[str], what: str) -> None:
    """Raise naming the tensors of ``bucket`` whose reduced values (``flat``) are not finite."""
    bad = non_finite_tensors(bucket, flat)
    if bad:
        mine = (f"this rank's own {what} was already non-finite in {local_bad}" if local_bad
                else f"this rank's own {what} was finite, so another rank contributed the NaN/inf")
        raise BaguaXError(
            f"non-finite {what} after communication in bucket {bucket.name!r}: tensors {bad} ({mine}); "
            "lower the learning rate, clip gradients or use loss scaling, or wrap with check_finite=False to skip "
            "this check"
        )
