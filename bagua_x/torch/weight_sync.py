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

Gradients are not communicated: each rank steps with its local gradient.
The parameters are views of their bucket's flat buffer (``Bucket.flatten``
re-points ``p.data``), so after-step algorithms work on the weights in place
(ModelAverage copies nothing) and writing averaged weights back is one copy
per bucket.  Decentralized exchanges a snapshot, so the exchange never races
with forward and backward reading the parameters.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from ..algorithms.base import Algorithm, Phase, Target
from ..core.bucket import Bucket
from ..core.errors import BaguaXError
from .buckets import build_buckets, load_states, register_parameters, state_dict_of
from .communicator import TorchCommunicator
from .engine import EngineOptions
from .grad_sync import reduce_bucket
from .runtime import BackwardHooks, CommWorker
from .stall import StallInspector

__all__ = ["WeightEngine"]

log = logging.getLogger(__name__)


class WeightEngine:
    """Runs a weight algorithm before forward (finished after backward) or after each optimizer step."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], algorithm: Algorithm,
                 comm: TorchCommunicator, *, options: EngineOptions):
        assert algorithm.target is Target.WEIGHT
        self.algorithm, self.comm, self.check_finite = algorithm, comm, options.check_finite
        optimizer = options.optimizer
        tensors = register_parameters(named_params, Target.WEIGHT)
        self.buckets: list[Bucket] = build_buckets(tensors, algorithm, comm.size, options.bucket_cap_mb,
                                                   "weight_bucket_")
        with torch.no_grad():
            for b in self.buckets:
                b.flatten()
            self.states = [algorithm.init(b.buffer, b.layout, comm.size) for b in self.buckets]
        self.enabled = True  # False inside no_sync()
        self._in_flight: Optional[list[torch.Tensor]] = None
        self._hooks: Optional[BackwardHooks] = None
        self._step_hook = None
        self._worker = CommWorker("bagua_x-weight-comm", tensors[0].proxy.device, comm.timeout,
                                  StallInspector(comm.group))
        if algorithm.phase is Phase.BEFORE_FORWARD:
            self._hooks = BackwardHooks(tensors, lambda t: None, self._finish, lambda: self._in_flight is not None)
        elif algorithm.phase is Phase.AFTER_STEP:
            if optimizer is None:
                raise BaguaXError(
                    f"{type(algorithm).__name__} communicates weights after each optimizer step, so wrap() needs "
                    "the optimizer: bagua_x.torch.wrap(model, optimizer, algorithm=...)"
                )
            self._step_hook = optimizer.register_step_post_hook(lambda *_: self.after_step())
        else:
            raise BaguaXError(
                f"{type(algorithm).__name__}: weight algorithms at phase {algorithm.phase} are not supported"
            )
        log.info("bagua_x: %s on %d weight buckets %s", type(algorithm).__name__, len(self.buckets), self.buckets)

    # -- before forward -------------------------------------------------------------------
    def settle(self) -> None:
        """Before a forward: land an exchange still in flight (a forward without backward since it started)."""
        self._finish()

    def before_forward(self) -> None:
        if self._hooks is None:
            return
        self._finish()
        if not (self.enabled and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            flats = [self._weights(b).clone() for b in self.buckets]
        for i, (b, flat) in enumerate(zip(self.buckets, flats)):
            self._worker.submit(f"{type(self.algorithm).__name__} on {b.name}",
                                lambda i=i, flat=flat: self._reduce(i, flat), b)
        self._in_flight = flats

    def _reduce(self, i: int, flat: torch.Tensor) -> None:
        with torch.no_grad():
            self.states[i] = reduce_bucket(self.algorithm, self.buckets[i], flat, self.states[i], self.comm,
                                           self.check_finite, "weights")

    def _finish(self) -> None:
        if self._in_flight is None:
            return
        flats, self._in_flight = self._in_flight, None
        self._worker.wait()
        with torch.no_grad():
            for b, flat in zip(self.buckets, flats):
                self._weights(b).copy_(flat)

    # -- after step -----------------------------------------------------------------------
    def after_step(self) -> None:
        if not self.enabled:
            return
        for i, b in enumerate(self.buckets):
            flat = self._weights(b)  # on this thread: it may re-point parameters the user replaced
            self._worker.submit(f"{type(self.algorithm).__name__} on {b.name}",
                                lambda i=i, flat=flat: self._reduce(i, flat), b)
        self._worker.wait()

    @staticmethod
    def _weights(bucket: Bucket) -> torch.Tensor:
        """The bucket's flat weights, after moving back any parameter re-pointed since (``p.data = t``)."""
        bucket.ensure_flattened()
        return bucket.buffer

    def state_dict(self) -> dict:
        return state_dict_of(self.buckets, self.states)

    def load_state_dict(self, saved: dict) -> None:
        load_states(self.buckets, self.states, saved)

    def close(self) -> None:
        try:
            self._finish()  # an exchange in flight lands in the parameters (or raises why it cannot)
        finally:
            if self._hooks is not None:
                self._hooks.remove()
            self._worker.close()
            if self._step_hook is not None:
                self._step_hook.remove()
