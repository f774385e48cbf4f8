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
