"""What every torch engine offers the wrapper, and the options they all take.

An engine runs one algorithm on a model's parameters: it registers the tensor
the algorithm communicates (gradient, weight or optimizer momentum), buckets
it, and hooks backward or the optimizer step.  The wrapper
(:class:`~bagua_x.torch.wrap.DistributedModel`) picks the engine from the
algorithm's declared ``target`` and ``phase`` and then only talks to it
through :class:`Engine`: once per forward ``settle()`` (communication still in
flight ends, so the wrapper may use the process group), ``before_forward()``
and ``after_forward(outputs)``; ``enabled`` is False inside ``no_sync()``;
``synced_steps`` counts the steps whose communication every rank ran (what
``hierarchical=None``'s trial advances on, :mod:`..node_form`).

=====================  ==================================  ========================================
engine                 algorithms                          communicates
=====================  ==================================  ========================================
``GradientEngine``     target GRAD                          gradients, during backward
``WeightEngine``       target WEIGHT                        weights, at forward or after the step
``NodeWorkerEngine``   target WEIGHT, a node one worker     gradients in the node, then as WeightEngine
``MomentumEngine``     target MOMENTUM (QAdam)              gradients in warmup, then ``exp_avg``
``AsyncAverageEngine`` phase BACKGROUND (AsyncModelAverage) weights, on a thread of its own
=====================  ==================================  ========================================

The bucket lifecycle (per-bucket state, the communication thread, backward
hooks and their end-of-backward wait) is written once in :mod:`.base`;
GradientEngine and QAdam's momentum phase are its ``BackwardEngine``,
WeightEngine its ``BucketedEngine``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

import torch

from ...core.bucket import Bucket

__all__ = ["Engine", "EngineOptions"]


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """wrap()'s settings that engines use (each reads the ones that concern it)."""

    bucket_cap_mb: float = 25.0
    optimizer: Optional[torch.optim.Optimizer] = None
    find_unused_parameters: bool = False
    check_finite: bool = False
    static_graph: bool = False  # backward engines: hook firings per backward learnt once (see core/readiness.py)
    #: fault-tolerant replica groups (:class:`~..fault_tolerance.Replicas`): a weight algorithm's exchange between
    #: nodes is begun (quorum, healing) and committed or rolled back with them; gradient buckets keep the
    #: registration order, the one a restarted node also has (a ready order is each node's own)
    replicas: Optional[Any] = None


class Engine(Protocol):
    enabled: bool  # False inside no_sync()
    #: steps communicated, the same count on every rank: a backward that launched the buckets, an exchange landed,
    #: an optimizer step that synced the weights (a forward alone, or one rank's extra forward, adds none)
    synced_steps: int

    @property
    def buckets(self) -> list[Bucket]:
        """The core buckets the algorithm runs on."""

    def settle(self) -> None:
        """End communication still in flight from an earlier step (before the wrapper uses the process group)."""

    def before_forward(self) -> None:
        """Start what the algorithm does at forward (Decentralized's exchange, QAdam's switch at warmup's end)."""

    def after_forward(self, outputs) -> None:
        """See the forward's ``outputs`` (e.g. to end communication where backward ends, :class:`.backward.BackwardHooks`)."""

    def weights_locked(self):
        """Context in which no other thread writes the weights; it gives True when one does outside it
        (AsyncModelAverage's averaging), so what the caller keeps of them must be copied inside."""

    def state_dict(self) -> dict:
        """Per-bucket algorithm state, copied."""

    def load_state_dict(self, saved: dict) -> None: ...

    def close(self) -> None:
        """Remove hooks and stop threads; the model stays usable, unsynchronised."""
