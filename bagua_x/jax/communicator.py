"""The Communicator protocol on XLA collectives under a named axis.

Valid inside ``jax.pmap`` or ``jax.shard_map`` over ``axis_name``: every method
emits a ``jax.lax`` collective, which XLA lowers to NCCL on GPU and to gloo
across processes on CPU (``jax.distributed`` with gloo CPU collectives).  The
algorithms in :mod:`bagua_x.algorithms` run on it unchanged, on traced arrays.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Hashable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ..core.comm import Feature, ReduceOp
from ..core.errors import BaguaXError

__all__ = ["AxisCommunicator", "axis_size"]

log = logging.getLogger(__name__)

try:  # not yet exported by jax.lax (0.10); plain all_gather is the same collective, typed "varying"
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant
except ImportError:  # pragma: no cover - depends on the jax version
    _all_gather_invariant = lax.all_gather


def axis_size(axis_name: Hashable) -> int:
    """Size of the mapped axis ``axis_name``; a BaguaXError outside pmap/shard_map over it."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise BaguaXError(
            f"axis {axis_name!r} is not bound here: bagua_x.jax collectives (reduce_gradients, sync_params, "
            f"AxisCommunicator) must run inside jax.pmap(..., axis_name={axis_name!r}) or jax.shard_map over a "
            f"mesh axis named {axis_name!r}; call them from inside your pmapped/shard_mapped step"
        ) from e


class AxisCommunicator:
    """Collectives over the devices of a named mapped axis (one rank per device).

    ``local_size``: devices per node for :meth:`hierarchical_allreduce`, nodes
    being consecutive blocks of axis indices (default: ``jax.local_device_count()``
    times ``LOCAL_WORLD_SIZE``, the processes per node as torchrun sets it; 1
    when unset, JAX's usual one process per host).
    """

    def __init__(self, axis_name: Hashable = "batch", local_size: Optional[int] = None):
        self.axis_name = axis_name
        self._size = axis_size(axis_name)
        per_node = jax.local_device_count() * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.local_size = int(local_size or min(per_node, self._size))

    def __repr__(self) -> str:
        return f"AxisCommunicator({self.axis_name!r}, size={self._size})"

    @property
    def rank(self):
        return lax.axis_index(self.axis_name)

    @property
    def size(self) -> int:
        return self._size

    @property
    def features(self) -> frozenset[Feature]:
        """Always HIERARCHICAL: grouped collectives under pmap, one flat allreduce under shard_map."""
        return frozenset({Feature.HIERARCHICAL})

    def allreduce(self, x, op: ReduceOp = ReduceOp.SUM):
        if op is ReduceOp.SUM:
            return lax.psum(x, self.axis_name)
        if op is ReduceOp.AVG:
            return lax.pmean(x, self.axis_name)
        if op is ReduceOp.MIN:
            return lax.pmin(x, self.axis_name)
        if op is ReduceOp.MAX:
            return lax.pmax(x, self.axis_name)
        raise BaguaXError(f"unknown reduce op {op!r}; use a bagua_x.core.ReduceOp")

    def hierarchical_allreduce(self, x, op: ReduceOp = ReduceOp.SUM):
        """The allreduce in two levels: within each node, then across nodes.

        Under SPMD every device runs the same program, so instead of Bagua's
        leader (reduce to it, leaders allreduce, broadcast) each device of a node
        takes a share: reduce-scatter within the node, allreduce of its 1/L shard
        among the devices at the same place in the other nodes, allgather within
        the node.  The cross-node bytes are the leader scheme's, spread over every
        device's link.  Under ``shard_map`` JAX has no grouped ``psum`` (and grouped
        results would not count as replicated), so there this is one flat allreduce,
        with the same result; so are MIN/MAX, small checks rather than gradients.
        """
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            return self.allreduce(x, op)
        local, nodes = self.local_size, self._size // self.local_size
        if local < 1 or self._size % local:
            raise BaguaXError(
                f"hierarchical allreduce: axis {self.axis_name!r} of size {self._size} is not a multiple of "
                f"local_size={local} devices per node; use the same number of devices on every node"
            )
        within = [[n * local + i for i in range(local)] for n in range(nodes)]
        across = [[n * local + i for n in range(nodes)] for i in range(local)]
        flat = jnp.reshape(x, (-1,))
        padded = jnp.pad(flat, (0, -flat.shape[0] % local))
        shard = lax.psum_scatter(padded, self.axis_name, axis_index_groups=within, tiled=True)
        try:
            shard = lax.psum(shard, self.axis_name, axis_index_groups=across)
        except NotImplementedError:  # shard_map (the traced reduce-scatter above is dropped as unused)
            log.info("bagua_x: hierarchical allreduce on axis %r runs flat under shard_map", self.axis_name)
            return self.allreduce(x, op)
        full = lax.all_gather(shard, self.axis_name, axis_index_groups=within, tiled=True)
        out = jnp.reshape(full[:flat.shape[0]], x.shape)
        return out / self._size if op is ReduceOp.AVG else out

    def allgather(self, x):
        # The result is the same on every device; saying so (invariant) lets a shard_map
        # step return it with out_specs=P() under check_vma.
        return _all_gather_invariant(x, self.axis_name)

    def alltoall(self, x):
        self._check_rows(x, "alltoall")
        return lax.all_to_all(x, self.axis_name, split_axis=0, concat_axis=0)

    def reduce_scatter(self, x, op: ReduceOp = ReduceOp.SUM):
        self._check_rows(x, "reduce_scatter")
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            # XLA has no min/max reduce-scatter: reduce everything, keep our row.
            return self.allreduce(x, op)[self.rank]
        out = lax.psum_scatter(x, self.axis_name, scatter_dimension=0, tiled=False)
        return out / self._size if op is ReduceOp.AVG else out

    def broadcast(self, x, root: int = 0):
        """``root``'s ``x``: a masked psum (exact: the other ranks add zeros, never their NaNs)."""
        if not 0 <= root < self._size:
            raise BaguaXError(f"broadcast root {root} is outside axis {self.axis_name!r} of size {self._size}")
        dtype = x.dtype
        masked = jnp.where(self.rank == root, x, jnp.zeros_like(x))
        if dtype == jnp.bool_:
            return lax.psum(masked.astype(jnp.uint8), self.axis_name).astype(dtype)
        return lax.psum(masked, self.axis_name)

    def permute(self, x, pairs: Sequence[tuple[int, int]]):
        return lax.ppermute(x, self.axis_name, perm=[(int(s), int(d)) for s, d in pairs])

    def switch(self, index, branches: Sequence[Callable[[Any], Any]], operand):
        if isinstance(index, int):
            return branches[index](operand)
        return lax.switch(index, list(branches), operand)

    def _check_rows(self, x, what: str) -> None:
        if x.ndim == 0 or x.shape[0] != self._size:
            raise BaguaXError(
                f"{what} needs an array whose first dimension is the axis size {self._size}, got shape {tuple(x.shape)}"
            )
