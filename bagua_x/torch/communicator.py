"""The Communicator protocol on ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Every collective is functional, as the protocol (and JAX) require: the input
is left untouched and a new tensor is returned.  The one exception is a
*donated* buffer (:meth:`TorchCommunicator.donate`): the frontend hands an
algorithm a bucket buffer it will overwrite with the result anyway, so the
first collective that consumes it may work in place and skip a copy -- the
same idea as JAX's ``donate_argnums``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..core.comm import Feature, ReduceOp
from ..core.errors import BaguaXError
from ..ft.torch_ops import reduce_rows, torch_op
from .distributed import private_group
from .node_form import agree_on_nodes

__all__ = ["TorchCommunicator"]

log = logging.getLogger(__name__)

# recent torch renamed the flat tensor-in/tensor-out collectives (the old names warn); older releases lack the new
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

class TorchCommunicator:
    """bagua_x collectives on a ``torch.distributed`` process group (the default group if ``None``)."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, timeout: Optional[float] = None):
        if not dist.is_initialized():
            raise BaguaXError(
                "TorchCommunicator needs torch.distributed to be initialised; call "
                "torch.distributed.init_process_group() first (or launch with torchrun and use bagua_x.torch.wrap)"
            )
        self.group = process_group
        #: seconds each CPU collective may take before it raises (None: the process group's timeout)
        self.timeout = timeout
        self._rank = dist.get_rank(process_group)
        self._size = dist.get_world_size(process_group)
        self._donated: Optional[torch.Tensor] = None
        self._features: frozenset[Feature] = frozenset()
        self._node_comms: Optional[tuple["TorchCommunicator", "TorchCommunicator"]] = None

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def features(self) -> frozenset[Feature]:
        """HIERARCHICAL once :meth:`enable_hierarchical` has built the node groups (``within``, ``across``)."""
        return self._features

    def __repr__(self) -> str:
        return f"TorchCommunicator(rank={self._rank}, size={self._size})"

    # -- donation ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def donate(self, buffer: torch.Tensor):
        """Within the block, the first collective given ``buffer`` itself may overwrite it.

        The donation is state of this communicator: use one communicator per thread.
        """
        self._donated = buffer
        try:
            yield
        finally:
            self._donated = None

    def _writable(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` itself if it is the donated buffer (consuming the donation), else a contiguous copy."""
        if self._donated is not None and x is self._donated and x.is_contiguous():
            self._donated = None
            return x
        return x.clone(memory_format=torch.contiguous_format)

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, x: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        out = self._writable(x)
        if op is ReduceOp.AVG:
            self._wait(dist.all_reduce(out, dist.ReduceOp.SUM, group=self.group, async_op=True), out)  # gloo: no AVG
            if out.is_floating_point() or out.is_complex():
                out.div_(self._size)
            else:
                out.floor_divide_(self._size)
        else:
            self._wait(dist.all_reduce(out, torch_op(op), group=self.group, async_op=True), out)
        return out

    def allgather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty((self._size * x.numel(),), dtype=x.dtype, device=x.device)
        self._wait(_all_gather_flat(out, x.reshape(-1), group=self.group, async_op=True), out)
        return out.reshape((self._size, *x.shape))

    def alltoall(self, x: torch.Tensor) -> torch.Tensor:
        self._check_rows(x, "alltoall")
        x = x.contiguous()
        out = torch.empty_like(x)
        self._wait(dist.all_to_all_single(out, x, group=self.group, async_op=True), out)
        return out

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Row ``rank`` reduced over ranks.  On CPU (gloo) an alltoall and a local sum: the same bytes,
        and faster than gloo's own reduce-scatter on CPU (measured on the docs' Performance page)."""
        self._check_rows(x, "reduce_scatter")
        x = x.contiguous()
        reduce_op = dist.ReduceOp.SUM if op is ReduceOp.AVG else torch_op(op)
        if x.device.type == "cpu":
            out = reduce_rows(self.alltoall(x), op if op is not ReduceOp.AVG else ReduceOp.SUM)
        else:
            out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
            self._wait(_reduce_scatter_flat(out.reshape(-1), x.reshape(-1), reduce_op, group=self.group,
                                            async_op=True), out)
        if op is ReduceOp.AVG:
            out = out / self._size if out.is_floating_point() else out // self._size
        return out

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        out = self._writable(x)
        self._wait(dist.broadcast(out, self._global(root), group=self.group, async_op=True), out)
        return out

    def permute(self, x: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Point-to-point exchange: each rank gets the ``x`` of the rank that sends to it, else zeros."""
        x = x.contiguous()
        out = torch.zeros_like(x)
        ops = []
        for src, dst in pairs:
            if src == dst == self._rank:
                out.copy_(x)
            elif src == self._rank:
                ops.append(dist.P2POp(dist.isend, x, self._global(dst), group=self.group))
            elif dst == self._rank:
                ops.append(dist.P2POp(dist.irecv, out, self._global(src), group=self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                self._wait(work, x)
        return out

    def switch(self, index, branches: Sequence[Callable], operand):
        return branches[int(index)](operand)

    def counter(self, step):
        return step  # on the host already

    # -- helpers ----------------------------------------------------------------------------
    def _wait(self, work, x: torch.Tensor) -> None:
        """Wait for a collective, raising after ``timeout`` seconds (gloo: "Operation timed out!").

        The bound applies to CPU collectives; NCCL's own watchdog bounds GPU ones.
        """
        if self.timeout is None or x.device.type != "cpu":
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=self.timeout))

    # -- nodes -------------------------------------------------------------------------------------
    @property
    def within(self) -> "TorchCommunicator":
        """The ranks of this rank's node (after :meth:`enable_hierarchical`)."""
        return self._nodes()[0]

    @property
    def across(self) -> "TorchCommunicator":
        """The ranks at this rank's place in every node, one per node (after :meth:`enable_hierarchical`)."""
        return self._nodes()[1]

    def enable_hierarchical(self, setting: Optional[bool] = True, local_world_size: Optional[int] = None) -> None:
        """Offer ``Feature.HIERARCHICAL`` where the algorithm runs over nodes (collective: every rank calls it once).

        ``setting`` is the algorithm's ``hierarchical=`` (``False`` only takes
        part in the check).  The node groups are made of this communicator's
        ranks with its backend (wrap's own group: the user's collectives never
        pair with them either).  Nodes are consecutive blocks of
        ``local_world_size`` ranks (torchrun's ``LOCAL_WORLD_SIZE``).  Every
        rank first checks through the store that all see the same setting and
        layout (:func:`~.node_form.agree_on_nodes`): the same BaguaXError on every
        rank instead of a hang in ``new_group``.  ``True`` (the user asked for
        it): a layout that cannot have node groups raises instead of quietly
        running flat.
        """
        layout = agree_on_nodes(self.group, setting, local_world_size, self.timeout)
        if layout.problem:
            if setting is True:
                raise BaguaXError(f"{layout.problem}; or pass hierarchical=False")
            if setting is None:
                log.info("bagua_x: running flat: %s", layout.problem)
            return
        if not layout.two_level:
            return
        local, size = layout.local, self._size
        blocks = [list(range(n * local, (n + 1) * local)) for n in range(layout.nodes)]
        places = [list(range(i, size, local)) for i in range(local)]
        mine, backend = [], dist.get_backend(self.group)
        for ranks in blocks + places:  # every rank creates every group, in the same order, at wrap
            group = dist.new_group([self._global(r) for r in ranks], backend=backend)
            if self._rank in ranks:
                mine.append(TorchCommunicator(group, timeout=self.timeout))
        self._node_comms = tuple(mine)
        self._features = self._features | {Feature.HIERARCHICAL}

    def duplicate(self) -> "TorchCommunicator":
        """A communicator of the same ranks, backend, timeout and current node form on process groups of its
        own (collective: every rank calls it once), for collectives another thread runs while this
        communicator's are in use (a group pairs collectives in the order each rank issues them)."""
        twin = TorchCommunicator(private_group(self.group, self.timeout), timeout=self.timeout)
        if Feature.HIERARCHICAL in self._features:
            twin.enable_hierarchical(True, self._node_comms[0].size)
        return twin

    @property
    def node_size(self) -> Optional[int]:
        """Ranks per node where :meth:`enable_hierarchical` made node groups, else None."""
        return None if self._node_comms is None else self._node_comms[0].size

    def use_nodes(self, two_level: bool) -> None:
        """Offer ``Feature.HIERARCHICAL`` (``two_level``) or withhold it, keeping the node groups: the form
        chosen by measurement or restored from a checkpoint (see :mod:`.node_form`)."""
        if self._node_comms is None:
            raise BaguaXError("use_nodes() needs the node groups of enable_hierarchical(), which made none here")
        self._features = self._features | {Feature.HIERARCHICAL} if two_level else \
            self._features - {Feature.HIERARCHICAL}

    def _nodes(self) -> tuple["TorchCommunicator", "TorchCommunicator"]:
        if Feature.HIERARCHICAL not in self._features:
            raise BaguaXError("this communicator has no node groups: check Feature.HIERARCHICAL in comm.features "
                              "before using comm.within / comm.across")
        return self._node_comms

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _check_rows(self, x: torch.Tensor, what: str) -> None:
        if x.ndim == 0 or x.shape[0] != self._size:
            raise BaguaXError(
                f"{what} needs an array whose first dimension is the world size {self._size} (one row per rank), "
                f"got shape {tuple(x.shape)}"
            )
