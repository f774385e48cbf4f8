"""CUDA streams and events for the threads bagua_x runs, by CUDA's rules; on the CPU every call does nothing.

The rules (DDP's reducer follows the same ones):

* Each engine communicates on a stream of its own (:func:`side`), so its
  collectives, compression and the waits for them never queue in front of the
  kernels of the compute stream.
* Work handed from one stream to another goes through an event recorded on the
  producing stream after the work (:func:`record`) that the consuming stream
  waits for (:func:`wait`): ordering on the GPU, no host sync.
* Memory allocated on one stream and used on another is marked
  (:func:`keep_for`), so the caching allocator does not hand it out again
  before the other stream is done with it.
* A thread bagua_x starts first sets the device (:func:`set_device`): CUDA's
  current device is per thread, and defaults to GPU 0.
* A wait for communication never blocks the host: NCCL's ``wait()`` returns
  at once (it only orders the current stream), so a deadline is checked by
  polling an event recorded after the work (:func:`done`).  The training
  thread polls one too (:func:`mark`), to stay at most a step ahead of the
  communication, so a hang is reported before a launch blocks in C.
* A result handed to torch through a future (the DDP comm hook) goes in a
  CUDA-aware one (:func:`future`): completed while the producing stream is
  current, its consumers' streams wait for that stream's work.

Callers reach these functions through the module (``streams.record(...)``),
so a test can trace them by replacing the module's functions, on the CPU too
(``tests/torch/bx_stream_workers.py``): nothing here checks for a tracer.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch

__all__ = ["Stream", "current", "side", "record", "mark", "wait", "wait_stream", "use", "keep_for", "set_device", "done",
           "future"]


@dataclasses.dataclass(frozen=True)
class Stream:
    """A named stream; ``cuda`` is None on the CPU."""

    name: str
    cuda: Optional[Any] = None


def current(device: torch.device) -> Stream:
    """The calling thread's current stream on ``device`` (the compute stream, for the training thread)."""
    return Stream("current", torch.cuda.current_stream(device) if device.type == "cuda" else None)


def side(device: torch.device, name: str) -> Stream:
    """A new stream on ``device`` for one engine or thread."""
    return Stream(name, torch.cuda.Stream(device) if device.type == "cuda" else None)


def record(stream: Stream) -> Optional[Any]:
    """An event marking the work queued on ``stream`` so far (None on the CPU)."""
    return _event(stream)


def mark(stream: Stream) -> Optional[Any]:
    """:func:`record`, called by a thread that does not queue work on ``stream`` (traced as "mark"): the
    training thread marking how far the communication it waited for goes, to bound its run-ahead."""
    return _event(stream)


def _event(stream: Stream) -> Optional[Any]:
    if stream.cuda is None:
        return None
    event = torch.cuda.Event()
    event.record(stream.cuda)
    return event


def wait(stream: Stream, event: Optional[Any]) -> None:
    """Work queued on ``stream`` from now on starts after ``event`` (a no-op for None: nothing to wait for)."""
    if stream.cuda is not None and event is not None:
        stream.cuda.wait_event(event)


def wait_stream(stream: Stream, other: Stream) -> None:
    """Work queued on ``stream`` from now on starts after everything queued on ``other`` so far."""
    if stream.cuda is not None and other.cuda is not None:
        stream.cuda.wait_stream(other.cuda)


def use(stream: Stream):
    """Context in which kernels of the calling thread are queued on ``stream``."""
    return torch.cuda.stream(stream.cuda) if stream.cuda is not None else contextlib.nullcontext()


def keep_for(tensor: torch.Tensor, stream: Stream) -> None:
    """``tensor``'s memory is not reused before the work queued on ``stream`` up to its release is done
    (``record_stream``: marked once, where it is made, whichever thread drops it later)."""
    if stream.cuda is not None and tensor.is_cuda:
        tensor.record_stream(stream.cuda)


def set_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's CUDA device (at the start of every thread bagua_x starts)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def done(event: Optional[Any]) -> bool:
    """Whether the work before ``event`` has finished, without blocking (True on the CPU, whose work is
    finished when the call that queued it returns)."""
    return event is None or event.query()


def future(device: torch.device) -> torch.futures.Future:
    """A future for tensors on ``device``: on CUDA, ``set_result`` records an event on the setting thread's
    current stream and whoever waits for the future has their current stream wait for it."""
    return torch.futures.Future(devices=[device] if device.type == "cuda" else None)
