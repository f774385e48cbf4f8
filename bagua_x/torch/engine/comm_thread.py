"""The communication thread of every torch engine and of the DDP comm hook, and the job most of them run on
it: a bucket reduced in place by its algorithm.

A gradient goes from its hook (``GradientEngine._hook``, :mod:`.gradient`) to
the collective through :meth:`CommWorker.submit` here, then on the thread
:meth:`CommWorker._run` -> :meth:`CommWorker._execute` -> :func:`reduce_in_place`
-> ``algorithm.reduce`` -> the communicator: 7 frames over 4 files
(``benchmarks/control_path.py`` prints them).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Callable, NamedTuple, Optional

import torch

from ...algorithms.base import Algorithm
from ...core.bucket import Bucket, BucketLayout
from ...core.errors import BaguaXError
from .. import streams
from ..checks import check_finite, non_finite_tensors
from ..communicator import TorchCommunicator
from ..stall import StallInspector

__all__ = ["BucketSlot", "CommWorker", "join_at_exit", "reduce_in_place"]

log = logging.getLogger(__name__)

RUN_AHEAD_POLL = 0.0005  # seconds between polls while the host is a step ahead of the device's communication
JOIN_S = 5.0  # seconds a close, and the exit of the interpreter, wait for communication threads (in all, at exit)

_to_join: dict = {}  # live thread -> how to stop it: what the interpreter's exit stops and joins


def join_at_exit(thread: threading.Thread, stop: Callable[[], None]) -> None:
    """At interpreter exit, ``stop()`` ``thread`` and join it (:data:`JOIN_S` for all threads together), unless
    it ended before: threads are daemons (a stuck collective must not keep the process alive), but a daemon
    still inside NCCL or gloo while the interpreter finalises can abort the process."""
    for ended in [t for t in _to_join if not t.is_alive()]:
        del _to_join[ended]
    _to_join[thread] = stop


def _join_all() -> None:
    deadline = time.monotonic() + JOIN_S
    for thread, stop in list(_to_join.items()):
        if thread.is_alive():
            stop()
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("bagua_x: thread %s still running at exit (stuck in a collective?)", thread.name)


atexit.register(_join_all)


@dataclasses.dataclass
class BucketSlot:
    """A bucket's layout, its algorithm state (replaced by each reduction), the name of its job on the
    communication thread (in reports), and the engine's bucket (None for a DDP bucket of the comm hook)."""

    layout: BucketLayout
    state: NamedTuple
    job: str
    bucket: Optional[Bucket] = None


def reduce_in_place(algorithm: Algorithm, flat: torch.Tensor, slot: BucketSlot, comm: TorchCommunicator,
                    finite: Optional[str] = None) -> None:
    """``flat <- reduce(flat)``, in place, then ``slot.state`` replaced: the one call site of the algorithm
    interface in the torch frontend (engines and the comm hook).  ``finite``, what the bucket holds
    ("gradient"...): raise naming its tensors when a reduced value is NaN or infinite on any rank, on every
    rank alike (wrap's ``check_finite``; collective, so every rank passes ``finite`` or none)."""
    local_bad = non_finite_tensors(slot.bucket, flat) if finite else []
    if algorithm.donates_input:
        with comm.donate(flat):
            out, state = algorithm.reduce(flat, slot.layout, slot.state, comm)
    else:
        out, state = algorithm.reduce(flat, slot.layout, slot.state, comm)
    if out is not flat:
        flat.copy_(out)
    if finite:
        check_finite(slot.bucket, flat, local_bad, finite, comm)
    slot.state = state  # once the reduction and its check passed: a failed one leaves the state as it was


