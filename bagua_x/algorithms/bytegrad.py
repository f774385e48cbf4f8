"""ByteGrad: 8-bit compressed gradient allreduce (scatter-reduce then gather).

The bucket is split into one chunk per rank.  Each chunk is quantised
(MinMaxUInt8) and sent to its owner (alltoall); the owner dequantises and
reduces its chunk, re-quantises it with fresh min/max and everyone gathers all
chunks (allgather).  Every rank dequantises the same bytes, its own chunk
included, so all ranks end bitwise identical.  Bytes on the wire per rank are
about 2 x numel (vs 8 x numel for a float32 ring allreduce).
"""

from __future__ import annotations

import dataclasses

from .base import Algorithm, compressed_bytes, namespace
from .compression import compress_rows, decompress_rows, reduce_requantize

__all__ = ["ByteGrad", "compressed_allreduce"]


def compressed_allreduce(flat, comm, average: bool = True):
    """The ByteGrad exchange on a flat float array whose length is a multiple of ``comm.size``."""
    xp = namespace(flat)
    n = comm.size
    chunks = xp.reshape(flat, (n, -1))
    q, mm = compress_rows(chunks)
    q, mm = reduce_requantize(comm.alltoall(q), comm.alltoall(mm), average)
    gathered = decompress_rows(comm.allgather(q[0, :]), comm.allgather(mm[0, :]))
    return xp.astype(xp.reshape(gathered, (-1,)), flat.dtype)


@dataclasses.dataclass(frozen=True)
class ByteGrad(Algorithm):
    average: bool = True

    def alignment(self, world_size):
        return world_size

    def wire_bytes(self, numel, itemsize, world_size):
        return compressed_bytes(numel, world_size)

    def reduce(self, flat, state, comm):
        return compressed_allreduce(flat, comm, self.average), state
