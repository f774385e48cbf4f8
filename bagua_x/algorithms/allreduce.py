"""GradientAllReduce: gradients averaged (or summed) over ranks -- what DDP does."""

from __future__ import annotations

import dataclasses

from ..core.comm import Feature, ReduceOp
from .base import Algorithm

__all__ = ["GradientAllReduce"]


@dataclasses.dataclass(frozen=True)
class GradientAllReduce(Algorithm):
    """``hierarchical=True``: reduce within each node, then across nodes, where the
    communicator offers it: torch (leaders' allreduce) and JAX under ``pmap``, nodes
    being ``LOCAL_WORLD_SIZE`` processes.  Elsewhere (``shard_map``,
    the NCCL communicator) it is one flat allreduce, with the same result."""

    average: bool = True
    hierarchical: bool = False
    donates_input = True
    elementwise = True

    @property
    def uses(self):
        return frozenset({Feature.HIERARCHICAL}) if self.hierarchical else frozenset()

    def reduce(self, flat, layout, state, comm):
        op = ReduceOp.AVG if self.average else ReduceOp.SUM
        if self.hierarchical and Feature.HIERARCHICAL in comm.features:
            return comm.hierarchical_allreduce(flat, op), state
        return comm.allreduce(flat, op), state
