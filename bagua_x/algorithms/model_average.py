"""Model averaging: ranks train independently and average weights every ``period`` steps."""

from __future__ import annotations

import dataclasses

from ..core.comm import ReduceOp
from ..core.errors import BaguaXError
from .base import Algorithm, Phase, Target, counter, every, namespace, ring_allreduce_bytes

__all__ = ["ModelAverage", "AsyncModelAverage", "async_average_delta"]


@dataclasses.dataclass(frozen=True)
class ModelAverage(Algorithm):
    """Weights averaged over the ranks after the optimizer step, every ``period`` steps.

    Args:
        period: average every this many steps (1: every step).
    """

    period: int = 1
    donates_input = True

    target = Target.WEIGHT
    phase = Phase.AFTER_STEP

    def __post_init__(self):
        if self.period < 1:
            raise BaguaXError(f"ModelAverage: period must be >= 1, got {self.period}")

    def init(self, flat, layout, world_size):
        return {"step": counter(namespace(flat))}

    def wire_bytes(self, layout, itemsize, world_size):
        return ring_allreduce_bytes(layout.padded_numel, itemsize, world_size) / self.period

    def reduce(self, flat, layout, state, comm):
        step = state["step"] + 1  # average after steps period, 2*period, ...
        x = every(comm, step, self.period, lambda y: comm.allreduce(y, ReduceOp.AVG), flat)
        return x, {"step": step}


def async_average_delta(snapshot, comm):
    """What to add to the live weights: ``allreduce_sum(s)/N - s`` for a snapshot ``s``.

    Adding the delta (instead of overwriting) keeps the local progress made
    while the allreduce was in flight.
    """
    return comm.allreduce(snapshot, ReduceOp.SUM) / comm.size - snapshot


@dataclasses.dataclass(frozen=True)
class AsyncModelAverage(Algorithm):
    """Background weight averaging every ``sync_interval_ms`` (torch frontend only)."""

    sync_interval_ms: int = 500
    warmup_steps: int = 0

    target = Target.WEIGHT
    phase = Phase.BACKGROUND

    def reduce(self, flat, layout, state, comm):
        return flat + async_average_delta(flat, comm), state
