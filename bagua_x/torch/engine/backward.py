"""The engines that communicate *during backward* (gradients; QAdam's momentum): hooks and readiness.

:class:`BackwardHooks` registers a hook per tensor (called with the tensor's
index) and runs the end-of-backward callback once per backward.
:class:`BackwardEngine` adds to :class:`~.base.BucketedEngine` one owner of
readiness (:class:`~bagua_x.core.readiness.ReadyCounts`: when a gradient is
final, which buckets may be launched, in list order), the end of backward
waiting for them (until all are launched; then the caller's stream waits for
the communication stream), and a backward that raised before its end settled
before the next forward.  Subclasses say what a tensor's hook does once it is
final (:meth:`BackwardEngine._on_ready`) and may add work before the wait
(:meth:`BackwardEngine._before_wait`); the gradient engine, on the hot path,
overrides the hook itself.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
from torch.utils._pytree import tree_leaves

from ...algorithms.base import Algorithm
from ...core.errors import BaguaXError
from ...core.readiness import ReadyCounts
from ...core.tensor import RegisteredTensor
from ..communicator import TorchCommunicator
from .base import BucketedEngine
from .comm_thread import BucketSlot
from .interface import EngineOptions

__all__ = ["BackwardHooks", "BackwardEngine"]


class BackwardHooks:
    """``on_hook(i, param)`` from tensor ``i``'s post-accumulate-grad hook, then ``on_end()`` once per backward.

    ``on_hook`` itself is the registered hook (no frame in between: it runs
    once per parameter per step); when it takes part in a step it calls
    :meth:`arm`.  ``on_end`` runs after the whole backward, before
    ``loss.backward()`` returns: it is queued on the autograd engine's graph
    task when backward reaches the forward's outputs (:meth:`watch`), or else
    at the first :meth:`arm`.  The outputs come first because a hook may fire
    inside a nested backward (reentrant activation checkpointing), whose end
    is not the end of backward.  It runs only if a hook armed it (a backward
    that reaches the outputs but no parameter, e.g. a gradient of the input,
    is not a step).  ``active()`` is checked when the outputs are reached:
    inside ``no_sync()`` nothing is queued.
    """

    def __init__(self, tensors: Sequence[RegisteredTensor], on_hook: Callable[[int, torch.Tensor], None],
                 on_end: Callable[[], None], active: Callable[[], bool]):
        self._on_end, self._active = on_end, active
        self.queued = False
        self._fired = False
        self._handles = [
            t.proxy.register_post_accumulate_grad_hook(functools.partial(on_hook, i)) for i, t in enumerate(tensors)
        ]

    def watch(self, outputs) -> None:
        """Queue ``on_end`` when backward reaches a tensor of ``outputs`` (a forward's, any nesting of
        lists, tuples and dicts): that is the outermost backward, before any parameter's hook."""
        for t in tree_leaves(outputs):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(self._queue_end)

    def _queue_end(self, *_) -> None:
        if self._active() and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def arm(self) -> None:
        """A hook took part in this backward: ``on_end`` runs at its end."""
        self._fired = True
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        fired, self.queued, self._fired = self._fired, False, False
        if fired:
            self._on_end()

    def abandon(self) -> None:
        """A backward that raised before its end: its ``on_end`` will not run."""
        self.queued = self._fired = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class BackwardEngine(BucketedEngine):
    """A :class:`BucketedEngine` whose buckets are communicated as backward makes their tensors ready."""

    def __init__(self, tensors: Sequence[RegisteredTensor], algorithm: Algorithm, comm: TorchCommunicator,
                 options: EngineOptions, thread_name: str):
        super().__init__(tensors, algorithm, comm, options, thread_name)
        self.find_unused = options.find_unused_parameters
        self._tensors = list(tensors)
        self._index = {t.name: i for i, t in enumerate(self._tensors)}
        self._ready = ReadyCounts([t.name for t in self._tensors], options.static_graph)
        self._hooks = BackwardHooks(tensors, self._hook, self._end_backward, lambda: self.enabled)

    def _set_slots(self, slots: list[BucketSlot]) -> None:
        self.slots = slots
        self._ready.set_buckets([s.bucket.name for s in slots],
                                [[self._index[t.name] for t in s.bucket.tensors] for s in slots])

    def _hook(self, i: int, _param: torch.Tensor) -> None:
        """Tensor ``i``'s post-accumulate-grad hook (outside ``no_sync()``)."""
        if self.enabled:
            self._hooks.arm()
            if self._ready.fire(i):
                self._on_ready(i)

    def _on_ready(self, i: int) -> None:
        """Tensor ``i``'s gradient is final in this backward (its hook's last firing, see core/readiness.py):
        make its effective tensor final (its bucket's view: what is communicated is never stale), then
        launch what it completes (:meth:`_mark_ready`, or the same loop inline on a hot path)."""
        raise NotImplementedError

    def _mark_ready(self, i: int) -> None:
        """Launch the buckets tensor ``i`` completes (with the complete buckets after them, in list order)."""
        for k in self._ready.ready(i):
            slot = self.slots[k]
            self._worker.submit(slot.job, self._job(slot, slot.bucket.buffer), slot.bucket)

    def _frozen(self, i: int) -> bool:
        """Tensor ``i``'s parameter was frozen after wrap (its hook never fires): for the error that follows."""
        return not self._tensors[i].proxy.requires_grad

    def _before_wait(self) -> None:
        """End of backward, before waiting: tensors no rank made ready are marked here (find_unused)."""
        if self.find_unused:
            for i in self._ready.unready():
                self._on_ready(i)

    def _after_wait(self) -> None:
        """End of backward, after every bucket is communicated."""

    def _end_backward(self) -> None:
        """The end-of-backward callback: launch what is left, wait for every bucket, check none was missed."""
        try:
            try:
                final = self._ready.end()
            except BaguaXError:  # a gradient never final, on every rank: end what was launched first
                self._worker.wait()
                raise
            for i in final:  # the first static-graph backward: reduced at its end, as in DDP
                self._on_ready(i)
            self._before_wait()
            self._worker.wait()
            self._ready.check_all_launched(self._frozen)
            self._after_wait()
            self.synced_steps += 1
        finally:
            self._ready.reset()

    def settle(self) -> None:
        """Before a forward: end the communication of a backward that raised before its end-of-backward
        callback; raise a timeout the communication thread found since the last backward."""
        if self._hooks.queued:
            self._hooks.abandon()
            self._ready.reset()
            self._worker.wait()  # let buckets already launched finish, so collectives stay paired
        self._worker.check()

    def before_forward(self) -> None:
        """Communication happens during backward: nothing starts at forward."""

    def after_forward(self, outputs) -> None:
        self._hooks.watch(outputs)

    def close(self) -> None:
        self._hooks.remove()
        super().close()
