"""The lifecycle every bucketed torch engine shares, written once.

:class:`BucketedEngine` holds what all of them have: the algorithm, the
communicator, one :class:`~.comm_thread.BucketSlot` per bucket (the bucket and
its algorithm state, one list, no parallel ones), and one communication thread
(:class:`~.comm_thread.CommWorker`, whose single thread keeps collectives in
the same order on every rank, and communicates on a CUDA stream of its own:
the stream rules live there and in :mod:`..streams`).  It runs a bucket's
``reduce`` there (:meth:`BucketedEngine._job`), saves and loads the per-bucket
state, and closes.  The engines that communicate during backward add their
hooks and readiness in :mod:`.gradient`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Sequence

import torch

from ...algorithms.base import Algorithm
from ...core.bucket import Bucket
from ...core.tensor import RegisteredTensor
from ..communicator import TorchCommunicator
from ..stall import StallInspector
from .comm_thread import BucketSlot, CommWorker, reduce_in_place
from .interface import EngineOptions
from .registration import keep_state_for, load_states, state_dict_of

__all__ = ["BucketedEngine"]


class BucketedEngine:
    """Bucket slots and the communication thread (see the module docstring).

    ``tensor_kind`` names the communicated tensors in messages ("gradient", "weights", "momentum").
    """

    tensor_kind = "tensor"

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

    def _slots(self, buckets: Sequence[Bucket], states: Sequence) -> list[BucketSlot]:
        """Slots for ``buckets`` with ``states``, made on this (the training) thread's stream: marked for the
        communication stream that reads them (:func:`~.registration.keep_state_for`)."""
        name = type(self.algorithm).__name__
        return [BucketSlot(b.layout, keep_state_for(s, self._worker.stream), f"{name} on {b.name}", b)
                for b, s in zip(buckets, states)]

    def _job(self, slot: BucketSlot, flat: torch.Tensor) -> functools.partial:
        """The communication thread's job for ``flat``, the values of ``slot``'s bucket: reduce in place."""
        finite: Optional[str] = self.tensor_kind if self.check_finite else None
        return functools.partial(reduce_in_place, self.algorithm, flat, slot, self.comm, finite)

    def _submit(self, slot: BucketSlot, flat: torch.Tensor) -> None:
        """Run the algorithm on ``flat``, the values of ``slot``'s bucket, on the communication thread."""
        self._worker.submit(slot.job, self._job(slot, flat), slot.bucket)

    def weights_locked(self):
        """Only the training thread writes the weights (the communication thread is waited for in the step)."""
        return contextlib.nullcontext(False)

    def state_dict(self) -> dict:
        return state_dict_of(self.slots)

    def load_state_dict(self, saved: dict) -> None:
        load_states(self.slots, saved, self._worker.stream)

    def close(self) -> None:
        self._worker.close()
