"""Checks on what the user hands to ``wrap``, and on what is communicated.

Bad input is reported at ``wrap()`` by name, before any bucket is built,
instead of surfacing later as a failed collective or a wrong result:

* trainable parameters must be real floating point (a complex parameter would
  be averaged as if its real and imaginary parts were unrelated numbers only
  by accident of layout; integer ones cannot have gradients);
* gradients must be dense (``nn.Embedding(sparse=True)`` produces sparse
  gradients, which buckets cannot hold);
* all trainable parameters on one device (one communication thread per device).

``check_finite`` runs on the communication thread *after* the reduction, and
the ranks agree on its outcome there (a MIN allreduce of "finite" flags, in
bucket order like every job of that thread) before any raises: a weight
algorithm's reduced values differ by rank (a neighbour's NaN reaches one peer,
a step between exchanges keeps each rank's own), so a rank that looked only at
its own values would raise alone and leave its peers waiting in the next
collective.  Every rank raises the same error at the same step, naming the
tensors non-finite on any rank; the message also says whether this rank's own
contribution was already non-finite.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core.bucket import Bucket
from ..core.comm import Communicator, ReduceOp
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


def check_finite(bucket: Bucket, flat: torch.Tensor, local_bad: list[str], what: str, comm: Communicator) -> None:
    """Raise, on every rank of ``comm`` alike, naming the tensors of ``bucket`` whose reduced values (``flat``)
    are not finite on some rank (collective: one flag allreduced per bucket, one per tensor after a failure)."""
    if _finite_everywhere(comm, torch.isfinite(flat).all().reshape(1))[0]:
        return
    slots = bucket.layout.slots
    finite = torch.stack([torch.isfinite(flat[s.offset:s.offset + s.numel]).all() for s in slots])
    bad = [s.name for s, ok in zip(slots, _finite_everywhere(comm, finite)) if not ok]
    mine = (f"this rank's own {what} was already non-finite in {local_bad}" if local_bad
            else f"this rank's own {what} was finite, so another rank contributed the NaN/inf")
    raise BaguaXError(
        f"non-finite {what} after communication in bucket {bucket.name!r}: tensors {bad} (on at least one rank; "
        f"{mine}); lower the learning rate, clip gradients or use loss scaling, or wrap with check_finite=False to "
        "skip this check"
    )


def _finite_everywhere(comm: Communicator, finite: torch.Tensor) -> list[bool]:
    """Each flag of ``finite`` (1-d, booleans) true on every rank: their MIN over ``comm``, read on the host."""
    return [bool(f) for f in comm.allreduce(finite.to(torch.int32), ReduceOp.MIN).tolist()]
