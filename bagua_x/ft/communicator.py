"""The collectives between nodes of a fault-tolerant job: torchft's reconfigurable group, sized at each step."""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions, BroadcastOptions

from ..core.comm import Feature, ReduceOp
from ..core.errors import BaguaXError
from .replicas import Replicas
from .torch_ops import reduce_rows, torch_op

__all__ = ["ReplicaCommunicator"]

log = logging.getLogger(__name__)


class ReplicaCommunicator:
    """The ranks at this rank's place in every node of the current quorum, over torchft's reconfigurable group.

    Sized at each step.  A failed collective is reported to the manager (the
    step will not commit) and returns zeros of the right shape, so the caller
    goes on to the vote instead of raising.  After a failure the step's further
    collectives are skipped (as torchft's own ``allreduce``).
    """

    features: frozenset[Feature] = frozenset()

    def __init__(self, replicas: Replicas):
        self._replicas = replicas

    @property
    def rank(self) -> int:
        rank = self._replicas.manager.participating_rank()
        if rank is None:
            raise BaguaXError("bagua_x: a collective between nodes outside a quorum (internal error: begin() first)")
        return rank

    @property
    def size(self) -> int:
        return self._replicas.manager.num_participants()

    def __repr__(self) -> str:
        return f"ReplicaCommunicator(replica_id={self._replicas.settings.replica_id!r})"

    def allreduce(self, x: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        if self._replicas.manager.errored() is None:
            reduce_op = dist.ReduceOp.AVG if op is ReduceOp.AVG else torch_op(op)
            self._replicas.manager.allreduce(out, reduce_op=reduce_op).wait()  # AVG: over the members that take part
        return out

    def allgather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows = [torch.zeros_like(x) for _ in range(self.size)]
        self._run(lambda: self._replicas.group.allgather([rows], [x], AllgatherOptions()), "allgather")
        return torch.stack(rows)

    def alltoall(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 0 or x.shape[0] != self.size:
            raise BaguaXError(f"alltoall needs one row per node ({self.size}), got shape {tuple(x.shape)}")
        x = x.contiguous()
        out = torch.zeros_like(x)
        self._run(lambda: self._replicas.group.alltoall_base(out, x, [], [], AllToAllOptions()), "alltoall")
        return out

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        out = reduce_rows(self.alltoall(x), ReduceOp.SUM if op is ReduceOp.AVG else op)
        return out / self.size if op is ReduceOp.AVG else out

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        options = BroadcastOptions()
        options.rootRank = root
        self._run(lambda: self._replicas.group.broadcast([out], options), "broadcast")
        return out

    def permute(self, x, pairs: Sequence[tuple[int, int]]):
        raise BaguaXError("point-to-point exchanges between replica groups are not supported (their members change)")

    def switch(self, index, branches: Sequence[Callable], operand):
        return branches[int(index)](operand)

    def counter(self, step):
        return step  # on the host already

    def _run(self, start: Callable, what: str) -> None:
        manager = self._replicas.manager
        if manager.errored() is not None:
            return
        try:
            start().wait()
        except Exception as e:  # a peer died mid-step: this step is spoilt, the vote discards it
            log.warning("bagua_x: fault tolerance: %s between nodes failed: %s", what, e)
            manager.report_error(e)
