"""The lifecycle every bucketed torch engine shares, written once.

:class:`BucketedEngine` holds what all of them have: the algorithm, the
communicator, one :class:`BucketSlot` per bucket (the bucket and its algorithm
state, one list, no parallel ones), and one communication thread
(:class:`~..runtime.CommWorker`, whose single thread keeps collectives in the
same order on every rank, and communicates on a CUDA stream of its own: the
stream rules live there and in :mod:`..streams`).  It runs a bucket's
``reduce`` there, saves and loads the per-bucket state, and closes.

:class:`BackwardEngine` adds what engines that communicate *during backward*
share (gradients; QAdam's momentum): a hook per tensor (registered by
:class:`~..runtime.BackwardHooks`, called with the tensor's index), one owner
of readiness (:class:`~bagua_x.core.readiness.ReadyCounts`: when a gradient is final,
which buckets may be launched, in list order), the end of backward waits for
them (until all are launched; then the caller's stream waits for the
communication stream), and a backward that raised before its end is settled
before the next forward.  Subclasses say what a tensor's hook does once it is
final (:meth:`BackwardEngine._on_ready`) and may add work before the wait
(:meth:`BackwardEngine._before_wait`).

A gradient's control path, hook to collective, is two short stacks:
``_hook`` -> ``_on_ready`` -> ``_mark_ready`` -> ``CommWorker.submit`` on the
training thread, then ``_reduce`` -> :func:`reduce_in_place` ->
``algorithm.reduce`` -> the communicator on the communication thread
(``benchmarks/control_path.py`` prints it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Optional, Sequence

import torch

from ...algorithms.base import Algorithm
from ...core.bucket import Bucket
from ...core.errors import BaguaXError
from ...core.readiness import ReadyCounts
from ...core.tensor import RegisteredTensor
from ..checks import check_finite, non_finite_tensors
from ..communicator import TorchCommunicator
from ..runtime import BackwardHooks, CommWorker
from ..stall import StallInspector
from .interface import EngineOptions
from .registration import keep_state_for, load_states, state_dict_of

__all__ = ["BucketSlot", "BucketedEngine", "BackwardEngine", "reduce_in_place"]


def reduce_in_place(algorithm: Algorithm, flat: torch.Tensor, layout, state: dict, comm: TorchCommunicator,
                    finite: Optional[tuple[Bucket, str]] = None) -> dict:
    """``flat <- reduce(flat)``, in place; returns the new state: the one call site of the algorithm interface
    in the torch frontend (engines and the comm hook).  ``finite``, a bucket and what it holds ("gradient"...):
    raise naming its tensors when a reduced value is NaN or infinite on any rank, on every rank alike (wrap's
    ``check_finite``; collective, so every rank passes ``finite`` or none)."""
    local_bad = non_finite_tensors(finite[0], flat) if finite else []
    if algorithm.donates_input:
        with comm.donate(flat):
            out, state = algorithm.reduce(flat, layout, state, comm)
    else:
        out, state = algorithm.reduce(flat, layout, state, comm)
    if out is not flat:
        flat.copy_(out)
    if finite:
        check_finite(finite[0], flat, local_bad, finite[1], comm)
    return state


@dataclasses.dataclass
class BucketSlot:
    """A bucket, its algorithm state, and what the communication thread calls its reduction (in reports)."""

    bucket: Bucket
    state: dict
    what: str


class BucketedEngine:
    """Bucket slots and the communication thread (see the module docstring).

    ``what`` names the communicated tensors in messages ("gradient", "weights", "momentum").
    """

    what = "tensor"

    def __init__(self, tensors: Sequence[RegisteredTensor], algorithm: Algorithm, comm: TorchCommunicator,
                 options: EngineOptions, thread_name: str):
        self.algorithm, self.comm, self.check_finite = algorithm, comm, options.check_finite
        self.enabled = True  # False inside no_sync()
        self.synced_steps = 0  # see Engine.synced_steps
        self.slots: list[BucketSlot] = []
        self._worker = CommWorker(thread_name, tensors[0].proxy.device, comm.timeout, StallInspector(comm.group))

    @property
    def buckets(self) -> list[Bucket]:
        return [s.bucket for s in self.slots]

    def _slots(self, buckets: Sequence[Bucket], states: Sequence[dict]) -> list[BucketSlot]:
        """Slots for ``buckets`` with ``states``, made on this (the training) thread's stream: marked for the
        communication stream that reads them (:func:`~.registration.keep_state_for`)."""
        name = type(self.algorithm).__name__
        return [BucketSlot(b, keep_state_for(s, self._worker.stream), f"{name} on {b.name}")
                for b, s in zip(buckets, states)]

    def _submit(self, slot: BucketSlot, flat: torch.Tensor) -> None:
        """Run the algorithm on ``flat``, the values of ``slot``'s bucket, on the communication thread."""
        self._worker.submit(slot.what, functools.partial(self._reduce, slot, flat), slot.bucket)

    def _reduce(self, slot: BucketSlot, flat: torch.Tensor) -> None:
        """On the communication thread: ``flat <- reduce(flat)``, the slot's state kept."""
        slot.state = reduce_in_place(self.algorithm, flat, slot.bucket.layout, slot.state, self.comm,
                                     (slot.bucket, self.what) if self.check_finite else None)

    def weights_locked(self):
        """Only the training thread writes the weights (the communication thread is waited for in the step)."""
        return contextlib.nullcontext(False)

    def state_dict(self) -> dict:
        return state_dict_of(self.slots)

    def load_state_dict(self, saved: dict) -> None:
        load_states(self.slots, saved, self._worker.stream)

    def close(self) -> None:
        self._worker.close()


class BackwardEngine(BucketedEngine):
    """A :class:`BucketedEngine` whose buckets are communicated as backward makes their tensors ready."""

    def __init__(self, tensors: Sequence[RegisteredTensor], algorithm: Algorithm, comm: TorchCommunicator,
                 options: EngineOptions, thread_name: str):
        super().__init__(tensors, algorithm, comm, options, thread_name)
        self.find_unused = options.find_unused_parameters
        self._tensors = list(tensors)
        self._index = {t.name: i for i, t in enumerate(self._tensors)}
        self._ready = ReadyCounts([t.name for t in self._tensors], options.static_graph)
        self._hooks = BackwardHooks(tensors, self._hook, self._finish, lambda: self.enabled)

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
        ``self._mark_ready(i)``."""
        raise NotImplementedError

    def _mark_ready(self, i: int) -> None:
        """Launch the buckets tensor ``i`` completes (with the complete buckets after them, in list order)."""
        for k in self._ready.ready(i):
            slot = self.slots[k]
            self._worker.submit(slot.what, functools.partial(self._reduce, slot, slot.bucket.buffer), slot.bucket)

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

    def _finish(self) -> None:
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
