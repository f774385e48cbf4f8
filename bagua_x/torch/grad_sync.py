"""Gradient algorithms (``Target.GRAD``): bucketed, zero-copy, overlapped with backward.

Each gradient is a view of its bucket's flat buffer (like DDP's
``gradient_as_bucket_view``), so autograd accumulates straight into the
buffer and communicating it needs no copy.  A post-accumulate-grad hook marks
a parameter ready; when a bucket is complete, BucketDispatcher hands it (in
the same fixed order on every rank) to one communication thread that runs the
algorithm while backward goes on.  At the end of backward the engine waits.

A gradient recreated since the last step (``zero_grad(set_to_none=True)``, a
user assigning ``p.grad``) is no longer a view: its hook copies it into the
buffer once and installs the view again (while backward continues, instead of
delaying the bucket's communication), and the communication thread's
``ensure_flattened`` re-checks the whole bucket, so a stale value is never
communicated and ``p.grad`` always ends as the reduced gradient.

Buckets start in reverse registration order; the first synchronised backward
records the order gradients actually become ready in, communicates only at
its end, after rebuilding the buckets to rank 0's order (:mod:`.bucket_order`).

``no_sync()`` turns the hooks off: gradients accumulate in place and the next
synchronised backward communicates their sum.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from ..algorithms.base import Algorithm, Target
from ..core.bucket import Bucket, BucketLayout
from ..core.comm import ReduceOp
from ..core.readiness import BucketDispatcher
from ..core.tensor import RegisteredTensor
from .bucket_order import ORDER_KEY, agree_on_order, check_order, complete_order, ordered
from .buckets import build_buckets, load_states, register_parameters, state_dict_of
from .checks import check_dense_grad, check_finite, non_finite_tensors
from .communicator import TorchCommunicator
from .distributed import check_same_buckets
from .engine import EngineOptions
from .runtime import BackwardHooks, CommWorker
from .stall import StallInspector

__all__ = ["GradientEngine", "run_reduce", "reduce_bucket"]

log = logging.getLogger(__name__)

def run_reduce(algorithm: Algorithm, flat: torch.Tensor, layout: BucketLayout, state: dict,
               comm: TorchCommunicator) -> dict:
    """``flat <- reduce(flat)``, in place; returns the new state."""
    if algorithm.donates_input:
        with comm.donate(flat):
            out, state = algorithm.reduce(flat, layout, state, comm)
    else:
        out, state = algorithm.reduce(flat, layout, state, comm)
    if out is not flat:
        flat.copy_(out)
    return state


def reduce_bucket(algorithm: Algorithm, bucket: Bucket, flat: torch.Tensor, state: dict, comm: TorchCommunicator,
                  finite: bool, what: str) -> dict:
    """:func:`run_reduce` on one bucket's ``flat`` values, then (``finite``) the check_finite check."""
    local_bad = non_finite_tensors(bucket, flat) if finite else []
    state = run_reduce(algorithm, flat, bucket.layout, state, comm)
    if finite:
        check_finite(bucket, flat, local_bad, what)
    return state


def _grad_bucket(name: str, tensors: list[RegisteredTensor], alignment: int) -> Bucket:
    """A flattened gradient bucket: existing gradients move into its buffer; missing ones stay
    None (as without wrap) and become views when backward produces them."""
    missing = [t for t in tensors if t.proxy.grad is None]
    for t in missing:
        t.ensure_grad()  # temporarily: a bucket is built from its effective tensors
    bucket = Bucket(name, tensors, alignment)
    bucket.flatten()
    for t in missing:
        t.proxy.grad = None
    return bucket


