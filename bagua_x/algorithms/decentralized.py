"""Decentralized SGD: average weights with all ranks or with one rotating peer.

The frontend hands ``reduce`` a copy of the weights taken before forward (so
the exchange overlaps forward and backward); the result replaces the weights
before the optimizer applies the gradient computed at the old weights:
``x <- avg(x_t)``, then ``x <- x - lr * grad f(x_t)``.

``shift_one`` (even world size): after ``s`` communications, rank ``r < N/2``
pairs with ``((s + r) mod ((N+1)//2)) + N/2`` and rank ``r >= N/2`` with
``(r - N/2 - s) mod (N/2)``; the two average their weights.

``hierarchical`` (Bagua's option; by default the faster form, timed, on >= 2 nodes of >= 2 ranks):
weights are averaged inside each node first, then the nodes play the ranks'
part above (``shift_one`` pairs nodes, so their number must be even), and every
rank of a node ends with the node's result (:func:`~.base.over_nodes`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

from ..core.comm import ReduceOp
from ..core.errors import BaguaXError
from .base import Algorithm, NodeAware, Phase, Target, counter, every, namespace, over_nodes, ring_allreduce_bytes

__all__ = ["Decentralized", "DecentralizedState", "shift_one_peer", "shift_one_pairs"]


class DecentralizedState(NamedTuple):
    step: Any  # communications so far (counter): picks the interval's steps and shift_one's peer


def shift_one_peer(rank: int, size: int, s: int) -> int:
    half = size // 2
    if rank < half:
        return ((s + rank) % ((size + 1) // 2)) + half
    return (rank - half - s) % half


def shift_one_pairs(size: int, s: int) -> list[tuple[int, int]]:
    return [(r, shift_one_peer(r, size, s)) for r in range(size)]


@dataclasses.dataclass(frozen=True)
class Decentralized(NodeAware, Algorithm):
    """Decentralized SGD: weights averaged with all ranks or one peer, overlapped with forward and backward.

    Args:
        peer_selection_mode: ``"all"`` (allreduce mean) or ``"shift_one"`` (average with one peer that
            changes every communication; an even number of ranks).
        communication_interval: communicate every this many steps.
        hierarchical: over nodes (full precision inside each node, the flat algorithm between nodes;
            ``over_nodes``): ``None`` the faster form, timed at set-up, where there are >= 2 nodes of >= 2
            ranks, ``True`` required (refused where the frontend has no node groups), ``False`` flat.
    """

    peer_selection_mode: str = "all"
    communication_interval: int = 1
    hierarchical: Optional[bool] = None

    target = Target.WEIGHT
    phase = Phase.BEFORE_FORWARD

    @property
    def donates_input(self) -> bool:  # shift_one reads x again after the exchange
        return self.peer_selection_mode == "all"

    def alignment(self, world_size):
        return 1 if self.hierarchical is False else world_size  # over_nodes shards the bucket

    def __post_init__(self):
        if self.peer_selection_mode not in ("all", "shift_one"):
            raise BaguaXError(
                f"Decentralized: peer_selection_mode must be 'all' or 'shift_one', got {self.peer_selection_mode!r}"
            )
        if self.communication_interval < 1:
            raise BaguaXError(f"Decentralized: communication_interval must be >= 1, got {self.communication_interval}")

    def init(self, flat, layout, world_size):
        if self.peer_selection_mode == "shift_one" and world_size % 2:
            raise BaguaXError(
                f"Decentralized(peer_selection_mode='shift_one') needs an even number of ranks (it pairs them), "
                f"got {world_size}; use peer_selection_mode='all' instead"
            )
        return DecentralizedState(step=counter(namespace(flat)))

    def wire_bytes(self, layout, itemsize, world_size):
        numel = layout.padded_numel
        if self.peer_selection_mode == "all":
            return ring_allreduce_bytes(numel, itemsize, world_size) / self.communication_interval
        return numel * itemsize / self.communication_interval

    def reduce(self, flat, layout, state, comm):
        step = state.step

        def exchange(x, ranks):
            if self.peer_selection_mode == "all":
                return ranks.allreduce(x, ReduceOp.AVG)
            if ranks.size % 2:
                raise BaguaXError(
                    f"Decentralized(peer_selection_mode='shift_one', hierarchical) pairs nodes, so it needs an even "
                    f"number of them, got {ranks.size}; pass hierarchical=False to pair ranks instead"
                )
            rounds = (ranks.size + 1) // 2
            s = (step // self.communication_interval) % rounds
            branches = [
                (lambda y, k=k: (y + ranks.permute(y, shift_one_pairs(ranks.size, k))) / 2) for k in range(rounds)
            ]
            return ranks.switch(s, branches, x)

        if self.two_level(comm):
            communicate = lambda x: over_nodes(x, comm, exchange)  # noqa: E731
        else:
            communicate = lambda x: exchange(x, comm)  # noqa: E731
        return (every(comm, comm.counter(step), self.communication_interval, communicate, flat),
                DecentralizedState(step=step + 1))

    def branch_key(self, step):
        """Whether the step communicates; which peer a ``shift_one`` step pairs with stays traced (one program
        per peer would be compiled for as many peers as there are ranks)."""
        return step % self.communication_interval == 0
