"""Fault-tolerant replica groups for a wrapped torch model (``wrap(..., fault_tolerance=FaultTolerance())``).

The protocol (quorum and healing, the exchange between nodes, the vote) is
:mod:`bagua_x.ft.replicas`, shared with the JAX frontend.  Here: which
algorithms run over replica groups, the wrapped model's communicator whose
``across`` is torchft's group, and what a healing node takes from a live one.

Gradient algorithms cross nodes every step (quorum at each training forward,
commit at ``optimizer.step()``); DiLoCo only at its outer steps
(``Algorithm.communicates``), so its inner steps never wait for the lighthouse.
"""

from __future__ import annotations

import copy
import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..algorithms.base import Algorithm
from ..core.comm import Feature
from ..core.errors import BaguaXError
from ..ft import ReplicaCommunicator, Replicas
from ..ft.replicas import elastic_algorithm
from .communicator import TorchCommunicator

__all__ = ["ReplicaGroups", "check_supported", "healing_state"]

log = logging.getLogger(__name__)


def check_supported(algorithm: Algorithm, optimizer: Optional[torch.optim.Optimizer]) -> Algorithm:
    """``algorithm`` as it runs over replica groups (always over nodes), or a BaguaXError saying what does."""
    if optimizer is None:
        raise BaguaXError("fault_tolerance needs the optimizer: wrap(model, optimizer, ..., fault_tolerance=...): "
                          "a step that some node could not complete must not be applied, and a healing node "
                          "takes the optimizer's state too")
    return elastic_algorithm(algorithm)


class ReplicaGroups(TorchCommunicator):
    """The communicator of a wrapped model over replica groups: its own collectives stay inside the node (set-up
    checks, broadcasts), ``within`` is the node and ``across`` the :class:`ReplicaCommunicator`."""

    def __init__(self, process_group: dist.ProcessGroup, timeout: float, node: TorchCommunicator,
                 replicas: Replicas):
        super().__init__(process_group, timeout=timeout)
        self._node_comms = (node, ReplicaCommunicator(replicas))
        self._features = frozenset({Feature.HIERARCHICAL, Feature.REPLICA_GROUPS})

    def duplicate(self) -> "TorchCommunicator":
        raise BaguaXError("fault_tolerance runs no exchange in flight across steps (internal error)")

    def use_nodes(self, two_level: bool) -> None:
        if not two_level:
            raise BaguaXError("over replica groups a node is always one worker (internal error: no flat form)")


def healing_state(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], engine,
                  algorithm: Algorithm, signature: dict) -> tuple[Callable[[], dict], Callable[[dict], None]]:
    """``(save, load)`` of what a healing node takes from a live one: the model, the optimizer, the algorithm's
    state (less what is each worker's own: ``Algorithm.own_state`` starts at zero), and the ``signature``
    (model and algorithm), which must match the healing node's own."""

    def save() -> dict:
        # copies: on CPU torchft serves the tensors it is given while this node trains on in place
        return {"signature": signature,
                "model": {k: v.detach().clone() for k, v in module.state_dict().items()},
                "optimizer": copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
                "algorithm": engine.state_dict()}

    def load(state: dict) -> None:
        if state["signature"] != signature:
            differs = sorted(k for k in set(signature) | set(state["signature"])
                             if signature.get(k) != state["signature"].get(k))
            verb = "differs" if len(differs) == 1 else "differ"
            raise BaguaXError(f"bagua_x: fault tolerance: this node cannot heal from its peer: the "
                              f"{' and '.join(differs)} {verb} (here {[signature.get(k) for k in differs]}, the "
                              f"peer's {[state['signature'].get(k) for k in differs]}); every node must train the "
                              "same model with the same algorithm")
        with torch.no_grad():
            module.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        engine.load_state_dict({bucket: {k: torch.zeros_like(v) if k in algorithm.own_state else v
                                          for k, v in fields.items()} if isinstance(fields, dict) else fields
                                for bucket, fields in state["algorithm"].items()})
        log.info("bagua_x: fault tolerance: healed from a live peer")

    return save, load

