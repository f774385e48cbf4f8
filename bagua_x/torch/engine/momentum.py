"""QAdam for torch: the engine that communicates the momentum of :class:`~..optim.QAdamOptimizer`.

During warmup QAdam is Adam on allreduce-averaged gradients, so the engine is
the ordinary gradient engine.  Once warmup ends (the same step on every rank)
the gradient buckets are dropped and each parameter's ``exp_avg`` becomes the
effective tensor: getter ``opt.state[p]["exp_avg"]``, setter assigns it, and
flattening moves the optimizer state into the bucket buffers.  In backward,
each parameter's hook updates its momentum with the local gradient and marks
it ready; ready buckets are averaged with ByteGrad's 8-bit compressed
allreduce on the communication thread; ``step()`` then applies Adam's update
with the averaged momentum and the frozen second moment.  The arithmetic is
the framework-free code of :mod:`bagua_x.algorithms.qadam`.

The phase follows the optimizer's ``step_id`` at each forward, so loading an
optimizer state dict (from warmup or after it) switches either way; the
momentum buckets are checked across ranks when they are built (through the
store, bounded by wrap's timeout), and a reloaded ``exp_avg`` is re-swapped
into its bucket at the next communication.
"""

from __future__ import annotations

import logging
from typing import Sequence, Union

import torch

from ...algorithms import EmptyState, GradientAllReduce, QAdam
from ...core.bucket import Bucket
from ...core.errors import BaguaXError
from ...core.tensor import TensorRegistry
from ..communicator import TorchCommunicator
from ..distributed import check_same_buckets
from ..optim import QAdamOptimizer
from .backward import BackwardEngine
from .gradient import GradientEngine
from .interface import EngineOptions
from .registration import build_buckets

__all__ = ["MomentumEngine", "MomentumBuckets"]

log = logging.getLogger(__name__)


class MomentumEngine:
    """Gradient allreduce during warmup, then compressed momentum buckets (see module docstring).

    Each phase is an engine of its own (a :class:`GradientEngine`, then a
    :class:`MomentumBuckets`); this one switches between them at forward and
    hands every other call to the current one.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], algorithm: QAdam,
                 comm: TorchCommunicator, *, options: EngineOptions):
        optimizer = options.optimizer
        if not isinstance(optimizer, QAdamOptimizer):
            raise BaguaXError(
                "QAdam communicates the optimizer's momentum, so wrap() needs the QAdamOptimizer: "
                "opt = bagua_x.torch.QAdamOptimizer(model.parameters(), lr=...); wrap(model, opt)"
            )
        if algorithm != optimizer.algorithm:
            raise BaguaXError(
                f"algorithm {algorithm} differs from the optimizer's {optimizer.algorithm}; "
                "pass algorithm=None (or optimizer.algorithm) to use the optimizer's settings"
            )
        self.algorithm, self.comm, self.optimizer, self.options = algorithm, comm, optimizer, options
        self._named = list(named_params)
        self._enabled = True
        self._earlier_steps = 0  # synced_steps of the phases before this one
        self._phase: Union[GradientEngine, MomentumBuckets] = self._start_phase(optimizer.in_warmup)

    def _start_phase(self, warmup: bool) -> Union[GradientEngine, "MomentumBuckets"]:
        if warmup:
            phase = GradientEngine(self._named, GradientAllReduce(hierarchical=self.algorithm.hierarchical),
                                   self.comm, options=self.options)
        else:
            phase = MomentumBuckets(self._named, self.algorithm, self.comm, self.options, self.optimizer)
        phase.enabled = self._enabled
        return phase

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = self._phase.enabled = value

    @property
    def buckets(self) -> list[Bucket]:
        return self._phase.buckets

    @property
    def synced_steps(self) -> int:
        return self._earlier_steps + self._phase.synced_steps

    def settle(self) -> None:
        self._phase.settle()

    def before_forward(self) -> None:
        """The switch: follow the optimizer's ``step_id`` (either way: a loaded state may go back to warmup)."""
        warmup = self.optimizer.in_warmup
        if warmup == isinstance(self._phase, GradientEngine):
            return
        log.info("bagua_x QAdam: %s at step %d", "optimizer back in warmup; communicating gradients again" if warmup
                 else "warmup over; communicating 8-bit momentum", self.optimizer.step_id)
        self._phase.close()
        self._earlier_steps += self._phase.synced_steps
        self._phase = self._start_phase(warmup)

    def after_forward(self, outputs) -> None:
        self._phase.after_forward(outputs)

    def weights_locked(self):
        return self._phase.weights_locked()

    def state_dict(self) -> dict:
        """QAdam's state is the optimizer's own (``optimizer.state_dict()``, step counter included)."""
        return {}

    def load_state_dict(self, saved: dict) -> None:
        """Nothing to load: a reloaded optimizer state is re-swapped into the buckets at the next step."""

    def close(self) -> None:
        self._phase.close()


class MomentumBuckets(BackwardEngine):
    """After warmup: each parameter's ``exp_avg`` is the effective tensor, updated in its backward hook
    and averaged 8-bit by :meth:`QAdam.reduce` bucket by bucket."""

    tensor_kind = "momentum"

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], algorithm: QAdam,
                 comm: TorchCommunicator, options: EngineOptions, optimizer: QAdamOptimizer):
        registry = TensorRegistry()
        tensors = [
            registry.register(name, p, lambda p: optimizer.state[p]["exp_avg"],
                              lambda p, t: optimizer.state[p].__setitem__("exp_avg", t))
            for name, p in reversed(named_params) if p.requires_grad
        ]
        self._groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        missing = [t.name for t in tensors if id(t.proxy) not in self._groups]
        if missing:
            raise BaguaXError(f"parameters {missing} are not in the QAdamOptimizer; give it model.parameters()")
        buckets = build_buckets(tensors, algorithm, comm.size, options.bucket_cap_mb, "momentum_bucket_")
        # buckets are rebuilt here, mid-training: check that every rank rebuilt the same ones at the same step
        check_same_buckets(buckets, {"QAdam warmup over at step": optimizer.step_id}, comm.group, comm.timeout,
                           "bagua_x QAdam: momentum buckets built at the end of warmup differ across ranks")
        for b in buckets:
            b.flatten()
        super().__init__(tensors, algorithm, comm, options, "bagua_x-momentum-comm")
        self.optimizer = optimizer
        self._set_slots(self._slots(buckets, [EmptyState() for _ in buckets]))  # QAdam.reduce keeps no state: the optimizer has it

    @torch.no_grad()
    def _on_ready(self, i: int) -> None:
        t = self._tensors[i]
        p = t.proxy
        group = self._groups[id(p)]
        if not t.is_view_of(t.bucket.buffer, t.offset, t.bucket.itemsize):
            t.bucket.ensure_flattened()  # a reloaded exp_avg: copied into the bucket once, its view installed
        m = t.effective()
        beta1 = group["betas"][0]
        m.mul_(beta1)  # in place, as the optimizer's warmup step: no temporaries on the backward's critical path
        if p.grad is not None:  # an unused parameter keeps decaying its momentum with a zero gradient
            m.add_(self.optimizer.decayed_grad(p, group), alpha=1 - beta1)
        self._mark_ready(i)
