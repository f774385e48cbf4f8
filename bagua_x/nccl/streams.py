"""CUDA stream handles as NCCL and the DLPack stream handshake want them.

A stream is given as a ``cudaStream_t`` (an int), an object with
``__cuda_stream__`` (the CUDA stream protocol) or ``cuda_stream``
(``torch.cuda.Stream``); ``None`` is the legacy default stream, 0.
"""

from __future__ import annotations

from typing import Optional

from bagua_x.core.errors import BaguaXError

__all__ = ["stream_handle", "dlpack_stream", "consumer_stream"]


def stream_handle(stream) -> int:
    """The ``cudaStream_t`` of ``stream`` as an int: an int, ``__cuda_stream__()`` or ``.cuda_stream``; None -> 0."""
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise BaguaXError("stream must be a CUDA stream handle or stream object, not a bool")
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        if isinstance(value, tuple):  # the CUDA stream protocol: (version, handle)
            value = value[1]
        return int(value)
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    if handle is not None:
        return int(handle)
    raise BaguaXError(
        f"cannot read a CUDA stream handle from {type(stream).__name__}; pass an int cudaStream_t or an object "
        "with __cuda_stream__ or cuda_stream (e.g. torch.cuda.current_stream())"
    )


def dlpack_stream(handle: int) -> int:
    """The value of ``__dlpack__(stream=...)`` naming ``handle``: DLPack spells the legacy default stream 1, not 0."""
    return 1 if handle == 0 else handle


def consumer_stream(value) -> Optional[int]:
    """The ``cudaStream_t`` a consumer named in ``__dlpack__(stream=value)``, or None for "no synchronization"
    (-1).  DLPack's CUDA values: None or 1 the legacy default stream (0), 2 the per-thread default stream
    (``cudaStreamPerThread``, also 2), any other the stream handle itself."""
    if value == -1:
        return None
    if value is None or value == 1:
        return 0
    return int(value)