class CommWorker:
    """One background thread that runs communication jobs in submission order, on a CUDA stream of its own.

    A single thread keeps collectives in the same order on every rank (the
    order the main thread submits them in, which core.readiness fixes) while
    letting them overlap with backward on the main thread.

    Streams (:mod:`.streams`, as DDP's reducer): :meth:`submit` records an
    event on the caller's current stream, the one that produced the bucket's
    values; the thread makes its side stream (``stream``) wait for that event
    and runs the job with the side stream current, so a collective never reads
    a bucket before the kernels writing it, nor queues in front of the compute
    stream.  :meth:`wait` returns once every job has been *launched* and makes
    the caller's current stream wait for the side stream: no host sync.  On
    the CPU a launched job is a finished one.

    Bounds, ``timeout`` seconds per job: a job that blocks the thread (gloo's
    wait, a collective stuck in C++) cannot be interrupted, but :meth:`wait`
    gives up once the job running has run ``timeout`` seconds (counted from the
    later of its submission and the previous job's end, so on a slow link a
    wait for many buckets that each finish in time never raises) with a
    BaguaXError naming the bucket and, from the :class:`StallInspector`, the
    ranks that had not marked it ready.  A job
    whose collective runs on after it returns (NCCL) is followed by an event
    on the side stream with a deadline (launch + ``timeout``); the thread
    polls the oldest such event while idle (``event.query()``, no blocking)
    and a missed deadline breaks the worker with the same report, raised on
    the training thread at its next :meth:`wait` or :meth:`check`.  A broken
    worker stays broken: every later ``wait`` raises at once.

    Run-ahead, on CUDA: the host queues work without waiting for the device, so
    behind a collective that never finishes a training loop would go on queueing
    until a CUDA launch blocks, in C, where nothing can raise.  So :meth:`wait`
    lets the host be at most one wait ahead of the side stream: it returns once
    the previous wait's communication has finished on the device (polling, no
    host sync), or raises the report when the thread finds that past its
    deadline.  A host more than one step ahead leaves the GPU a step of queued
    work, so this costs no GPU time; on the CPU, work is finished when launched.
    """

    def __init__(self, name: str, device: torch.device, timeout: Optional[float] = None,
                 inspector: Optional[StallInspector] = None):
        self._device = device
        self._timeout = timeout
        self._inspector = inspector
        self.stream = streams.side(device, name)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._done = threading.Condition()
        self._error: Optional[BaseException] = None
        self._stuck: Optional[BaguaXError] = None
        self._current: tuple[str, Optional[Bucket]] = ("", None)
        self._since = 0.0  # when the thread's next (or running) job could start: its clock for wait()'s timeout
        # (deadline, event after the job, its label, bucket) of launched jobs whose work may still run, oldest first
        self._running: collections.deque = collections.deque()
        self._poll = None if timeout is None else min(0.05, timeout / 20)
        self._previous_wait = None  # an event after the communication the last wait() handed over
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        join_at_exit(self._thread, functools.partial(self._jobs.put, None))

    def submit(self, label: str, job: Callable[[], None], bucket: Optional[Bucket] = None,
               skipped: Optional[Callable[[BaguaXError], None]] = None) -> None:
        """Queue ``job`` (``label`` names it in errors), to start after the work queued so far on the caller's
        current stream; ``bucket`` (if any) is what a stall report names.  A job the thread skips (after a failure or a
        missed deadline) is handed to ``skipped`` with the error instead, so a caller waiting on it
        (a DDP future) hears why."""
        ready = streams.record(streams.current(self._device))
        with self._done:
            if self._pending == 0:  # else its clock starts when the job before it ends
                self._since = time.monotonic()
            self._pending += 1
        self._jobs.put((label, job, bucket, ready, skipped))

    def _run(self) -> None:
        streams.set_device(self._device)  # the current CUDA device is per thread
        torch.set_grad_enabled(False)  # so is grad mode: jobs communicate values, never record a graph
        with streams.use(self.stream):
            while True:
                try:
                    item = self._jobs.get(timeout=self._poll if self._running else None)
                except queue.Empty:
                    self._check_deadline()
                    continue
                if item is None:
                    return
                try:
                    self._execute(*item)
                finally:
                    # the job (a closure over its bucket's buffer) is dropped before the training thread hears
                    # it is done: a bucket rebuild right after the wait frees the old buffer, not one job later
                    item = None
                    with self._done:
                        self._pending -= 1
                        self._since = time.monotonic()
                        self._done.notify_all()
                self._check_deadline()

    def _execute(self, label: str, job: Callable[[], None], bucket: Optional[Bucket], ready,
                 skipped: Optional[Callable[[BaguaXError], None]]) -> None:
        self._current = (label, bucket)
        try:
            broken = self._error or self._stuck
            if broken is not None and skipped is not None:
                skipped(broken)
            elif broken is None:  # after a failure, skip the rest of the step here
                if bucket is not None and self._inspector is not None:
                    self._inspector.launched(bucket)
                launched = time.monotonic()
                streams.wait(self.stream, ready)
                job()
                finished = streams.record(self.stream)
                if self._timeout is not None:
                    self._running.append((launched + self._timeout, finished, label, bucket))
        except BaseException as e:  # noqa: BLE001 -- re-raised on the main thread by wait()
            # a BaguaXError is a check that failed (it names the tensor); anything else is communication
            report = "" if isinstance(e, BaguaXError) else self._report(bucket)
            self._error = BaguaXError(f"{label} failed on the communication thread: {type(e).__name__}: {e}{report}")
            self._error.__cause__ = e

    def _check_deadline(self) -> None:
        """Drop finished jobs; the oldest unfinished one past its deadline breaks the worker."""
        while self._running and streams.done(self._running[0][1]):
            self._running.popleft()
        if self._running and time.monotonic() > self._running[0][0]:
            _, _, label, bucket = self._running[0]
            self._running.clear()
            self._stuck = self._timed_out(label, bucket, "Its collective is still running on the device")
            log.error("bagua_x: %s", self._stuck)  # seen even if the training thread is blocked on the device

    def _report(self, bucket: Optional[Bucket], stuck: bool = False) -> str:
        return self._inspector.report(bucket, stuck) if self._inspector is not None else ""

    def _timed_out(self, label: str, bucket: Optional[Bucket], where: str) -> BaguaXError:
        return BaguaXError(
            f"{label} did not complete within {self._timeout:g} s (the timeout of wrap() or CommHookState)"
            f"{self._report(bucket, True)}. "
            f"{where}, so this process group cannot be used any more: exit and restart from a "
            "checkpoint (torchrun --max-restarts restarts all ranks)"
        )

    def check(self) -> None:
        """Raise the timeout the thread found, if any (a job past its deadline)."""
        if self._stuck is not None:
            raise self._stuck

    def wait(self) -> None:
        """Block until every submitted job was launched (raising once one job takes over ``timeout`` seconds),
        then make the caller's current stream wait for them; re-raise the first failure here."""
        self.check()
        with self._done:
            while self._pending and (self._timeout is None or time.monotonic() < self._since + self._timeout):
                self._done.wait(None if self._timeout is None else self._since + self._timeout - time.monotonic())
            launched = self._pending == 0
            error, self._error = (self._error, None) if launched else (None, self._error)
        if not launched:
            label, bucket = self._current
            self._stuck = self._timed_out(label, bucket, "The communication thread is still blocked in the collective")
            raise self._stuck
        streams.wait_stream(streams.current(self._device), self.stream)
        self.run_ahead()
        if error is not None:
            raise error

    def run_ahead(self) -> None:
        """The host stays at most one call ahead of the side stream (polling, no host sync), raising the report
        once the thread finds a job past its deadline: at the end of :meth:`wait`, and at the start of each step
        for a caller that never waits (the DDP comm hook, whose futures order the caller's stream)."""
        self.check()
        previous, self._previous_wait = self._previous_wait, streams.mark(self.stream)
        while not streams.done(previous):  # bounded: the thread breaks the worker at the job's deadline
            self.check()
            time.sleep(RUN_AHEAD_POLL)

    def close(self, timeout: float = JOIN_S) -> None:
        """Stop the thread once the jobs queued so far have run, and wait for that (at most ``timeout`` s:
        a thread stuck in a collective is left, a daemon, with a warning)."""
        self._jobs.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("bagua_x: %s still running %s after close (stuck in a collective?)", self._thread.name,
                        self._current[0])
        else:
            _to_join.pop(self._thread, None)
