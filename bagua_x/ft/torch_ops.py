"""bagua_x's reduce ops in ``torch.distributed``'s terms: shared by the torch frontend's communicator and the
communicator between replica groups (which the JAX frontend drives too, so it may not live in the frontend)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.comm import ReduceOp
from ..core.errors import BaguaXError

__all__ = ["reduce_rows", "torch_op"]

_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX}


def torch_op(op: ReduceOp):
    """``op`` as a ``torch.distributed.ReduceOp`` (AVG has no portable one: the callers divide)."""
    try:
        return _TORCH_OPS[op]
    except KeyError:
        raise BaguaXError(f"unsupported reduce op {op!r}; use a bagua_x.core.ReduceOp") from None


def reduce_rows(rows: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """``op`` over the first axis of ``rows`` (SUM, MIN or MAX): the reduction after an alltoall."""
    if op is ReduceOp.SUM:
        return rows.sum(dim=0)
    if op is ReduceOp.MIN:
        return rows.min(dim=0).values
    return rows.max(dim=0).values
