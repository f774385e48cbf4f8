"""Weight algorithms (``Target.WEIGHT``): communicate the parameters themselves.

* ``Phase.BEFORE_FORWARD`` (Decentralized): at forward, each bucket's weights
  are copied into a flat buffer and the exchange starts on the communication
  thread, overlapping forward and backward; at the end of backward the
  averaged weights replace the parameters, and the optimizer then applies the
  gradient computed at the old ones.
* ``Phase.AFTER_STEP`` (LowPrecisionDecentralized, ModelAverage): after every
  ``optimizer.step()`` (a step post-hook), each bucket is exchanged and written back.
  The exchange also runs on the communication thread, so that the training
  thread's wait for it is bounded by wrap's ``timeout`` like every other wait.
  An algorithm with an ``exchange_lag`` (Streaming DiLoCo with
  ``fragment_sync_delay``) runs its local ``apply`` on the training thread and
  its ``exchange`` on a snapshot there, on process groups of its own
  (``TorchCommunicator.duplicate``), without waiting: the next forward,
  backward and step overlap it, and the next step's ``apply`` waits for it.

Gradients are not communicated: each rank steps with its local gradient.
The parameters are views of their bucket's flat buffer (``Bucket.flatten``
re-points ``p.data``), so after-step algorithms work on the weights in place
(ModelAverage copies nothing) and writing averaged weights back is one copy
per bucket.  Decentralized exchanges a snapshot, so the exchange never races
with forward and backward reading the parameters.

Streams (:class:`~.comm_thread.CommWorker`): the exchange runs on the engine's own
stream after an event recorded on the training stream when the weights (or the
snapshot) were final; the training stream waits for the exchange's stream
before anything reads the averaged weights (at the end of backward before the
write-back, after the step before the next forward).  The snapshot, made on
the training stream and exchanged on the other, is marked for it
(``record_stream``) so its memory is not reused while the exchange runs.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence

import torch

from ...algorithms.base import Algorithm, Phase, Target, initial_state
from ...core.bucket import Bucket
from ...core.comm import ReduceOp
from ...core.errors import BaguaXError
from .. import streams
from ..checks import check_finite, non_finite_tensors
from ..communicator import TorchCommunicator
from .backward import BackwardHooks
from .base import BucketedEngine
from .interface import EngineOptions
from .registration import build_buckets, keep_state_for, register_parameters

__all__ = ["WeightEngine"]

log = logging.getLogger(__name__)


class WeightEngine(BucketedEngine):
    """Runs a weight algorithm before forward (finished after backward) or after each optimizer step."""

    tensor_kind = "weights"

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], algorithm: Algorithm,
                 comm: TorchCommunicator, *, options: EngineOptions):
        assert algorithm.target is Target.WEIGHT
        optimizer = options.optimizer
        tensors = register_parameters(named_params, Target.WEIGHT)
        super().__init__(tensors, algorithm, comm, options, "bagua_x-weight-comm")
        buckets = build_buckets(tensors, algorithm, comm.size, options.bucket_cap_mb, "weight_bucket_")
        with torch.no_grad():
            for b in buckets:
                b.flatten()
            self.slots = self._slots(buckets, [initial_state(algorithm, b.buffer, b.layout, comm.size)
                                               for b in buckets])
        self._in_flight: Optional[list[torch.Tensor]] = None
        self._hooks: Optional[BackwardHooks] = None
        self._step_hook = None
        self._exchange_comm: Optional[TorchCommunicator] = None
        self._replicas = options.replicas
        if algorithm.phase is Phase.BEFORE_FORWARD:
            self._hooks = BackwardHooks(tensors, self._hook, self._land, lambda: self._in_flight is not None)
        elif algorithm.phase is Phase.AFTER_STEP:
            if optimizer is None:
                raise BaguaXError(
                    f"{type(algorithm).__name__} communicates weights after each optimizer step, so wrap() needs "
                    "the optimizer: bagua_x.torch.wrap(model, optimizer, algorithm=...)"
                )
            # an exchange left in flight across steps gets groups of its own: the training thread's collectives
            # (buffer broadcasts, a node's gradient allreduce) go on meanwhile
            self._exchange_comm = comm.duplicate() if algorithm.exchange_lag else None
            self._step_hook = optimizer.register_step_post_hook(lambda *_: self.after_step())
        else:
            raise BaguaXError(
                f"{type(algorithm).__name__}: weight algorithms at phase {algorithm.phase} are not supported"
            )
        log.info("bagua_x: %s on %d weight buckets %s", type(algorithm).__name__, len(self.buckets), self.buckets)

    # -- before forward -------------------------------------------------------------------
    def settle(self) -> None:
        """Before a forward: land an exchange still in flight (a forward without backward since it started);
        raise a timeout the communication thread found since."""
        self._land()
        self._worker.check()

    def before_forward(self) -> None:
        if self._hooks is None:
            return
        self._land()
        if not (self.enabled and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            flats = [self._weights(s.bucket).clone() for s in self.slots]
        for slot, flat in zip(self.slots, flats):
            streams.keep_for(flat, self._worker.stream)
            self._submit(slot, flat)
        self._in_flight = flats

    def after_forward(self, outputs) -> None:
        if self._hooks is not None:
            self._hooks.watch(outputs)

    def _hook(self, _i: int, _param: torch.Tensor) -> None:
        """A parameter's gradient hook: the exchange in flight lands at the end of this backward."""
        if self._in_flight is not None:
            self._hooks.arm()

    def _land(self) -> None:
        """Write the exchange in flight (if any) into the parameters, once the training stream waited for it."""
        if self._in_flight is None:
            return
        flats, self._in_flight = self._in_flight, None
        self._worker.wait()  # and the training stream waits for the exchange before the write-back reads it
        with torch.no_grad():
            for b, flat in zip(self.buckets, flats):
                self._weights(b).copy_(flat)
        self.synced_steps += 1

    # -- after step -----------------------------------------------------------------------
    def after_step(self) -> None:
        if not self.enabled:
            return
        if self._exchange_comm is not None:
            self._apply_then_exchange()
            return
        replicas = self._replicas
        crossing = replicas is not None and any(self.algorithm.communicates(s.state) for s in self.slots)
        if crossing:
            replicas.begin()  # a node that is behind heals here, before it sends anything
            with torch.no_grad():
                kept = [(self._weights(s.bucket).clone(), s.state) for s in self.slots]
        for slot in self.slots:
            self._submit(slot, self._weights(slot.bucket))  # _weights on this thread: it may re-point replaced ones
        self._worker.wait()  # the next forward's kernels wait for the exchange
        if crossing and not replicas.commit():  # a member failed: as if this step had not exchanged (retried next)
            with torch.no_grad():
                for slot, (weights, state) in zip(self.slots, kept):
                    self._weights(slot.bucket).copy_(weights)
                    slot.state = state
        self.synced_steps += 1

    def _apply_then_exchange(self) -> None:
        """An algorithm with an ``exchange_lag``: the exchange launched at the previous step lands in the state,
        ``apply`` runs here, and this step's ``exchange`` runs on a snapshot on the communication thread while
        training goes on (see ``Algorithm.exchange_lag``)."""
        self._worker.wait()
        for slot in self.slots:
            weights = self._weights(slot.bucket)
            with torch.no_grad():
                out, state = self.algorithm.apply(weights, slot.bucket.layout, slot.state, self.comm)
                slot.state = keep_state_for(state, self._worker.stream)  # made here, read by the exchange there
                if out is not weights:
                    weights.copy_(out)
                snapshot = weights.clone()
            streams.keep_for(snapshot, self._worker.stream)
            self._worker.submit(slot.job, functools.partial(self._exchange, slot, snapshot), slot.bucket)
        self.synced_steps += 1

    def _exchange(self, slot, snapshot: torch.Tensor) -> None:
        """On the communication thread; ``check_finite`` checks the weights after ``apply`` (the snapshot), as
        the other after-step algorithms' are after ``reduce``."""
        local_bad = non_finite_tensors(slot.bucket, snapshot) if self.check_finite else []
        slot.state = self.algorithm.exchange(snapshot, slot.bucket.layout, slot.state, self._exchange_comm)
        if self.check_finite:
            check_finite(slot.bucket, snapshot, local_bad, self.tensor_kind, self._exchange_comm)

    def state_dict(self) -> dict:
        self._worker.wait()  # an exchange in flight belongs to the state
        return super().state_dict()

    def load_state_dict(self, saved: dict) -> None:
        self._worker.wait()  # or it would land over the loaded state
        super().load_state_dict(saved)

    def restart_state(self) -> None:
        """Every bucket's weights become the ranks' average and its state starts afresh from them, as at set-up
        (the algorithm changed form: see ``Algorithm.state_follows_form``; collective, between steps)."""
        with torch.no_grad():
            for slot in self.slots:
                weights = self._weights(slot.bucket)
                weights.copy_(self.comm.allreduce(weights.clone(), ReduceOp.AVG))
                fresh = initial_state(self.algorithm, weights, slot.bucket.layout, self.comm.size)
                slot.state = keep_state_for(fresh, self._worker.stream)

    @staticmethod
    def _weights(bucket: Bucket) -> torch.Tensor:
        """The bucket's flat weights, after moving back any parameter re-pointed since (``p.data = t``)."""
        bucket.ensure_flattened()
        return bucket.buffer

    def close(self) -> None:
        try:
            self._land()  # an exchange in flight lands in the parameters (or raises why it cannot)
        finally:
            if self._hooks is not None:
                self._hooks.remove()
            super().close()
            if self._step_hook is not None:
                self._step_hook.remove()
