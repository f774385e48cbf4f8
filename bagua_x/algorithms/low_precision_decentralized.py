"""Low-precision decentralized SGD on a ring (Bagua's algorithm).

Each rank keeps ``w`` (its weights after the last exchange) and ``L``, ``R``
(its estimates of its left and right neighbours' weights), all starting as
copies of ``x``.  After the optimizer step:
``d = x + L/3 + R/3 - 5w/3``; ``q = MinMaxUInt8(d)``; ``q`` goes to both
neighbours; ``L += deQ(q_from_left)``, ``R += deQ(q_from_right)``;
``x <- w + deQ(q)``; ``w <- x``.  Only 8-bit differences travel.
"""

from __future__ import annotations

import dataclasses

from ..core.errors import BaguaXError
from .base import Algorithm, Phase, Target, counter, every, namespace
from .compression import dequantize, pack_rows, quantize, unpack_rows
from .kernels import kernel

__all__ = ["LowPrecisionDecentralized"]


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
class LowPrecisionDecentralized(Algorithm):
    communication_interval: int = 1

    target = Target.WEIGHT
    phase = Phase.AFTER_STEP

    def __post_init__(self):
        if self.communication_interval < 1:
            raise BaguaXError(
                f"LowPrecisionDecentralized: communication_interval must be >= 1, got {self.communication_interval}"
            )

    def init(self, flat, layout, world_size):
        xp = namespace(flat)
        copy = lambda: xp.astype(flat, xp.float32, copy=True)  # noqa: E731
        return {"step": counter(xp), "w": copy(), "left": copy(), "right": copy()}

    def wire_bytes(self, layout, itemsize, world_size):
        return 2 * (layout.padded_numel + 8) / self.communication_interval  # uint8 differences to both neighbours

    def reduce(self, flat, layout, state, comm):
        xp = namespace(flat)
        n = comm.size
        from_left = [(i, (i + 1) % n) for i in range(n)]  # each rank receives its left neighbour's
        from_right = [(i, (i - 1) % n) for i in range(n)]

        def communicate(carry):
            x, w, left, right = carry
            q, mm = quantized_difference(x, w, left, right)
            packed = pack_rows(q, mm)
            x, left, right = apply_differences(w, left, right, q, mm,
                                               *unpack_rows(comm.permute(packed, from_left)),
                                               *unpack_rows(comm.permute(packed, from_right)))
            return x, x, left, right

        carry = (xp.astype(flat, xp.float32, copy=False), state["w"], state["left"], state["right"])
        x, w, left, right = every(comm, state["step"], self.communication_interval, communicate, carry)
        new_state = {"step": state["step"] + 1, "w": w, "left": left, "right": right}
        return xp.astype(x, flat.dtype), new_state
