"""Model averaging: ranks train independently and average weights every ``period`` steps."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from ..core.comm import ReduceOp
from ..core.errors import BaguaXError
from .base import Algorithm, Phase, Target, counter, every, namespace, ring_allreduce_bytes

__all__ = ["ModelAverage", "ModelAverageState", "AsyncModelAverage"]


class ModelAverageState(NamedTuple):
    step: Any  # optimizer steps so far (counter)


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
        return ModelAverageState(step=counter(namespace(flat)))

    def wire_bytes(self, layout, itemsize, world_size):
        return ring_allreduce_bytes(layout.padded_numel, itemsize, world_size) / self.period

    def branch_key(self, step):
        return (step + 1) % self.period == 0

    def reduce(self, flat, layout, state, comm):
        # average after steps period, 2*period, ...
        x = every(comm, comm.counter(state.step) + 1, self.period, lambda y: comm.allreduce(y, ReduceOp.AVG), flat)
        return x, ModelAverageState(step=state.step + 1)


@dataclasses.dataclass(frozen=True)
class AsyncModelAverage(Algorithm):
    """Weights averaged by a background thread every ``sync_interval_ms`` while training goes on.

    :meth:`reduce` is the averaging, ``allreduce_sum(s) / N`` of a snapshot
    ``s`` of a weight bucket.  The schedule is frontend code, and only torch
    has it (``bagua_x/torch/engine/background.py``): its thread snapshots the
    weights, runs :meth:`reduce` on its own process group and adds
    ``reduce(s) - s`` to the live weights, keeping the local progress made
    meanwhile.  JAX's weights are immutable, so ``bagua_x.jax.wrap`` refuses this
    algorithm (use :class:`ModelAverage`).

    Reading the weights while the thread runs (torch): ``wrapped.state_dict()``
    is a consistent copy (taken under the weight lock); anything else that
    reads them outside a training step -- evaluation under ``no_grad``, an EMA
    update, saving ``wrapped.module`` -- goes inside ``with
    wrapped.weights_locked():``, or between ``wrapped.abort()`` and
    ``wrapped.resume()`` (Bagua's way, collective).

    Args:
        sync_interval_ms: milliseconds between the starts of two averaging rounds.
        warmup_steps: optimizer steps of synchronous gradient allreduce before averaging starts.
    """

    sync_interval_ms: int = 500
    warmup_steps: int = 0

    target = Target.WEIGHT
    phase = Phase.BACKGROUND

    def reduce(self, flat, layout, state, comm):
        return comm.allreduce(flat, ReduceOp.SUM) / comm.size, state
