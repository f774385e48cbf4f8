"""ByteGrad: 8-bit compressed gradient allreduce (scatter-reduce then gather).

The bucket is split into one chunk per rank.  Each chunk is quantised
(MinMaxUInt8) and sent to its owner (alltoall); the owner dequantises and
reduces its chunk, re-quantises it with fresh min/max and everyone gathers all
chunks (allgather).  Every rank dequantises the same bytes, its own chunk
included, so all ranks end bitwise identical.  Bytes on the wire per rank are
about 2 x numel (vs 8 x numel for a float32 ring allreduce).

``hierarchical`` (Bagua's option; by default the faster form, timed, on >= 2 nodes of >= 2 ranks):
gradients are averaged in full precision inside each node and only the nodes
exchange 8-bit (:func:`compressed_average`); each of a node's L ranks
compresses its 1/L shard, so a chunk is 1/(L x nodes) of the bucket where
Bagua's leader compresses 1/nodes (the same bytes between nodes, finer min/max).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import array_api_compat
from array_api_compat import is_writeable_array

from ..core.comm import ReduceOp
from .base import Algorithm, NodeAware, compressed_bytes, namespace
from .compression import Codec, codec

__all__ = ["ByteGrad", "compressed_allreduce", "compressed_average"]


def compressed_allreduce(flat, comm, average: bool = True, out=None, bits: int = 8):
    """The ByteGrad exchange on a flat float array whose length is a multiple of ``comm.size``
    (times 2 for ``bits=4``, whose codes pack two a byte).

    ``out`` (writable, flat's shape and dtype; ``flat`` itself is allowed: it is
    not read after compression) receives the result and is returned.
    """
    forms = codec(bits)
    return _decompressed(_exchange(flat, comm, average, forms), flat, out, forms)


def compressed_average(flat, comm, average: bool, two_level: bool):
    """The ByteGrad exchange, flat or over nodes (the result written over ``flat`` where it is mutable).

    Over nodes this is :func:`~.base.over_nodes` with one saving: the node's
    ranks share their results still 8-bit (what every rank would decompress
    anyway), so the allgather inside the node moves a quarter of the bytes.
    """
    out = flat if is_writeable_array(flat) else None  # torch, numpy: in place; JAX: a new array
    if not two_level:
        return compressed_allreduce(flat, comm, average, out=out)
    xp = namespace(flat)
    within, across = comm.within, comm.across
    shard = within.reduce_scatter(xp.reshape(flat, (within.size, -1)), ReduceOp.AVG if average else ReduceOp.SUM)
    eight = codec(8)
    # buckets are aligned to the world size, so a shard splits into one chunk per node, unless the number of
    # nodes changes after the layout (fault-tolerant replica groups): then the shard is padded for this exchange
    width = shard.shape[0]
    pad = -width % across.size
    if pad:
        shard = xp.concat([shard, xp.zeros((pad,), dtype=shard.dtype, device=array_api_compat.device(shard))])
    packed = within.allgather(_exchange(shard, across, average, eight))  # (L, nodes, chunk + 8)
    packed = xp.reshape(packed, (-1, packed.shape[-1]))
    if not pad:
        return _decompressed(packed, flat, out, eight)
    result = xp.reshape(xp.reshape(_decompressed(packed, flat, None, eight), (within.size, -1))[:, :width], (-1,))
    if out is None:
        return result
    out[...] = result
    return out


def _exchange(flat, comm, average: bool, forms: Codec):
    """Compress, alltoall, reduce and re-compress each rank's chunk, allgather: (size, packed chunk) uint8."""
    xp = namespace(flat)
    mine = forms.reduce_requantize(comm.alltoall(forms.compress(xp.reshape(flat, (comm.size, -1)))), average)
    return comm.allgather(mine[0, :])


def _decompressed(packed, flat, out, forms: Codec):
    xp = namespace(flat)
    if out is not None:
        forms.decompress(packed, out=xp.reshape(out, (packed.shape[0], -1)))
        return out
    return xp.astype(xp.reshape(forms.decompress(packed), (-1,)), flat.dtype)


@dataclasses.dataclass(frozen=True)
class ByteGrad(NodeAware, Algorithm):
    """8-bit gradient allreduce: MinMaxUInt8 chunks, alltoall, reduce and re-quantise, allgather.

    Args:
        average: divide the sum by the number of ranks.
        hierarchical: over nodes (full precision inside each node, the flat algorithm between nodes;
            ``over_nodes``): ``None`` the faster form, timed at set-up, where there are >= 2 nodes of >= 2
            ranks, ``True`` required (refused where the frontend has no node groups), ``False`` flat.
    """

    average: bool = True
    hierarchical: Optional[bool] = None
    donates_input = True  # the result is written over the bucket where arrays are mutable
    uses_kernels = True
    elastic_nodes = True  # any number of nodes: what crosses them is an average (or a gather) over those there

    def alignment(self, world_size):
        return world_size

    def wire_bytes(self, layout, itemsize, world_size):
        return compressed_bytes(layout.padded_numel, world_size)

    def reduce(self, flat, layout, state, comm):
        return compressed_average(flat, comm, self.average, self.two_level(comm)), state
