"""Decentralized SGD: average weights with all ranks or with one rotating peer.

The frontend hands ``reduce`` a copy of the weights taken before forward (so
the exchange overlaps forward and backward); the result replaces the weights
before the optimizer applies the gradient computed at the old weights:
``x <- avg(x_t)``, then ``x <- x - lr * grad f(x_t)``.

``shift_one`` (even world size): after ``s`` communications, rank ``r < N/2``
pairs with ``((s + r) mod ((N+1)//2)) + N/2`` and rank ``r >= N/2`` with
``(r - N/2 - s) mod (N/2)``; the two average their weights.
"""

from __future__ import annotations

import dataclasses

from ..core.comm import ReduceOp
from ..core.errors import BaguaXError
from .base import Algorithm, Phase, Target, counter, every, namespace, ring_allreduce_bytes

__all__ = ["Decentralized", "shift_one_peer", "shift_one_pairs"]


def shift_one_peer(rank: int, size: int, s: int) -> int:
    half = size // 2
    if rank < half:
        return ((s + rank) % ((size + 1) // 2)) + half
    return (rank - half - s) % half


def shift_one_pairs(size: int, s: int) -> list[tuple[int, int]]:
    return [(r, shift_one_peer(r, size, s)) for r in range(size)]


@dataclasses.dataclass(frozen=True)
class Decentralized(Algorithm):
    peer_selection_mode: str = "all"
    communication_interval: int = 1

    target = Target.WEIGHT
    phase = Phase.BEFORE_FORWARD

    @property
    def donates_input(self) -> bool:  # shift_one reads x again after the exchange
        return self.peer_selection_mode == "all"

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
        return {"step": counter(namespace(flat))}

    def wire_bytes(self, layout, itemsize, world_size):
        numel = layout.padded_numel
        if self.peer_selection_mode == "all":
            return ring_allreduce_bytes(numel, itemsize, world_size) / self.communication_interval
        return numel * itemsize / self.communication_interval

    def reduce(self, flat, layout, state, comm):
        step = state["step"]

        def communicate(x):
            if self.peer_selection_mode == "all":
                return comm.allreduce(x, ReduceOp.AVG)
            rounds = (comm.size + 1) // 2
            s = (step // self.communication_interval) % rounds
            branches = [
                (lambda y, k=k: (y + comm.permute(y, shift_one_pairs(comm.size, k))) / 2) for k in range(rounds)
            ]
            return comm.switch(s, branches, x)

        return every(comm, step, self.communication_interval, communicate, flat), {"step": step + 1}
