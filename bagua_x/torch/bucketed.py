"""The lifecycle every bucketed torch engine shares, written once.

:class:`BucketedEngine` holds what all of them have: the algorithm, the
communicator, the buckets with their per-bucket state, and one communication
thread (:class:`~.runtime.CommWorker`, whose single thread keeps collectives
in the same order on every rank, and communicates on a CUDA stream of its
own: the stream rules live there and in :mod:`.streams`).  It runs a bucket's
``reduce`` there, saves and loads the per-bucket state, and closes.

:class:`BackwardEngine` adds what engines that communicate *during backward*
share (gradients; QAdam's momentum): a hook per tensor marks it ready once its
gradient is final (:mod:`.ready_counts`: after one firing, or with
``static_graph`` after as many as in the first backward), a
:class:`~bagua_x.core.readiness.BucketDispatcher` launches complete buckets in
list order, the end of backward waits for them (until all are launched; then
the caller's stream waits for the communication stream), and a backward that raised
before its end is settled before the next forward.  Subclasses say what a
tensor's hook does (:meth:`BackwardEngine._on_ready`) and may add work before
the wait (:meth:`BackwardEngine._before_wait`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..algorithms.base import Algorithm
from ..core.bucket import Bucket
from ..core.errors import BaguaXError
from ..core.readiness import BucketDispatcher
from ..core.tensor import RegisteredTensor
from .buckets import load_states, state_dict_of
from .checks import check_finite, non_finite_tensors
from .communicator import TorchCommunicator
from .engine import EngineOptions
from .ready_counts import ReadyCounts
from .runtime import BackwardHooks, CommWorker
from .stall import StallInspector

__all__ = ["BucketedEngine", "BackwardEngine", "reduce_in_place"]


def reduce_in_place(algorithm: Algorithm, flat: torch.Tensor, layout, state: dict, comm: TorchCommunicator,
                    finite: Optional[tuple[Bucket, str]] = None) -> dict:
    """``flat <- reduce(flat)``, in place; returns the new state: the one call site of the algorithm interface
    in the torch frontend (engines and the comm hook).  ``finite``, a bucket and what it holds ("gradient"...):
    raise naming its tensors when a reduced value is NaN or infinite (wrap's ``check_finite``)."""
    local_bad = non_finite_tensors(finite[0], flat) if finite else []
    if algorithm.donates_input:
        with comm.donate(flat):
            out, state = algorithm.reduce(flat, layout, state, comm)
    else:
        out, state = algorithm.reduce(flat, layout, state, comm)
    if out is not flat:
        flat.copy_(out)
    if finite:
        check_finite(finite[0], flat, local_bad, finite[1])
    return state


class BucketedEngine:
    """Buckets, their algorithm state and the communication thread (see the module docstring).

    ``what`` names the communicated tensors in messages ("gradient", "weights", "momentum").
    """

    what = "tensor"

    def __init__(self, tensors: Sequence[RegisteredTensor], algorithm: Algorithm, comm: TorchCommunicator,
                 options: EngineOptions, thread_name: str):
        self.algorithm, self.comm, self.check_finite = algorithm, comm, options.check_finite
        self.enabled = True  # False inside no_sync()
        self.buckets: list[Bucket] = []
        self.states: list[dict] = []
        self._worker = CommWorker(thread_name, tensors[0].proxy.device, comm.timeout, StallInspector(comm.group))

    def _submit(self, i: int, flat: torch.Tensor, prepare: Optional[Callable[[], None]] = None) -> None:
        """Run the algorithm on bucket ``i``'s ``flat`` values on the communication thread (state kept),
        after ``prepare()`` there."""
        bucket = self.buckets[i]

        def job():
            if prepare is not None:
                prepare()
            with torch.no_grad():
                self.states[i] = reduce_in_place(self.algorithm, flat, bucket.layout, self.states[i], self.comm,
                                                 (bucket, self.what) if self.check_finite else None)
        self._worker.submit(f"{type(self.algorithm).__name__} on {bucket.name}", job, bucket)

    def state_dict(self) -> dict:
        return state_dict_of(self.buckets, self.states)

    def load_state_dict(self, saved: dict) -> None:
        load_states(self.buckets, self.states, saved)

    def close(self) -> None:
        self._worker.close()


class BackwardEngine(BucketedEngine):
    """A :class:`BucketedEngine` whose buckets are communicated as backward makes their tensors ready."""

    def __init__(self, tensors: Sequence[RegisteredTensor], algorithm: Algorithm, comm: TorchCommunicator,
                 options: EngineOptions, thread_name: str):
        super().__init__(tensors, algorithm, comm, options, thread_name)
        self.find_unused = options.find_unused_parameters
        self._tensors = list(tensors)
        self._dispatcher: Optional[BucketDispatcher] = None
        self._counts = ReadyCounts(tensors, options.static_graph)
        self._hooks = BackwardHooks(tensors, self._on_hook, self._finish, lambda: self.enabled)

    def _set_buckets(self, buckets: list[Bucket], states: list[dict]) -> None:
        self.buckets, self.states = buckets, states
        self._dispatcher = BucketDispatcher(buckets, self._launch)

    def _on_hook(self, t: RegisteredTensor) -> None:
        if self._counts.fire(t):
            self._on_ready(t)

    def _on_ready(self, t: RegisteredTensor) -> None:
        """``t``'s gradient is final in this backward (its hook's last firing, see :mod:`.ready_counts`):
        make its effective tensor final, then ``t.mark_ready()``."""
        raise NotImplementedError

    def _launch(self, bucket: Bucket) -> None:
        """A complete bucket (in list order): communicate it on the communication thread."""
        self._submit(self.buckets.index(bucket), bucket.buffer, lambda: self._prepare(bucket))

    def _prepare(self, bucket: Bucket) -> None:
        """On the communication thread, before the bucket's collective: move back any recreated tensor
        (overlapped with the rest of backward), so a stale value is never communicated."""
        bucket.ensure_flattened()

    def _before_wait(self) -> None:
        """End of backward, before waiting: tensors no rank made ready are marked here (find_unused)."""
        if self.find_unused:
            for t in self._dispatcher.unready_tensors():
                self._on_ready(t)

    def _after_wait(self) -> None:
        """End of backward, after every bucket is communicated."""

    def _finish(self) -> None:
        try:
            try:
                final = self._counts.end()
            except BaguaXError:  # a gradient never final, on every rank: end what was launched first
                self._worker.wait()
                raise
            for t in final:  # the first static-graph backward: reduced at its end, as in DDP
                self._on_ready(t)
            self._before_wait()
            self._worker.wait()
            self._dispatcher.check_all_dispatched()
            self._after_wait()
        finally:
            self._dispatcher.reset()
            self._counts.reset()

    def settle(self) -> None:
        """Before a forward: end the communication of a backward that raised before its end-of-backward
        callback; raise a timeout the communication thread found since the last backward."""
        if self._hooks.queued:
            self._hooks.abandon()
            self._dispatcher.reset()
            self._counts.reset()
            self._worker.wait()  # let buckets already launched finish, so collectives stay paired
        self._worker.check()

    def before_forward(self) -> None:
        """Communication happens during backward: nothing starts at forward."""

    def after_forward(self, outputs) -> None:
        self._hooks.watch(outputs)

    def close(self) -> None:
        self._hooks.remove()
        super().close()
