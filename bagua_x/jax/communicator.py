"""The Communicator protocol on XLA collectives under a named axis.

Valid inside ``jax.pmap`` or ``jax.shard_map`` over ``axis_name``: every method
emits a ``jax.lax`` collective, which XLA lowers to NCCL on GPU and to gloo
across processes on CPU (``jax.distributed`` with gloo CPU collectives).  The
algorithms in :mod:`bagua_x.algorithms` run on it unchanged, on traced arrays.
"""

from __future__ import annotations

import copy
import functools
import logging
import operator
import os
from typing import Any, Callable, Hashable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.comm import Feature, ReduceOp
from ..core.errors import BaguaXError
from .mesh_step import per_device

__all__ = ["AxisCommunicator", "axis_size", "default_local_size"]

log = logging.getLogger(__name__)

try:  # not yet exported by jax.lax (0.10); plain all_gather is the same collective, typed "varying"
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant
except ImportError:  # pragma: no cover - depends on the jax version
    _all_gather_invariant = lax.all_gather


def default_local_size() -> int:
    """Devices per node unless told: this process's devices times the processes per node (torchrun's
    LOCAL_WORLD_SIZE; 1 when unset, JAX's usual one process per host)."""
    return jax.local_device_count() * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


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

    ``local_size``: devices per node, nodes being consecutive blocks of axis
    indices (default: :func:`default_local_size`, at most the axis).  With
    >= 2 nodes under ``pmap`` it offers ``Feature.HIERARCHICAL``: ``within``
    and ``across`` are the same collectives on groups of the axis
    (``axis_index_groups``).  Under ``shard_map`` JAX has no grouped
    collectives, so on one axis it offers none, and neither does an axis that
    does not split into nodes of ``local_size``: :meth:`node_problem` says why,
    and a frontend refuses an algorithm that requires the feature.  A 2-D mesh
    expresses the nodes itself: ``axis_name=("node", "local")`` spans both
    axes (ranks node-major), and with >= 2 nodes ``within`` is the "local"
    axis and ``across`` the "node" axis, plain collectives under ``shard_map``.
    """

    _known: Optional[tuple] = None  # (traced counter, host value): see counter()

    def __init__(self, axis_name: Hashable = "batch", local_size: Optional[int] = None):
        self.axis_name = axis_name
        self._size = axis_size(axis_name)
        self._mesh_levels = isinstance(axis_name, tuple) and len(axis_name) == 2  # ("node", "local")
        if self._mesh_levels:  # the mesh says where the nodes are
            self.local_size = axis_size(axis_name[1])
        else:
            self.local_size = int(local_size or min(default_local_size(), self._size))
        self._groups: Optional[list[list[int]]] = None  # None: the whole axis
        self._features: Optional[frozenset[Feature]] = None
        self._problem: Optional[str] = None

    def __repr__(self) -> str:
        return f"AxisCommunicator({self.axis_name!r}, size={self.size})"

    @property
    def rank(self):
        return lax.axis_index(self.axis_name)

    @property
    def size(self) -> int:
        return self._size

    @property
    def features(self) -> frozenset[Feature]:
        if self._features is None:
            self._features = self._node_features()
        return self._features

    @property
    def within(self) -> "AxisCommunicator":
        """The devices of this device's node."""
        self._need_nodes()
        if self._mesh_levels:
            return _level(self.axis_name[1])
        local, nodes = self.local_size, self._size // self.local_size
        return _Group(self.axis_name, [[n * local + i for i in range(local)] for n in range(nodes)],
                      lambda index: index % local)

    @property
    def across(self) -> "AxisCommunicator":
        """The devices at this device's place in every node, one per node."""
        self._need_nodes()
        if self._mesh_levels:
            return _level(self.axis_name[0])
        local, nodes = self.local_size, self._size // self.local_size
        return _Group(self.axis_name, [[n * local + i for n in range(nodes)] for i in range(local)],
                      lambda index: index // local)

    def allreduce(self, x, op: ReduceOp = ReduceOp.SUM):
        groups = self._groups
        if op is ReduceOp.SUM:
            return lax.psum(x, self.axis_name, axis_index_groups=groups)
        if op is ReduceOp.AVG:
            return lax.pmean(x, self.axis_name, axis_index_groups=groups)
        if op is ReduceOp.MIN:
            return lax.pmin(x, self.axis_name, axis_index_groups=groups)
        if op is ReduceOp.MAX:
            return lax.pmax(x, self.axis_name, axis_index_groups=groups)
        raise BaguaXError(f"unknown reduce op {op!r}; use a bagua_x.core.ReduceOp")

    def allgather(self, x):
        # The result is the same on every device; saying so (invariant) lets a shard_map
        # step return it with out_specs=P() under check_vma.
        return _all_gather_invariant(x, self.axis_name)

    def alltoall(self, x):
        self._check_rows(x, "alltoall")
        return lax.all_to_all(x, self.axis_name, split_axis=0, concat_axis=0, axis_index_groups=self._groups)

    def reduce_scatter(self, x, op: ReduceOp = ReduceOp.SUM):
        """Row ``rank`` of ``x`` summed (or averaged) over the ranks.

        On CPU an alltoall and a sum in rank order, because gloo's
        reduce-scatter, which XLA:CPU runs ``lax.psum_scatter`` on across
        processes, intermittently returns wrong values for multi-MB chunks,
        with no error (jax-ml/jax#40830; here, 2 nodes x 2 processes with
        buckets of 6.5M and 1.9M elements: 2 of 32 identical calls).  The
        alltoall moves the same bytes.  Elsewhere (GPU: NCCL) XLA's
        reduce-scatter is right and faster, so it stays; the branch is chosen
        when the step is compiled, by the platform it is compiled for.  With
        two ranks per group both give the same bits (a sum of two is one
        addition either way).
        """
        self._check_rows(x, "reduce_scatter")
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            # XLA has no min/max reduce-scatter: reduce everything, keep our row.
            return self.allreduce(x, op)[self.rank]
        out = lax.platform_dependent(x, cpu=self._alltoall_sum, default=self._psum_scatter)
        return out / self.size if op is ReduceOp.AVG else out

    def _alltoall_sum(self, x):
        rows = self.alltoall(x)  # row i: rank i's row for this rank
        return functools.reduce(operator.add, (rows[i] for i in range(self.size)))

    def _psum_scatter(self, x):
        return lax.psum_scatter(x, self.axis_name, scatter_dimension=0, axis_index_groups=self._groups, tiled=False)

    def broadcast(self, x, root: int = 0):
        """``root``'s ``x``: a masked psum (exact: the other ranks add zeros, never their NaNs)."""
        if not 0 <= root < self.size:
            raise BaguaXError(f"broadcast root {root} is outside axis {self.axis_name!r} of size {self.size}")
        dtype = x.dtype
        masked = jnp.where(self.rank == root, x, jnp.zeros_like(x))
        if dtype == jnp.bool_:
            return lax.psum(masked.astype(jnp.uint8), self.axis_name, axis_index_groups=self._groups).astype(dtype)
        return lax.psum(masked, self.axis_name, axis_index_groups=self._groups)

    def permute(self, x, pairs: Sequence[tuple[int, int]]):
        groups = self._groups or [list(range(self._size))]
        return lax.ppermute(x, self.axis_name, perm=[(g[int(s)], g[int(d)]) for g in groups for s, d in pairs])

    def switch(self, index, branches: Sequence[Callable[[Any], Any]], operand):
        """A host index (from :meth:`counter`) runs its branch alone.  Inside a typed ``shard_map`` the branches'
        results are all typed per device: one branch's may come out of a collective (the same on every
        device) and another's not, and ``lax.switch`` wants one type."""
        if isinstance(index, (int, np.integer, np.ndarray)):
            return branches[int(index)](operand)
        return lax.switch(index, [lambda o, b=b: per_device(b(o), self.axis_name) for b in branches], operand)

    def counter(self, step):
        """The host's value of the bucket's step counter where :meth:`knowing` named it, else ``step``
        (traced).  Matched by identity: a value computed from the counter is not the counter."""
        if self._known is not None and step is self._known[0]:
            return np.asarray(self._known[1], np.int32)
        return step

    def knowing(self, step, value: int) -> "AxisCommunicator":
        """A copy whose :meth:`counter` answers ``value`` (a step of the same branch key) for the traced ``step``."""
        known = copy.copy(self)
        known._known = (step, value)
        return known

    def node_problem(self) -> Optional[str]:
        """Why this axis has no node groups to offer, or None (it has them, or it is one node: nothing to group)."""
        self.features  # noqa: B018 - computes it
        return self._problem

    def _node_features(self) -> frozenset[Feature]:
        local = self.local_size
        if self._mesh_levels:  # a 2-D mesh: plain collectives over either axis, no groups needed
            return frozenset({Feature.HIERARCHICAL}) if self._size // local >= 2 else frozenset()
        if local < 1 or self._size % local:
            self._problem = (f"axis {self.axis_name!r} has {self._size} devices, which do not split into nodes of "
                             f"{local} (wrap(devices_per_node=...), default jax.local_device_count() x "
                             "LOCAL_WORLD_SIZE); pass a devices_per_node that divides the axis")
        elif self._size // local < 2:
            return frozenset()
        else:
            try:  # traced and dropped as unused; shard_map raises here
                lax.psum(jnp.zeros((), jnp.int32), self.axis_name,
                         axis_index_groups=[[i] for i in range(self._size)])
                return frozenset({Feature.HIERARCHICAL})
            except NotImplementedError:
                self._problem = (f"axis {self.axis_name!r} is a shard_map axis, and JAX has no grouped collectives "
                                 "(axis_index_groups) under shard_map; run the step under jax.pmap for node groups")
        log.info("bagua_x: hierarchical algorithms run flat: %s", self._problem)
        return frozenset()

    def _need_nodes(self) -> None:
        if Feature.HIERARCHICAL not in self.features:
            raise BaguaXError(
                f"axis {self.axis_name!r} (size {self._size}, local_size={self.local_size} devices per node) has no "
                "node groups here (one node, sizes that do not divide, or shard_map); check Feature.HIERARCHICAL "
                "in comm.features before using comm.within / comm.across"
            )

    def _check_rows(self, x, what: str) -> None:
        if x.ndim == 0 or x.shape[0] != self.size:
            raise BaguaXError(
                f"{what} needs an array whose first dimension is the {'group' if self._groups else 'axis'} size "
                f"{self.size}, got shape {tuple(x.shape)}"
            )


def _level(axis_name: Hashable) -> AxisCommunicator:
    """The collectives over one axis of a 2-D mesh (a node's devices, or one device per node): flat."""
    comm = AxisCommunicator(axis_name, local_size=1)
    comm._features = frozenset()
    return comm


class _Group(AxisCommunicator):
    """The collectives of :class:`AxisCommunicator` on equal groups of the axis (``axis_index_groups``)."""

    def __init__(self, axis_name: Hashable, groups: list[list[int]], position: Callable):
        self.axis_name = axis_name
        self._size = axis_size(axis_name)
        self._groups = groups
        self._position = position
        self.local_size = len(groups[0])
        self._features = frozenset()
        self._problem = None

    def __repr__(self) -> str:
        return f"AxisCommunicator({self.axis_name!r}, groups={self._groups})"

    @property
    def rank(self):
        return self._position(lax.axis_index(self.axis_name))

    @property
    def size(self) -> int:
        return len(self._groups[0])

    def allgather(self, x):
        return lax.all_gather(x, self.axis_name, axis_index_groups=self._groups)
