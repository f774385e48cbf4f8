"""Fault tolerance on torchft, shared by both frontends: a node that dies leaves the others training, and heals
from them when it comes back (:mod:`.replicas`).  Imports torch; torchft is the optional extra ``bagua-x[ft]``."""

from .communicator import ReplicaCommunicator
from .replicas import FaultTolerance, Replicas, reachable_address

__all__ = ["FaultTolerance", "ReplicaCommunicator", "Replicas", "reachable_address"]
