"""Runtime pieces shared by the torch engines: the communication thread and backward hooks."""

from __future__ import annotations

import functools
import queue
import threading
from typing import Callable, Optional, Sequence

import torch

from ..core.errors import BaguaXError
from ..core.tensor import RegisteredTensor

__all__ = ["CommWorker", "BackwardHooks"]


class CommWorker:
    """One background thread that runs communication jobs in submission order.

    A single thread keeps collectives in the same order on every rank (the
    order the main thread submits them in, which BucketDispatcher fixes) while
    letting them overlap with backward on the main thread.
    """

    def __init__(self, name: str, device: Optional[torch.device] = None):
        self._device = device
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._done = threading.Condition()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, what: str, job: Callable[[], None]) -> None:
        with self._done:
            self._pending += 1
        self._jobs.put((what, job))

    def _run(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the current CUDA device is per thread
        while True:
            item = self._jobs.get()
            if item is None:
                return
            what, job = item
            try:
                if self._error is None:  # after a failure, skip the rest of the step on this rank
                    job()
            except BaseException as e:  # noqa: BLE001 -- re-raised on the main thread by wait()
                self._error = BaguaXError(f"{what} failed on the communication thread: {type(e).__name__}: {e}")
                self._error.__cause__ = e
            finally:
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def wait(self) -> None:
        """Block until every submitted job ran; re-raise the first failure on this (the caller's) thread."""
        with self._done:
            self._done.wait_for(lambda: self._pending == 0)
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        self._jobs.put(None)


class BackwardHooks:
    """``on_ready(t)`` from each parameter's post-accumulate-grad hook, then ``on_end()`` once per backward.

    ``on_end`` is queued on the autograd engine at the first hook of a backward
    pass (as DDP does), so it runs after the whole backward, before
    ``loss.backward()`` returns.  ``active()`` is checked at each hook: inside
    ``no_sync()`` nothing happens.
    """

    def __init__(self, tensors: Sequence[RegisteredTensor], on_ready: Callable[[RegisteredTensor], None],
                 on_end: Callable[[], None], active: Callable[[], bool]):
        self._on_ready, self._on_end, self._active = on_ready, on_end, active
        self.queued = False
        self._handles = [
            t.proxy.register_post_accumulate_grad_hook(functools.partial(self._hook, t)) for t in tensors
        ]

    def _hook(self, tensor: RegisteredTensor, _param) -> None:
        if not self._active():
            return
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        self._on_ready(tensor)

    def _end(self) -> None:
        self.queued = False
        self._on_end()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