class GradientEngine:
    """Runs a gradient algorithm on bucketed ``p.grad`` during backward."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], algorithm: Algorithm,
                 comm: TorchCommunicator, *, options: EngineOptions):
        assert algorithm.target is Target.GRAD
        self.algorithm, self.comm, self.find_unused = algorithm, comm, options.find_unused_parameters
        self.check_finite, self._cap = options.check_finite, options.bucket_cap_mb
        tensors = register_parameters(named_params, Target.GRAD)
        self._tensors, self._index = tensors, {t.name: i for i, t in enumerate(tensors)}
        # names in ready order during the first synchronised backward; None once the buckets follow it
        self._recorded: Optional[list[str]] = []
        self._order: Optional[list[str]] = None  # the rebuilt buckets' order (None: registration order)
        self._set_buckets(tensors)
        self.enabled = True  # False inside no_sync()
        self._worker = CommWorker("bagua_x-grad-comm", tensors[0].proxy.device, comm.timeout,
                                  StallInspector(comm.group))
        self._hooks = BackwardHooks(tensors, self._on_grad, self._finish, lambda: self.enabled)

    def _set_buckets(self, tensors: Sequence[RegisteredTensor]) -> None:
        """Bucket ``tensors`` in this order (gradients move into the new buffers) with fresh algorithm state."""
        self.buckets: list[Bucket] = build_buckets(tensors, self.algorithm, self.comm.size, self._cap,
                                                   "grad_bucket_", make=_grad_bucket)
        self.states = [self.algorithm.init(b.buffer, b.layout, self.comm.size) for b in self.buckets]
        self._dispatcher = BucketDispatcher(self.buckets, self._launch)
        # each gradient's place in its bucket, as a tensor of its shape: the hooks' fast path compares identity
        self._views = {t.name: t.bucket.buffer[t.offset:t.offset + t.proxy.numel()].view(t.proxy.shape)
                       for t in tensors}
        log.info("bagua_x: %s on %d gradient buckets %s", type(self.algorithm).__name__, len(self.buckets),
                 self.buckets)

    def _on_grad(self, t: RegisteredTensor) -> None:
        """A gradient is final: re-swap it now if it was recreated (its one copy overlaps the rest of
        backward instead of delaying its bucket's communication), then mark it ready.

        This runs once per parameter per step on the training thread, so the usual cases stay
        in a few tensor calls: the gradient is its bucket view (kept gradients), or a new dense
        one of the same shape and dtype (``zero_grad(set_to_none=True)``), copied into the view.
        """
        if self._recorded is not None:
            self._recorded.append(t.name)
        grad, view = t.proxy.grad, self._views[t.name]
        if grad is not view:
            if (grad is not None and grad.layout is torch.strided and grad.dtype == view.dtype
                    and grad.shape == view.shape):
                if grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                t.proxy.grad = view
            else:
                check_dense_grad(t.name, grad)
                t.ensure_grad()  # autograd may leave p.grad None (no gradient flowed); communicate zeros then
                t.set_registered_storage(t.bucket.buffer, t.offset)
        t.mark_ready()

    def _launch(self, bucket: Bucket) -> None:
        if self._recorded is not None:  # first backward: its buckets are communicated after the rebuild
            return
        i = self.buckets.index(bucket)
        self._worker.submit(f"{type(self.algorithm).__name__} on {bucket.name}", lambda: self._reduce(i), bucket)

    def _reduce(self, i: int) -> None:
        bucket = self.buckets[i]
        if any(t.proxy.grad is not self._views[t.name] for t in bucket.tensors):
            bucket.ensure_flattened()  # a gradient replaced after its hook: never communicate a stale value
        self.states[i] = reduce_bucket(self.algorithm, bucket, bucket.buffer, self.states[i], self.comm,
                                       self.check_finite, "gradient")

    def _finish(self) -> None:
        """End of backward: handle unused parameters, rebuild after the first backward, wait for every
        bucket, reset readiness."""
        try:
            without_grad = self._mark_unused() if self.find_unused else None
            if self._recorded is not None:
                self._dispatcher.check_all_dispatched()
                mine = complete_order(self._recorded, self._tensors)
                self._rebuild(agree_on_order(mine, self.comm, self._tensors))
                for t in self._tensors:  # now communicate the first step's gradients in the new buckets
                    t.mark_ready()
            self._worker.wait()
            self._dispatcher.check_all_dispatched()
            if without_grad is not None:  # as DDP: a parameter no rank used keeps p.grad None
                for t, unused in zip(self._tensors, without_grad.tolist()):
                    if unused:
                        t.proxy.grad = None
        finally:
            self._dispatcher.reset()

    def _rebuild(self, order: Optional[list[str]]) -> None:
        """Buckets in ``order``, checked across ranks (None: registration order, and record the next backward's)."""
        self._recorded = None if order is not None else []
        self._order = order
        self._set_buckets(ordered(self._tensors, order))
        check_same_buckets(self.buckets, {"gradient bucket order": "rebuilt" if order else "registration"},
                           self.comm, "bagua_x: gradient buckets rebuilt in ready order differ across ranks",
                           kind="grad_order")

    def _mark_unused(self) -> torch.Tensor:
        """Mark parameters that got no gradient ready (communicating a zero, or a kept, gradient).

        Returns flags, filled on the communication thread after the buckets, saying which
        parameters had no gradient (p.grad None) on every rank.
        """
        had_none = torch.zeros(len(self._tensors), dtype=torch.int32, device=self._tensors[0].proxy.device)
        for t in self._dispatcher.unready_tensors():
            had_none[self._index[t.name]] = int(t.proxy.grad is None)
            self._on_grad(t)
        self._worker.submit("the unused-parameter check",
                            lambda: had_none.copy_(self.comm.allreduce(had_none, ReduceOp.MIN)))
        return had_none

    def settle(self) -> None:
        """Before a forward: end the communication of a backward that raised before its end-of-backward callback."""
        if self._hooks.queued:
            self._hooks.queued = False
            if self._recorded is not None:  # an order cut short: record the next backward's instead
                self._recorded = []
            self._dispatcher.reset()
            self._worker.wait()  # let buckets already launched finish, so collectives stay paired

    def before_forward(self) -> None:
        """Gradients are communicated during backward: nothing starts at forward."""

    def state_dict(self) -> dict:
        """Per-bucket state and, once rebuilt, the buckets' order (so a resumed run has the same buckets)."""
        order = {} if self._order is None else {ORDER_KEY: list(self._order)}
        return {**state_dict_of(self.buckets, self.states), **order}

    def load_state_dict(self, saved: dict) -> None:
        saved = dict(saved)
        order = saved.pop(ORDER_KEY, None)
        if order is not None:
            order = check_order(order, self._tensors, "the checkpoint's gradient bucket order")
        if order != self._order:
            self._rebuild(order)
        load_states(self.buckets, self.states, saved)

    def close(self) -> None:
        self._hooks.remove()
        self._worker.close()
