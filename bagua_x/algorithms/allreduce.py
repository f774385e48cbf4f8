"""GradientAllReduce: gradients averaged (or summed) over ranks -- what DDP does."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..core.comm import ReduceOp
from .base import Algorithm, NodeAware, over_nodes

__all__ = ["GradientAllReduce"]


@dataclasses.dataclass(frozen=True)
class GradientAllReduce(NodeAware, Algorithm):
    """Gradients averaged (or summed) over the ranks in full precision: what DDP does.

    Args:
        average: divide the sum by the number of ranks.
        hierarchical: reduce inside each node, then across nodes (:func:`~.base.over_nodes`): the same
            result with the nodes' links carrying only the cross-node part.  Off by default, as in Bagua:
            an uncompressed allreduce gains little from it.
    """

    average: bool = True
    hierarchical: Optional[bool] = False
    donates_input = True
    elementwise = True
    elastic_nodes = True  # any number of nodes: what crosses them is an average (or a gather) over those there

    def reduce(self, flat, layout, state, comm):
        op = ReduceOp.AVG if self.average else ReduceOp.SUM
        if self.two_level(comm):
            return over_nodes(flat, comm, lambda shard, across: across.allreduce(shard, op), op), state
        return comm.allreduce(flat, op), state
