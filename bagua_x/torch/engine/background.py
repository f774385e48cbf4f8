"""AsyncModelAverage: weights averaged by a background thread while training goes on.

As in Bagua, the first ``warmup_steps`` steps are ordinary synchronous
gradient allreduce (a GradientEngine), so ranks start from a common point.
Every ``sync_interval_ms`` (once ``warmup_steps`` optimizer steps are done) a
thread on its own process group takes a snapshot ``s`` of the weights,
averages it with the algorithm's ``reduce`` and, under the weight lock, adds
``reduce(s) - s`` to the live weights -- keeping the local progress made
meanwhile.  The averaging is :class:`~bagua_x.algorithms.AsyncModelAverage`'s;
this schedule (thread, lock, stop flag) is the torch frontend's.  The training
thread holds the same lock from forward to the end of ``optimizer.step()``, so
a gradient is always computed and applied on one consistent set of weights.
Readers outside a step take it too (:meth:`AsyncAverageEngine.weights_locked`,
``DistributedModel.state_dict()`` and ``weights_locked()``), so they never see
half a round.

Each round starts with a tiny allreduce of a stop flag, so ``abort()`` on any
rank stops the threads of all ranks after the same round (no rank is left
waiting in a collective).  ``abort()`` and ``resume()`` are collective: call
them on every rank.

On CUDA the thread sets the model's device and runs on a stream of its own.
The weight lock orders the threads on the host; on the GPU each side, on
taking the lock, makes its stream wait for an event the other side recorded
when it let go (:mod:`..streams`), so a snapshot never reads weights the
optimizer's kernels are still writing and a forward never reads weights the
averaging kernels are still writing.  The stop flag lives on the weights'
device (an NCCL group has no CPU tensors).

Faults: the thread's collectives raise after wrap's ``timeout``; an error on
the thread is re-raised on the training thread at the next forward or
optimizer step (averaging silently stopping would leave ranks drifting apart),
and ``abort()`` waits for the thread at most ``timeout`` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Optional, Sequence

import torch

from ...algorithms.allreduce import GradientAllReduce
from ...algorithms.base import EmptyState, Target
from ...algorithms.model_average import AsyncModelAverage
from ...core.bucket import Bucket
from ...core.comm import ReduceOp
from ...core.errors import BaguaXError
from .. import streams
from ..communicator import TorchCommunicator
from ..distributed import private_group
from .comm_thread import join_at_exit
from .gradient import GradientEngine
from .interface import EngineOptions
from .registration import build_buckets, register_parameters

__all__ = ["AsyncAverageEngine"]

log = logging.getLogger(__name__)


class AsyncAverageEngine:
    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], algorithm: AsyncModelAverage,
                 comm: TorchCommunicator, *, options: EngineOptions):
        optimizer = options.optimizer
        if optimizer is None:
            raise BaguaXError(
                "AsyncModelAverage locks the weights during optimizer.step(), so wrap() needs the optimizer: "
                "bagua_x.torch.wrap(model, optimizer, algorithm=AsyncModelAverage(...))"
            )
        self.algorithm = algorithm
        # its own group, made from the wrapper's (its ranks and backend): never interleaves with others
        self.comm = TorchCommunicator(private_group(comm.group, comm.timeout), timeout=comm.timeout)
        tensors = register_parameters(named_params, Target.WEIGHT)
        self.buckets: list[Bucket] = build_buckets(tensors, algorithm, self.comm.size, options.bucket_cap_mb,
                                                   "weight_bucket_")
        self._warmup: Optional[GradientEngine] = None
        if algorithm.warmup_steps > 0:
            self._warmup = GradientEngine(named_params, GradientAllReduce(), comm, options=options)
        self._enabled = True
        self.steps = 0
        self.rounds = 0  # averaging rounds completed (for logs and tests)
        self._lock = threading.Lock()
        self._waiting = threading.Condition()  # the background thread asks for the lock: forward lets it in
        self._waiters = 0
        self._holding = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaguaXError] = None  # from the background thread, raised on the training thread
        self._device = named_params[0][1].device
        self._stream = streams.side(self._device, "async-average")
        self._released = {"training": None, "thread": None}  # each side's event when it last let go of the lock
        self._hooks = [optimizer.register_step_post_hook(lambda *_: self._after_step())]

    @property
    def enabled(self) -> bool:
        """False inside no_sync(): pauses the warm-up gradient allreduce (background averaging goes on)."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = value
        if self._warmup is not None:
            self._warmup.enabled = value

    # -- training thread --------------------------------------------------------------------
    def _raise_thread_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def settle(self) -> None:
        """Before a forward: the warm-up's gradient communication ends (averaging has a group of its own)."""
        if self._warmup is not None:
            self._warmup.settle()

    def after_forward(self, outputs) -> None:
        if self._warmup is not None:
            self._warmup.after_forward(outputs)

    def before_forward(self) -> None:
        self._raise_thread_error()
        if torch.is_grad_enabled() and not self._holding:
            with self._waiting:  # Lock is not fair: without this a tight training loop could starve averaging
                self._waiting.wait_for(lambda: self._waiters == 0)
            self._lock.acquire()
            self._holding = True
            streams.wait(streams.current(self._device), self._released["thread"])

    def _after_step(self) -> None:
        if self._holding:
            self._holding = False
            self._released["training"] = streams.record(streams.current(self._device))
            self._lock.release()
        self.steps += 1
        if self.steps >= self.algorithm.warmup_steps:
            if self._warmup is not None:
                self._warmup.close()
                self._warmup = None
            if self._thread is None and not self._stop.is_set():
                self._start()
        self._raise_thread_error()

    # -- background thread ------------------------------------------------------------------
    def _start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="bagua_x-async-average", daemon=True)
        self._thread.start()
        join_at_exit(self._thread, self._signal_stop)

    def _loop(self) -> None:
        interval = self.algorithm.sync_interval_ms / 1000
        try:
            streams.set_device(self._device)
            with streams.use(self._stream):
                while True:
                    time.sleep(interval)
                    flag = torch.tensor([1.0 if self._stop.is_set() else 0.0], device=self._device)
                    if self.comm.allreduce(flag, ReduceOp.MAX).item() > 0:  # this thread's stream only
                        return
                    self._average()
        except Exception as e:  # noqa: BLE001 -- re-raised on the training thread
            log.exception("bagua_x: asynchronous model averaging stopped after an error")
            self._error = BaguaXError(
                f"asynchronous model averaging (round {self.rounds + 1}, buckets {[b.name for b in self.buckets]}) "
                f"failed on its thread: {type(e).__name__}: {e}; a rank died or stopped averaging "
                "(call abort() on every rank before exiting)"
            )
            self._error.__cause__ = e

    def _average(self) -> None:
        with torch.no_grad():
            with self._locked():
                snapshots = [b.pack() for b in self.buckets]
            deltas = [self.algorithm.reduce(s, b.layout, EmptyState(), self.comm)[0] - s
                      for b, s in zip(self.buckets, snapshots)]
            with self._locked():
                for b, d in zip(self.buckets, deltas):
                    for t, part in zip(b.tensors, b.layout.unpack(d)):
                        t.proxy.add_(part.to(t.proxy.dtype))
        self.rounds += 1

    @contextlib.contextmanager
    def _locked(self):
        with self._waiting:
            self._waiters += 1
        try:
            with self._lock:
                streams.wait(self._stream, self._released["training"])
                try:
                    yield
                finally:
                    self._released["thread"] = streams.record(self._stream)
        finally:
            with self._waiting:
                self._waiters -= 1
                self._waiting.notify_all()

    # -- control ----------------------------------------------------------------------------
    def _signal_stop(self) -> None:
        """Ask the thread to stop after its round (the stop flag reaches every rank's thread in the next)."""
        self._stop.set()
        if self._holding:  # the thread may be waiting for the weights: let it see the stop flag
            self._holding = False
            self._released["training"] = streams.record(streams.current(self._device))
            self._lock.release()

    def abort(self) -> None:
        """Stop averaging on all ranks (collective: call it on every rank)."""
        self._signal_stop()
        if self._thread is not None:
            self._thread.join(self.comm.timeout)
            if self._thread.is_alive():
                raise BaguaXError(
                    f"abort(): the averaging thread did not stop within {self.comm.timeout:g} s; it is stuck in a "
                    "collective because another rank died or did not call abort(): exit and restart"
                )
            self._thread = None

    def resume(self) -> None:
        """Restart averaging after :meth:`abort` (collective: call it on every rank)."""
        self.abort()
        self._stop.clear()
        if self.steps >= self.algorithm.warmup_steps:
            self._start()

    @contextlib.contextmanager
    def weights_locked(self):
        """The weights as the last averaging round left them: the thread waits for the lock meanwhile (on CUDA
        the caller's stream waits for its last write, and its next round for the caller's reads).  Gives True
        while the thread runs: outside the block it writes them again, so keep copies, not the tensors."""
        if self._holding:  # between forward and optimizer.step(): the training thread holds the lock already
            yield self._thread is not None
            return
        with self._lock:
            streams.wait(streams.current(self._device), self._released["thread"])
            try:
                yield self._thread is not None
            finally:
                self._released["training"] = streams.record(streams.current(self._device))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, saved: dict) -> None:
        if saved:
            raise BaguaXError("AsyncModelAverage keeps no algorithm state; expected an empty state dict")

    def close(self) -> None:
        self.abort()
        if self._warmup is not None:
            self._warmup.close()
        for h in self._hooks:
            h.remove()
