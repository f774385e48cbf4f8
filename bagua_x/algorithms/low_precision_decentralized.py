"""Low-precision decentralized SGD on a ring (Bagua's algorithm).

Each rank keeps ``w`` (its weights after the last exchange) and ``L``, ``R``
(its estimates of its left and right neighbours' weights), all starting as
copies of ``x``.  After the optimizer step:
``d = x + L/3 + R/3 - 5w/3``; ``q = MinMaxUInt8(d)``; ``q`` goes to both
neighbours; ``L += deQ(q_from_left)``, ``R += deQ(q_from_right)``;
``x <- w + deQ(q)``; ``w <- x``.  Only 8-bit differences travel.

``hierarchical`` (Bagua's option; by default the faster form, timed, on >= 2 nodes of >= 2 ranks):
the ring is one of nodes.  Weights are averaged inside each node in full
precision; each of a node's L ranks runs the step above on its 1/L shard of
the average with the ranks holding that shard in the neighbouring nodes, and
the node's ranks then share their 8-bit messages, so every rank keeps the
whole state and ends with the node's weights.  Bagua's leader quantises the
bucket as one row; here each shard has its own min/max.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

from ..core.comm import ReduceOp
from ..core.errors import BaguaXError
from .base import Algorithm, NodeAware, Phase, Target, counter, every, namespace
from .compression import dequantize, pack_rows, quantize, unpack_rows
from .kernels import kernel

__all__ = ["LowPrecisionDecentralized", "LowPrecisionDecentralizedState"]


class LowPrecisionDecentralizedState(NamedTuple):
    """Float32, laid out as the bucket, except the step counter."""

    step: Any  # steps so far (counter): picks the communication_interval's steps
    w: Any  # the weights after the last exchange
    left: Any  # the estimate of the left neighbour's weights
    right: Any  # the estimate of the right neighbour's weights


@kernel
def quantized_difference(x, w, left, right):
    """MinMaxUInt8 of ``x + L/3 + R/3 - 5w/3`` as one row."""
    xp = namespace(x)
    return quantize.plain(xp.reshape(x + left / 3 + right / 3 - 5 * w / 3, (1, -1)))


@kernel
def apply_differences(w, left, right, q, mm, q_left, mm_left, q_right, mm_right):
    """``(w + deQ(q), L + deQ(q_left), R + deQ(q_right))``: new weights and neighbour estimates."""
    xp = namespace(w)
    step = lambda q, mm: xp.reshape(dequantize.plain(q, mm), w.shape)  # noqa: E731
    return w + step(q, mm), left + step(q_left, mm_left), right + step(q_right, mm_right)


@dataclasses.dataclass(frozen=True)
class LowPrecisionDecentralized(NodeAware, Algorithm):
    """Ring of 8-bit weight differences after the optimizer step (Bagua's low-precision decentralized SGD).

    Args:
        communication_interval: communicate every this many steps.
        hierarchical: over nodes (full precision inside each node, the flat algorithm between nodes;
            ``over_nodes``): ``None`` the faster form, timed at set-up, where there are >= 2 nodes of >= 2
            ranks, ``True`` required (refused where the frontend has no node groups), ``False`` flat.
    """

    communication_interval: int = 1
    hierarchical: Optional[bool] = None

    target = Target.WEIGHT
    phase = Phase.AFTER_STEP
    uses_kernels = True
    state_follows_form = True  # the neighbour estimates are of ranks flat, of nodes over nodes

    def __post_init__(self):
        if self.communication_interval < 1:
            raise BaguaXError(
                f"LowPrecisionDecentralized: communication_interval must be >= 1, got {self.communication_interval}"
            )

    def alignment(self, world_size):
        return 1 if self.hierarchical is False else world_size  # the hierarchical step shards the bucket

    def init(self, flat, layout, world_size):
        xp = namespace(flat)
        copy = lambda: xp.astype(flat, xp.float32, copy=True)  # noqa: E731
        return LowPrecisionDecentralizedState(step=counter(xp), w=copy(), left=copy(), right=copy())

    def wire_bytes(self, layout, itemsize, world_size):
        neighbours = 1 if world_size == 2 else 2  # uint8 differences to each neighbour (one on a ring of two)
        return neighbours * (layout.padded_numel + 8) / self.communication_interval

    def branch_key(self, step):
        return step % self.communication_interval == 0

    def reduce(self, flat, layout, state, comm):
        xp = namespace(flat)
        step = self._over_nodes if self.two_level(comm) else self._flat

        def communicate(carry):
            x, w, left, right = carry
            x, left, right = step(x, w, left, right, comm)
            return x, x, left, right

        carry = (xp.astype(flat, xp.float32, copy=False), state.w, state.left, state.right)
        x, w, left, right = every(comm, comm.counter(state.step), self.communication_interval, communicate, carry)
        new_state = LowPrecisionDecentralizedState(step=state.step + 1, w=w, left=left, right=right)
        return xp.astype(x, flat.dtype), new_state

    @staticmethod
    def _flat(x, w, left, right, ring):
        """One exchange on the ring of ``ring``'s ranks: the new ``(x, L, R)``."""
        packed = pack_rows(*quantized_difference(x, w, left, right))
        from_left, from_right = _from_neighbours(packed, ring)
        return apply_differences(w, left, right, *unpack_rows(packed), *unpack_rows(from_left),
                                 *unpack_rows(from_right))

    @staticmethod
    def _over_nodes(x, w, left, right, comm):
        """The exchange on the ring of nodes, each rank of a node carrying one shard of it."""
        xp = namespace(x)
        within = comm.within
        rows = lambda a: xp.reshape(a, (within.size, -1))  # noqa: E731
        mine = lambda a: rows(a)[within.rank, :]  # noqa: E731
        shard = within.reduce_scatter(rows(x), ReduceOp.AVG)
        packed = pack_rows(*quantized_difference(shard, mine(w), mine(left), mine(right)))
        messages = xp.stack([packed, *_from_neighbours(packed, comm.across)])  # (3, 1, k + 8)
        everyone = within.allgather(messages)  # (L, 3, 1, k + 8): every shard's messages
        mine_q, from_left, from_right = (unpack_rows(everyone[:, i, 0, :]) for i in range(3))
        return apply_differences(w, left, right, *mine_q, *from_left, *from_right)


def _from_neighbours(packed, ring):
    """The packed messages from the left and from the right neighbour on ``ring``.

    On a ring of two (two ranks, or two nodes) both neighbours are the same
    rank, so its message travels once instead of twice.
    """
    n = ring.size
    from_left = ring.permute(packed, [(i, (i + 1) % n) for i in range(n)])  # each rank receives its left's
    if n == 2:
        return from_left, from_left
    return from_left, ring.permute(packed, [(i, (i - 1) % n) for i in range(n)])
