"""Gradient buckets rebuilt once, in the order backward made the gradients ready (as DDP does).

Buckets are first planned in reverse registration order, a guess at the order
backward produces gradients.  When modules run in another order than they are
defined in (a shortcut branch, a tied embedding, a layer built late), a bucket
waits for a gradient that comes last and its communication starts late.  So
the GradientEngine records the order during its first synchronised backward
(:class:`OrderRecorder`) and rebuilds its buckets to it once, at the end of
that backward:

* ranks may see different orders (data-dependent branches, ties between
  independent branches) while collectives must pair, so rank 0's order is
  sent to every rank through the store -- plain JSON (``core.wire``), never
  pickle, and not a collective, so it cannot pair with one;
* every rank rebuilds to it and the new buckets are checked across ranks
  (``check_same_buckets``);
* buckets the order would not change (a chain of layers) are kept, and a
  real rebuild frees the old buffers one by one, so the first step's peak
  memory stays near one set of gradient buffers.

The order is kept in the algorithm state dict (:data:`ORDER_KEY`), so a run
resumed from a checkpoint rebuilds the same buckets before its first step.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ...core.errors import BaguaXError
from ...core.tensor import RegisteredTensor
from ...core.wire import decode, encode
from ..store import check_tag, resolve_timeout, store_broadcast

__all__ = ["ORDER_KEY", "OrderRecorder", "complete_order", "agree_on_order", "check_order", "ordered"]

ORDER_KEY = "bucket_order"  # in GradientEngine.state_dict(): the tensor names in bucket order, once rebuilt


class OrderRecorder:
    """The tensor names in the order their gradients became final, while ``recording`` (the first
    synchronised backward, again after one cut short or a checkpoint without an order)."""

    def __init__(self):
        self.recording = True
        self._names: list[str] = []

    def record(self, name: str) -> None:
        self._names.append(name)

    def restart(self) -> None:
        self.recording, self._names = True, []

    def stop(self) -> None:
        self.recording, self._names = False, []

    def agree(self, comm, tensors: Sequence[RegisteredTensor]) -> list[str]:
        """Rank 0's recorded order, completed with the tensors it never saw, on every rank."""
        return agree_on_order(complete_order(self._names, tensors), comm, tensors)


def complete_order(recorded: Sequence[str], tensors: Sequence[RegisteredTensor]) -> list[str]:
    """Every tensor's name once: first as recorded, then the never-recorded ones in registration order."""
    seen = dict.fromkeys(recorded)
    return [*seen, *(t.name for t in tensors if t.name not in seen)]


def agree_on_order(mine: list[str], comm, tensors: Sequence[RegisteredTensor]) -> list[str]:
    """Rank 0's ``mine`` on every rank (others' are ignored), checked to be an order of ``tensors``."""
    what = "bagua_x: rebuilding gradient buckets in the order of the first backward"
    timeout = comm.timeout if comm.timeout is not None else resolve_timeout(None, comm.group)
    data = store_broadcast(check_tag("bucket_order", comm.group), encode(mine) if comm.rank == 0 else None,
                           comm.group, timeout, what)
    return check_order(decode(data, f"{what}: rank 0's order"), tensors, f"{what}: rank 0's order")


def check_order(order, tensors: Sequence[RegisteredTensor], what: str) -> list[str]:
    """``order`` as a list, if it names each of ``tensors`` exactly once; else a BaguaXError."""
    names = [t.name for t in tensors]
    if not isinstance(order, (list, tuple)) or sorted(map(str, order)) != sorted(names) or \
            not all(isinstance(n, str) for n in order):
        raise BaguaXError(f"{what} is {str(order)[:200]!r}, not an order of this model's parameters {names[:8]}...; "
                          "ranks (or the checkpoint) must wrap the same model")
    return list(order)


def ordered(tensors: Sequence[RegisteredTensor], order: Optional[Sequence[str]]) -> list[RegisteredTensor]:
    """``tensors`` in ``order`` (their registration order when None)."""
    if order is None:
        return list(tensors)
    by_name = {t.name: t for t in tensors}
    return [by_name[n] for n in order]
