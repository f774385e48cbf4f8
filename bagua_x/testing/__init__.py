"""Test utilities for algorithm authors: N simulated ranks in one process, and numpy references.

As torch ships ``torch.testing`` and JAX's chex its fake devices, bagua_x ships the helpers its own
algorithm tests use, so an algorithm written outside the library is tested the same way: run its
``init``/``reduce`` on N ranks with :func:`run` (threads over numpy, a :class:`SimulatedCommunicator`
each, milliseconds), and compare each rank's result with a numpy reference built from :mod:`bagua_x.testing.reference`.
Framework-free: imports neither torch nor jax.  See docs/write-your-own-algorithm.md.
"""

from . import reference
from .simulated import (CollectiveError, HierarchicalSimulatedCommunicator, Rendezvous, Sent, SimulatedCommunicator,
                        flat_layout, run)

__all__ = ["run", "flat_layout", "SimulatedCommunicator", "HierarchicalSimulatedCommunicator", "Rendezvous", "Sent",
           "CollectiveError", "reference"]
