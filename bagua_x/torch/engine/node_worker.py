"""A node as one worker: gradients averaged inside the node every step, the weight algorithm across nodes.

An algorithm that declares ``averages_gradients_in_node`` (DiLoCo) treats a
node as one worker where the communicator runs over nodes: its ranks must stay
identical, so each backward's gradients are averaged over the node's ranks
(a flat allreduce on ``comm.within``: the fast link) before the optimizer
steps, and only the algorithm's own exchange after the step crosses nodes.
This engine composes the two existing engines: a :class:`GradientEngine`
running ``GradientAllReduce`` on ``comm.within`` and the :class:`WeightEngine`
running the algorithm on the whole communicator.  Each waits for its own
communication before the training thread goes on (end of backward, end of the
step), so their threads never use the node group at the same time.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...algorithms import GradientAllReduce
from ...algorithms.base import Algorithm
from ...core.bucket import Bucket
from ...core.comm import Feature
from ..communicator import TorchCommunicator
from .gradient import GradientEngine
from .interface import EngineOptions
from .weight import WeightEngine

__all__ = ["NodeWorkerEngine", "weight_engine"]


def weight_engine(named_params: Sequence[tuple[str, torch.nn.Parameter]], algorithm: Algorithm,
                  comm: TorchCommunicator, *, options: EngineOptions):
    """The engine for a weight algorithm: a :class:`NodeWorkerEngine` where it declares that a node is one worker
    and the communicator runs over nodes, else a :class:`WeightEngine`."""
    if algorithm.averages_gradients_in_node and Feature.HIERARCHICAL in comm.features:
        return NodeWorkerEngine(named_params, algorithm, comm, options=options)
    return WeightEngine(named_params, algorithm, comm, options=options)


class NodeWorkerEngine:
    """Gradient allreduce inside the node, then the weight algorithm (see the module docstring)."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], algorithm: Algorithm,
                 comm: TorchCommunicator, *, options: EngineOptions):
        self._weights = WeightEngine(named_params, algorithm, comm, options=options)  # refuses a missing optimizer
        try:
            self._grads = GradientEngine(named_params, GradientAllReduce(hierarchical=False), comm.within,
                                         options=options)
        except BaseException:
            self._weights.close()  # no step hook or thread left behind
            raise
        self._enabled = True

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:  # no_sync(): gradients accumulate locally, no step is exchanged
        self._enabled = self._grads.enabled = self._weights.enabled = value

    @property
    def buckets(self) -> list[Bucket]:
        return self._weights.buckets

    @property
    def synced_steps(self) -> int:
        return self._weights.synced_steps

    def settle(self) -> None:
        self._grads.settle()
        self._weights.settle()

    def before_forward(self) -> None:
        self._grads.before_forward()
        self._weights.before_forward()

    def after_forward(self, outputs) -> None:
        self._grads.after_forward(outputs)
        self._weights.after_forward(outputs)

    def weights_locked(self):
        return self._weights.weights_locked()

    def restart_state(self) -> None:
        self._weights.restart_state()

    def state_dict(self) -> dict:
        return self._weights.state_dict()

    def load_state_dict(self, saved: dict) -> None:
        self._weights.load_state_dict(saved)

    def close(self) -> None:
        try:
            self._weights.close()
        finally:
            self._grads.close()
