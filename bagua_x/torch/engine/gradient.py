"""Gradient algorithms (``Target.GRAD``): bucketed, zero-copy, overlapped with backward.

Each gradient is a view of its bucket's flat buffer (like DDP's
``gradient_as_bucket_view``), so autograd accumulates straight into the
buffer and communicating it needs no copy.  A post-accumulate-grad hook marks
a parameter ready; when a bucket is complete, ReadyCounts releases it (in
the same fixed order on every rank) to one communication thread that runs the
algorithm while backward goes on.  On CUDA the thread's stream first waits
for an event recorded in the hook on the stream that produced the gradients,
and at the end of backward the caller's stream waits for the thread's stream
(:class:`~.comm_thread.CommWorker`): the optimizer never reads a gradient the
collective is still writing, and nothing blocks the host.

A gradient recreated since the last step (``zero_grad(set_to_none=True)``, a
user assigning ``p.grad``) is no longer a view: its hook, the one place that
checks, copies it into the buffer once and installs the view again (while
backward continues, instead of delaying the bucket's communication), so a
stale value is never communicated and ``p.grad`` always ends as the reduced
gradient.

Buckets start in reverse registration order; the first synchronised backward
records the order gradients actually become ready in
(:class:`~.ready_order.OrderRecorder`), communicates only at its end, after
rebuilding the buckets to rank 0's order (:mod:`.ready_order`).

``no_sync()`` turns the hooks off: gradients accumulate in place and the next
synchronised backward communicates their sum.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from ...algorithms.base import Algorithm, Target, initial_state
from ...core.bucket import Bucket
from ...core.comm import ReduceOp
from ...core.tensor import RegisteredTensor
from .. import streams
from ..checks import check_dense_grad
from ..communicator import TorchCommunicator
from ..distributed import check_same_buckets
from .backward import BackwardEngine
from .interface import EngineOptions
from .ready_order import ORDER_KEY, OrderRecorder, check_order, ordered
from .registration import build_buckets, register_parameters

__all__ = ["GradientEngine"]

log = logging.getLogger(__name__)


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


class GradientEngine(BackwardEngine):
    """Runs a gradient algorithm on bucketed ``p.grad`` during backward."""

    tensor_kind = "gradient"

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]], algorithm: Algorithm,
                 comm: TorchCommunicator, *, options: EngineOptions):
        assert algorithm.target is Target.GRAD
        tensors = register_parameters(named_params, Target.GRAD)
        super().__init__(tensors, algorithm, comm, options, "bagua_x-grad-comm")
        self._cap = options.bucket_cap_mb
        self._recorder = OrderRecorder()
        if options.replicas is not None:  # every node, restarted ones too, must lay its buckets out the same
            self._recorder.stop()
        self._order: Optional[list[str]] = None  # the rebuilt buckets' order (None: registration order)
        self._without_grad: Optional[torch.Tensor] = None
        self._views: list[torch.Tensor] = []  # by tensor index: its place in its bucket, as a tensor of its shape
        self._build(tensors)

    def _plan(self, tensors: Sequence[RegisteredTensor]) -> list[list[str]]:
        """The tensor names of each bucket :meth:`_build` would make from ``tensors``."""
        return build_buckets(tensors, self.algorithm, self.comm.size, self._cap, "grad_bucket_",
                             make=lambda name, members, alignment: [t.name for t in members])

    def _build(self, tensors: Sequence[RegisteredTensor]) -> None:
        """Bucket ``tensors`` in this order (gradients move into the new buffers) with fresh algorithm state.

        Old buffers are released one by one first (their gradients copied out), so a rebuild
        holds the gradients once plus one bucket, not in two full sets of buffers.  The cached
        views go first: each one keeps its old buffer alive.
        """
        self._views = []
        for bucket in self.buckets:
            for t in bucket.tensors:
                if t.proxy.grad is not None:
                    t.proxy.grad = t.proxy.grad.clone()
            bucket.buffer = None
        buckets = build_buckets(tensors, self.algorithm, self.comm.size, self._cap, "grad_bucket_",
                                make=_grad_bucket)
        self._set_slots(self._slots(buckets, [initial_state(self.algorithm, b.buffer, b.layout, self.comm.size)
                                              for b in buckets]))
        # the hooks' fast path compares identity with these
        self._views = [t.bucket.buffer[t.offset:t.offset + t.proxy.numel()].view(t.proxy.shape)
                       for t in self._tensors]
        log.info("bagua_x: %s on %d gradient buckets %s", type(self.algorithm).__name__, len(self.buckets),
                 self.buckets)

    def _hook(self, i: int, param: Optional[torch.Tensor] = None) -> None:
        """Tensor ``i``'s post-accumulate-grad hook (``param`` given: it counts this firing and goes on
        only at the last one, outside ``no_sync()``), and :meth:`_on_ready`'s body (``param`` None).

        When the gradient is final: re-swap it if it was recreated (its one copy overlaps the rest of
        backward instead of delaying its bucket's communication), then launch the buckets it
        completes.  This is every gradient's first frame, and :meth:`CommWorker.submit` its second:
        the two methods of :class:`BackwardEngine` it stands for are inline here, since it runs once
        per parameter per step on the training thread.  For the same reason the usual cases stay in
        a few tensor calls: the gradient is its bucket view (kept gradients), or a new dense one of
        the same shape and dtype (``zero_grad(set_to_none=True)``), copied into the view.  While the
        first backward is recorded, buckets are only counted (every gradient must come): they are
        communicated after the rebuild.
        """
        if param is not None:
            if not self.enabled:
                return
            self._hooks.arm()
            if not self._ready.fire(i):
                return
        t = self._tensors[i]
        grad, view = t.proxy.grad, self._views[i]
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
        if self._recorder.recording:
            self._recorder.record(t.name)
            self._ready.ready(i)
        else:  # _mark_ready, inline
            for k in self._ready.ready(i):
                slot = self.slots[k]
                self._worker.submit(slot.job, self._job(slot, slot.bucket.buffer), slot.bucket)

    def _on_ready(self, i: int) -> None:
        """Tensor ``i``'s gradient is final (at the end of backward): :meth:`_hook`'s work without its count."""
        self._hook(i)

    def _before_wait(self) -> None:
        """Handle unused parameters; after the first backward, rebuild the buckets and launch them all."""
        self._without_grad = self._mark_unused() if self.find_unused else None
        if self._recorder.recording:
            self._ready.check_all_launched(self._frozen)  # every gradient came (else the error names the missing ones)
            self._rebuild(self._recorder.agree(self.comm, self._tensors))
            self._ready.reset()  # the counts of the recorded backward (the buckets may be the same)
            for i in range(len(self._tensors)):  # now communicate the first step's gradients in the new buckets
                self._mark_ready(i)

    def _after_wait(self) -> None:
        without_grad, self._without_grad = self._without_grad, None
        if without_grad is not None:  # as DDP: a parameter no rank used keeps p.grad None
            for t, unused in zip(self._tensors, without_grad.tolist()):
                if unused:
                    t.proxy.grad = None

    def _rebuild(self, order: Optional[list[str]]) -> None:
        """Buckets in ``order``, checked across ranks (None: registration order, and record the next backward's)."""
        if order is None:
            self._recorder.restart()
        else:
            self._recorder.stop()
        self._order = order
        tensors = ordered(self._tensors, order)
        if self._plan(tensors) != [[t.name for t in b.tensors] for b in self.buckets]:
            self._build(tensors)  # else the buckets are already these, and their state still fresh or loaded
        check_same_buckets(self.buckets, {"gradient bucket order": "rebuilt" if order else "registration"},
                           self.comm.group, self.comm.timeout,
                           "bagua_x: gradient buckets rebuilt in ready order differ across ranks",
                           kind="grad_order")

    def _mark_unused(self) -> torch.Tensor:
        """Mark parameters that got no gradient ready (communicating a zero, or a kept, gradient).

        Returns flags, filled on the communication thread after the buckets, saying which
        parameters had no gradient (p.grad None) on every rank.
        """
        had_none = torch.zeros(len(self._tensors), dtype=torch.int32, device=self._tensors[0].proxy.device)
        for i in self._ready.unready():
            had_none[i] = int(self._tensors[i].proxy.grad is None)
            self._on_ready(i)
        streams.keep_for(had_none, self._worker.stream)  # made on this stream, used on the communication one
        self._worker.submit("the unused-parameter check",
                            lambda: had_none.copy_(self.comm.allreduce(had_none, ReduceOp.MIN)))
        return had_none

    def settle(self) -> None:
        if self._hooks.queued and self._recorder.recording:  # an order cut short: record the next backward's
            self._recorder.restart()
        super().settle()

    def state_dict(self) -> dict:
        """Per-bucket state and, once rebuilt, the buckets' order (so a resumed run has the same buckets)."""
        order = {} if self._order is None else {ORDER_KEY: list(self._order)}
        return {**super().state_dict(), **order}

    def load_state_dict(self, saved: dict) -> None:
        saved = dict(saved)
        order = saved.pop(ORDER_KEY, None)
        if order is not None:
            order = check_order(order, self._tensors, "the checkpoint's gradient bucket order")
        if order != self._order:
            self._rebuild(order)
        super().load_state_dict(saved)
