"""Runtime pieces shared by the torch engines: the communication thread and backward hooks."""

from __future__ import annotations

import functools
import queue
import threading
from typing import Callable, Optional, Sequence

import torch
from torch.utils._pytree import tree_leaves

from ..core.bucket import Bucket
from ..core.errors import BaguaXError
from ..core.tensor import RegisteredTensor
from .stall import StallInspector

__all__ = ["CommWorker", "BackwardHooks"]


class CommWorker:
    """One background thread that runs communication jobs in submission order.

    A single thread keeps collectives in the same order on every rank (the
    order the main thread submits them in, which BucketDispatcher fixes) while
    letting them overlap with backward on the main thread.

    ``wait`` is bounded by ``timeout`` seconds: a collective stuck in C++
    (a peer died or stopped communicating) cannot be interrupted, but the
    caller gets a BaguaXError naming the bucket and, from the
    :class:`StallInspector`, the ranks that had not marked it ready.  After a
    timeout the worker stays broken: every later ``wait`` raises at once.
    """

    def __init__(self, name: str, device: Optional[torch.device] = None, timeout: Optional[float] = None,
                 inspector: Optional[StallInspector] = None):
        self._device = device
        self._timeout = timeout
        self._inspector = inspector
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._done = threading.Condition()
        self._error: Optional[BaseException] = None
        self._stuck: Optional[BaguaXError] = None
        self._current: tuple[str, Optional[Bucket]] = ("", None)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, what: str, job: Callable[[], None], bucket: Optional[Bucket] = None) -> None:
        """Queue ``job``; ``bucket`` (if any) is what a stall report names."""
        with self._done:
            self._pending += 1
        self._jobs.put((what, job, bucket))

    def _run(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the current CUDA device is per thread
        while True:
            item = self._jobs.get()
            if item is None:
                return
            what, job, bucket = item
            self._current = (what, bucket)
            try:
                if self._error is None:  # after a failure, skip the rest of the step on this rank
                    if bucket is not None and self._inspector is not None:
                        self._inspector.launched(bucket)
                    job()
            except BaseException as e:  # noqa: BLE001 -- re-raised on the main thread by wait()
                # a BaguaXError is a check that failed (it names the tensor); anything else is communication
                report = "" if isinstance(e, BaguaXError) else self._report(bucket)
                self._error = BaguaXError(f"{what} failed on the communication thread: {type(e).__name__}: {e}{report}")
                self._error.__cause__ = e
            finally:
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def _report(self, bucket: Optional[Bucket], stuck: bool = False) -> str:
        return self._inspector.report(bucket, stuck) if self._inspector is not None else ""

    def wait(self) -> None:
        """Block until every submitted job ran, at most ``timeout`` seconds; re-raise the first failure here."""
        if self._stuck is not None:
            raise self._stuck
        with self._done:
            finished = self._done.wait_for(lambda: self._pending == 0, self._timeout)
            error, self._error = (self._error, None) if finished else (None, self._error)
        if not finished:
            what, bucket = self._current
            self._stuck = BaguaXError(
                f"{what} did not complete within {self._timeout:g} s (wrap(timeout=...)){self._report(bucket, True)}. "
                "The communication thread is still blocked in the collective, so this process group cannot be "
                "used any more: exit and restart from a checkpoint (torchrun --max-restarts restarts all ranks)"
            )
            raise self._stuck
        if error is not None:
            raise error

    def close(self) -> None:
        self._jobs.put(None)


class BackwardHooks:
    """``on_ready(t)`` from each parameter's post-accumulate-grad hook, then ``on_end()`` once per backward.

    ``on_end`` runs after the whole backward, before ``loss.backward()``
    returns: it is queued on the autograd engine's graph task when backward
    reaches the forward's outputs (:meth:`watch`), or else at the first hook.
    The outputs come first because a hook may fire inside a nested backward
    (reentrant activation checkpointing), whose end is not the end of
    backward.  It runs only if a hook fired (a backward that reaches the
    outputs but no parameter, e.g. a gradient of the input, is not a step).
    ``active()`` is checked at each hook: inside ``no_sync()`` nothing happens.
    """

    def __init__(self, tensors: Sequence[RegisteredTensor], on_ready: Callable[[RegisteredTensor], None],
                 on_end: Callable[[], None], active: Callable[[], bool]):
        self._on_ready, self._on_end, self._active = on_ready, on_end, active
        self.queued = False
        self._fired = False
        self._handles = [
            t.proxy.register_post_accumulate_grad_hook(functools.partial(self._hook, t)) for t in tensors
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

    def _hook(self, tensor: RegisteredTensor, _param) -> None:
        if not self._active():
            return
        self._queue_end()
        self._fired = True
        self._on_ready(tensor)

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
