"""An algorithm written outside bagua_x: gradients averaged in float16, half the bytes on the wire.

docs/write-your-own-algorithm.md walks through it; tests/algorithms/test_own_algorithm.py tests it on
2, 3, 4 and 8 simulated ranks, tests/torch and tests/jax train with it through both frontends.
"""

import dataclasses

import array_api_compat

from bagua_x.algorithms import Algorithm
from bagua_x.algorithms.base import ring_allreduce_bytes
from bagua_x.core import ReduceOp


@dataclasses.dataclass(frozen=True)
class Float16AllReduce(Algorithm):
    """The mean of the ranks' gradients, summed in float16 (GradientAllReduce's result to about 1e-3).

    Each rank divides its gradient by the number of ranks before the cast, so the float16 sum of N
    ranks stays as far from float16's largest value (65504) as one rank's gradient.  No hyperparameters,
    no state: ``init`` is the base class's (``EmptyState()``).
    """

    def reduce(self, flat, layout, state, comm):
        xp = array_api_compat.array_namespace(flat)  # numpy, torch or jax.numpy: one code for all
        half = xp.astype(flat / comm.size, xp.float16)
        total = comm.allreduce(half, ReduceOp.SUM)
        return xp.astype(total, flat.dtype), state

    def wire_bytes(self, layout, itemsize, world_size):
        return ring_allreduce_bytes(layout.padded_numel, 2, world_size)  # 2 bytes an element, whatever the dtype
