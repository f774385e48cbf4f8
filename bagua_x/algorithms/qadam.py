"""QAdam: Adam whose first moment, not the gradient, is communicated -- 8-bit compressed.

Step ``t`` (1-based) with ``g = grad + weight_decay * param``:

* warmup (``t <= warmup_steps``): plain Adam on allreduce-averaged gradients,
  ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2``.
* afterwards ``v`` is frozen; each rank updates ``m`` with its local ``g`` and
  the momentum is averaged with ByteGrad's compressed allreduce.

The update is ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.
Bagua counts the switch slightly differently (its last warmup step updates no
moment); here step ``warmup_steps`` is an ordinary Adam step.  Bagua declares
``weight_decay`` but ignores it; here it is Adam's L2 term.

What this file holds and what the frontends add:

* :meth:`QAdam.reduce` is the exchange after warmup -- the momentum bucket
  averaged 8-bit -- and both frontends run it: JAX inside :meth:`QAdam.step`,
  torch on each momentum bucket (the optimizer state is the effective tensor).
* :meth:`QAdam.step` is the whole optimizer on a flat bucket (moments,
  warmup allreduce, :meth:`QAdam.reduce`, bias-corrected update), state in
  :class:`QAdamState`: what JAX's ``dp.optimizer()`` runs.
* torch's ``QAdamOptimizer`` keeps Adam's moments in its own per-parameter
  state (``exp_avg``, ``exp_avg_sq``, as ``torch.optim.Adam``, so the usual
  optimizer state dicts work) and applies the formulas of
  :func:`adam_moments`, :func:`momentum_update` and :func:`adam_direction`
  with torch's in-place multi-tensor ops (9x faster than these functions on
  torch tensors); ``tests/torch/test_torch_qadam.py`` checks it against the
  same numpy reference as :meth:`QAdam.step`'s tests.
  That re-expression, the warmup's gradient allreduce and the switch to
  momentum buckets are torch frontend code (``bagua_x/torch/optim.py``,
  ``bagua_x/torch/engine/momentum.py``).

``hierarchical`` (Bagua's option; by default the faster form, timed, on >= 2 nodes of >= 2 ranks):
both exchanges average inside each node in full precision and only between
nodes run the flat exchange (as :class:`~.bytegrad.ByteGrad` does).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

from ..core.comm import ReduceOp
from ..core.errors import BaguaXError
from .base import Algorithm, EmptyState, NodeAware, Target, compressed_bytes, counter, namespace, over_nodes
from .bytegrad import compressed_average

__all__ = ["QAdam", "QAdamState", "adam_moments", "momentum_update", "adam_direction"]


class QAdamState(NamedTuple):
    """The optimizer state of :meth:`QAdam.step` for one bucket (laid out as it, except the counter)."""

    step: Any  # completed steps (counter)
    m: Any  # Adam's first moment: the communicated tensor after warmup
    v: Any  # Adam's second moment, frozen after warmup


def adam_moments(m, v, g, beta1: float, beta2: float):
    return beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g


def momentum_update(m, g, beta1: float):
    return beta1 * m + (1 - beta1) * g


def adam_direction(m, v, t, lr: float, beta1: float, beta2: float, eps: float):
    """The additive update ``-lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``; ``t`` may be an array."""
    xp = namespace(m)
    tf = xp.astype(t, m.dtype) if hasattr(t, "dtype") else float(t)
    bc1 = 1 - beta1**tf
    bc2 = 1 - beta2**tf
    return -(lr / bc1) * m / (xp.sqrt(v) / bc2**0.5 + eps)


@dataclasses.dataclass(frozen=True)
class QAdam(NodeAware, Algorithm):
    """Adam whose momentum is communicated 8-bit once its variance is frozen after warmup.

    Args:
        lr: the learning rate.
        warmup_steps: steps of Adam on allreduce-averaged gradients before the variance is frozen (>= 1).
        betas: Adam's coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: L2 penalty added to the gradient.
        hierarchical: over nodes (full precision inside each node, the flat algorithm between nodes;
            ``over_nodes``): ``None`` the faster form, timed at set-up, where there are >= 2 nodes of >= 2
            ranks, ``True`` required (refused where the frontend has no node groups), ``False`` flat.
    """

    lr: float = 1e-3
    warmup_steps: int = 100
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    hierarchical: Optional[bool] = None

    target = Target.MOMENTUM
    uses_kernels = True

    def __post_init__(self):
        if self.warmup_steps < 1:
            # v is frozen when warmup ends: with no warmup it stays 0 and every update is ~lr/eps
            raise BaguaXError(
                f"QAdam: warmup_steps={self.warmup_steps}, but QAdam freezes Adam's variance when warmup ends, so "
                "it needs at least one warmup step (with none the variance stays 0 and the first update moves the "
                "weights by about lr/eps); use warmup_steps >= 1, typically 50-1000 (Bagua refuses it too)"
            )
        if not (0 <= self.betas[0] < 1 and 0 <= self.betas[1] < 1) or self.lr < 0:
            raise BaguaXError(
                f"QAdam: need lr >= 0, warmup_steps >= 1 and betas in [0, 1); got lr={self.lr}, "
                f"warmup_steps={self.warmup_steps}, betas={self.betas}"
            )

    def alignment(self, world_size):
        return world_size

    def wire_bytes(self, layout, itemsize, world_size):
        return compressed_bytes(layout.padded_numel, world_size)  # after warmup

    def is_warmup(self, step: int) -> bool:
        """Whether 1-based step ``step`` communicates gradients (True) or momentum."""
        return step <= self.warmup_steps

    def branch_key(self, step):
        return not self.is_warmup(step + 1)

    def init(self, flat, layout, world_size):
        xp = namespace(flat)
        return QAdamState(step=counter(xp), m=xp.zeros_like(flat), v=xp.zeros_like(flat))

    def step(self, grad, param, layout, state, comm):
        """One QAdam step on a flat bucket: returns ``(update, new_state)`` (optax style)."""
        xp = namespace(grad)
        b1, b2 = self.betas
        t = state.step + 1
        g = grad + self.weight_decay * param if self.weight_decay else grad
        two_level = self.two_level(comm)

        def average(x):
            if two_level:
                return over_nodes(x, comm, lambda shard, across: across.allreduce(shard, ReduceOp.AVG))
            return comm.allreduce(x, ReduceOp.AVG)

        def warmup(carry):
            m, v, g = carry
            m, v = adam_moments(m, v, average(g), b1, b2)
            return m, v, g

        def compressed(carry):
            m, v, g = carry
            return self.reduce(momentum_update(m, g, b1), layout, EmptyState(), comm)[0], v, g

        host = comm.counter(state.step)  # for the branch only: t is the traced counter
        after = namespace(host).astype(host + 1 > self.warmup_steps, namespace(host).int32)
        m, v, _ = comm.switch(after, [warmup, compressed], (state.m, state.v, g))
        update = adam_direction(m, v, t, self.lr, b1, b2, self.eps)
        return update, QAdamState(step=t, m=m, v=v)

    def reduce(self, flat, layout, state, comm):
        """After warmup: the momentum bucket ``flat`` averaged 8-bit (ByteGrad's exchange).

        The moments live in :class:`QAdamState` (:meth:`step`) or in torch's
        optimizer, not here: ``state`` is an :class:`~.base.EmptyState`, returned as it is.
        """
        return compressed_average(flat, comm, True, self.two_level(comm)), state
