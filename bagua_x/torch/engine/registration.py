"""Registering a model's parameters and grouping them into core buckets.

Which tensor of a parameter is communicated follows ``algorithm.target``:
the gradient (getter ``p.grad``, setter ``p.grad = t``) or the weight itself
(no getter).  Parameters are registered in reverse order, the order backward
produces their gradients, so the first bucket is ready first.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ...algorithms.base import Algorithm, Target, state_from_dict
from ...core.bucket import Bucket, plan_buckets
from ...core.errors import BaguaXError
from ...core.tensor import RegisteredTensor, TensorRegistry
from .. import streams

__all__ = ["grad_getter", "grad_setter", "register_parameters", "build_buckets", "state_dict_of", "load_states",
           "keep_state_for"]


def grad_getter(p: torch.Tensor) -> Optional[torch.Tensor]:
    return p.grad


def grad_setter(p: torch.Tensor, t: torch.Tensor) -> None:
    p.grad = t


def register_parameters(named_params: Sequence[tuple[str, torch.nn.Parameter]],
                        target: Target) -> list[RegisteredTensor]:
    """Register trainable parameters (tied ones once, frozen ones not) in reverse order."""
    if target is Target.GRAD:
        getter, setter = grad_getter, grad_setter
    elif target is Target.WEIGHT:
        getter = setter = None
    else:
        raise BaguaXError(
            f"bagua_x.torch.wrap does not support algorithms that communicate {target.value!r} yet; "
            "use a gradient or weight algorithm"
        )
    registry = TensorRegistry()
    tensors = [registry.register(name, p, getter, setter) for name, p in reversed(list(named_params))
               if p.requires_grad]
    if not tensors:
        raise BaguaXError("the model has no trainable parameters (requires_grad=True); there is nothing to synchronise")
    return tensors


FIRST_BUCKET_MB = 1.0


def build_buckets(tensors: Sequence[RegisteredTensor], algorithm: Algorithm, world_size: int,
                  bucket_cap_mb: float, prefix: str,
                  make: Callable[[str, list[RegisteredTensor], int], Bucket] = Bucket) -> list[Bucket]:
    """Split ``tensors`` into buckets of one dtype/device and at most ``bucket_cap_mb`` each.

    As in DDP, the first tensors (the last layers, whose gradients come first)
    up to about 1 MB form a small first bucket, so communication starts early in backward.
    ``make(name, tensors, alignment)`` builds each bucket (one at a time, so a
    caller can create temporary tensors for one bucket only).
    """
    if bucket_cap_mb <= 0:
        raise BaguaXError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    entries = [(f"{t.proxy.dtype}/{t.proxy.device}", t.name, t.proxy.numel() * t.proxy.element_size())
               for t in tensors]
    first_cap = min(FIRST_BUCKET_MB, bucket_cap_mb) * 2**20
    head, total = 0, 0
    while head < len(entries) and total < first_cap:
        total += entries[head][2]
        head += 1
    plan = plan_buckets(entries[:head], float("inf")) + [
        [head + i for i in b] for b in plan_buckets(entries[head:], bucket_cap_mb * 2**20)]
    alignment = algorithm.alignment(world_size)
    return [make(f"{prefix}{i}", [tensors[j] for j in idx], alignment) for i, idx in enumerate(plan)]


def state_dict_of(slots: Sequence) -> dict:
    """Per-bucket algorithm state of the engine's slots (``.bucket``, ``.state``) as dicts (``_asdict()``),
    copied (so later steps do not change it)."""
    return {s.bucket.name: {k: _copy_like(v, v) for k, v in s.state._asdict().items()} for s in slots}


def keep_state_for(state, stream: "streams.Stream"):
    """Mark ``state``'s tensors, made on the training thread's stream, for ``stream`` (the communication
    stream, where ``reduce`` reads them) and return ``state``.  Without the mark, once the communication
    thread drops them for the state ``reduce`` returns, the caching allocator hands their memory to the
    training stream while the communication stream may still be reading them (PowerSGD's Q and error
    feedback at its first compressed step, and after every load)."""
    for v in state:
        if isinstance(v, torch.Tensor):
            streams.keep_for(v, stream)
    return state


def load_states(slots: Sequence, saved: dict, stream: "streams.Stream") -> None:
    """Each slot's state from its bucket's saved dict (copied), as the type of the state it replaces, marked
    for ``stream``, the communication stream that reads it (:func:`keep_state_for`)."""
    names = [s.bucket.name for s in slots]
    if sorted(saved) != sorted(names):
        raise BaguaXError(
            f"algorithm state has buckets {sorted(saved)}, but this wrapper has {names}; "
            "load a state saved from the same model, algorithm and bucket_cap_mb"
        )
    loaded = [state_from_dict(s.state, saved[s.bucket.name], f"bucket {s.bucket.name!r}") for s in slots]
    for s, state in zip(slots, loaded):
        _check_shapes(state, s.state, s.bucket.name)
    for s, state in zip(slots, loaded):
        s.state = keep_state_for(type(state)(*map(_copy_like, state, s.state)), stream)


def _check_shapes(loaded, live, bucket: str) -> None:
    """Raise naming the bucket and field where a loaded array's shape differs from the state made at wrap: saved
    with other settings that size the state (DiLoCo's ``fragment_sync_delay`` keeps pseudo-gradients in flight
    or none), which would otherwise fail later, inside ``reduce``, with an indexing error."""
    for field, v, t in zip(type(live)._fields, loaded, live):
        if isinstance(v, torch.Tensor) and isinstance(t, torch.Tensor) and v.shape != t.shape:
            raise BaguaXError(
                f"the saved algorithm state of bucket {bucket!r} has {field!r} of shape {tuple(v.shape)}, but this "
                f"wrapper's is {tuple(t.shape)}: it was saved with other algorithm settings or another model; load "
                "a state saved with the same ones"
            )


def _copy_like(v, template):
    """A copy of loaded value ``v`` where ``template`` (the state made at wrap) keeps it: arrays on the bucket's
    device, the step counter on the host (``algorithms.base.counter``: a checkpoint loaded with
    ``map_location="cuda"`` must not make ``comm.switch`` read it back from the GPU every step)."""
    if not isinstance(v, torch.Tensor):
        return v
    device = template.device if isinstance(template, torch.Tensor) else v.device
    return v.detach().to(device, copy=True)
