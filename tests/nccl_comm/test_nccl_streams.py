"""bagua_x.nccl.streams: CUDA stream handles and the DLPack stream value (no GPU needed)."""

from __future__ import annotations

import pytest

from bagua_x.core import BaguaXError
from bagua_x.nccl import streams as N


def test_stream_handles():
    class Proto:
        def __cuda_stream__(self):
            return (0, 1234)

    class TorchLike:
        cuda_stream = 99

    assert N.stream_handle(None) == 0
    assert N.stream_handle(7) == 7
    assert N.stream_handle(Proto()) == 1234
    assert N.stream_handle(TorchLike()) == 99
    with pytest.raises(BaguaXError):
        N.stream_handle(True)
    with pytest.raises(BaguaXError, match="cuda_stream"):
        N.stream_handle(object())
    assert N.dlpack_stream(0) == 1 and N.dlpack_stream(1234) == 1234


def test_consumer_stream_values():
    """DLPack's ``stream`` as a consumer names it: -1 no sync; None and 1 the legacy default stream."""
    assert N.consumer_stream(-1) is None
    assert N.consumer_stream(None) == 0 and N.consumer_stream(1) == 0
    assert N.consumer_stream(2) == 2 and N.consumer_stream(1234) == 1234


class _Event:
    def __init__(self, log, n):
        self.log, self.n, self.is_done = log, n, False

    def sync(self):
        self.log.append(("host sync", self.n))


class _Stream:
    """A CUDA stream stand-in that logs what is queued on it."""

    def __init__(self, log, handle):
        self.log, self.handle, self.events = log, handle, []

    def record(self):
        self.events.append(_Event(self.log, len(self.events)))
        self.log.append(("record", self.handle, self.events[-1].n))
        return self.events[-1]

    def wait(self, event):
        self.log.append(("wait", self.handle, event.n))


class _Array:
    """A framework array stand-in: ``__dlpack__`` logs the consumer's stream (as torch would compare it with
    its own current stream)."""

    def __init__(self, log):
        self.log = log

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, *, stream=None, **kwargs):
        self.log.append(("export", stream))
        return "capsule"


def _comm(log):
    from collections import deque

    from bagua_x.nccl import communicator as C

    comm = object.__new__(C.NcclCommunicator)  # no GPU here: only the stream bookkeeping runs
    comm._cstream = _Stream(log, "nccl")
    comm._stream_at = lambda handle: _Stream(log, handle)
    comm._in_flight = deque()
    comm._size = 2
    return comm, C


def test_results_reach_the_consumer_stream_after_nccl_and_inputs_live_until_it_is_done():
    """Each result is handed over through DLPack once the consumer's stream (torch's current one, 77 here) waits
    for an event recorded on NCCL's stream after the collective, before the division of an average; the input
    and output stay referenced until that event is done, then are let go."""
    log = []
    comm, C = _comm(log)
    x, arr = object(), _Array(log)

    class FromDlpack:  # what xp.from_dlpack does with a CUDA producer: pass its current stream, 77
        def __init__(self, producer):
            self.capsule = producer.__dlpack__(stream=77)

        def __truediv__(self, n):
            log.append(("divide", n))
            return self

    out = C._Output(0, lambda done: FromDlpack(C._AfterEvent(arr, done, comm._stream_at)))
    comm._result(x, out, "div")
    assert log == [("record", "nccl", 0), ("wait", 77, 0), ("export", 77), ("divide", 2)]
    assert [(e.n, kept_x) for e, kept_x, _ in comm._in_flight] == [(0, x)]
    comm._in_flight[0][0].is_done = True
    comm._result(object(), C._Output(0, lambda done: None))  # the next collective lets the finished one go
    assert [e.n for e, _, _ in comm._in_flight] == [1]


def test_no_sync_requested_means_no_wait():
    log = []
    comm, C = _comm(log)
    C._AfterEvent(_Array(log), _Event(log, 0), comm._stream_at).__dlpack__(stream=-1)
    assert log == [("export", -1)]
