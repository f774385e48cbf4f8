"""bagua_x's gradient algorithms as a DDP communication hook.

For a codebase that keeps torch's ``DistributedDataParallel`` and only wants
its gradient communication replaced, this has the shape of torch's own
``powerSGD_hook``: a state object and a plain hook function::

    state = bagua_x.torch.CommHookState(ByteGrad())          # collective: every rank
    ddp_model.register_comm_hook(state, bagua_x.torch.comm_hook)

Why a state object plus a function, as torch's ``PowerSGDState`` /
``powerSGD_hook`` (and not a closure): it is the shape DDP and the tools
around it expect (Lightning's ``DDPStrategy(ddp_comm_state=...,
ddp_comm_hook=...)`` passes them through unchanged), and the state is where
the per-bucket algorithm state lives, so it can be saved
(:meth:`CommHookState.algorithm_state_dict`) like any other part of a checkpoint.

DDP calls the hook from backward, in bucket order, on every rank.  The hook
only queues the bucket on one communication thread (FIFO, so collectives keep
that order on every rank) and returns a ``torch.futures.Future`` that the thread
completes: backward goes on while the algorithm communicates, and DDP waits
for the futures at the end of backward.  The thread uses its own process group
(made from DDP's ranks), so its collectives never interleave with the ones DDP
issues itself (buffer broadcasts, the unused-parameter map).

Only gradient algorithms (``target`` GRAD, ``phase`` AFTER_BACKWARD: GradientAllReduce,
ByteGrad) fit in a hook: weight and momentum algorithms act on parameters or
optimizer state after the step, which DDP never hands to a hook; use
:func:`bagua_x.torch.wrap` for those.
"""

import concurrent.futures
import logging
from typing import Optional

import torch
import torch.distributed as dist

from ..algorithms.base import Algorithm, Phase, Target
from ..core.bucket import BucketLayout
from ..core.comm import Feature
from ..core.errors import BaguaXError
from .communicator import TorchCommunicator
from .bucketed import run_reduce

__all__ = ["CommHookState", "comm_hook"]

log = logging.getLogger(__name__)


def apply_algorithm(algorithm: Algorithm, flat: torch.Tensor, layout: BucketLayout, state: Optional[dict],
                    comm: TorchCommunicator) -> dict:
    """``flat <- algorithm.reduce(flat)`` in place, building the state first if ``state`` is None."""
    if state is None:
        state = algorithm.init(flat, layout, comm.size)
    return run_reduce(algorithm, flat, layout, state, comm)


def bucket_layout(bucket: dist.GradBucket, alignment: int) -> BucketLayout:
    """The layout of a DDP bucket: its gradients back to back, named by bucket and position (DDP keeps no names)."""
    grads = bucket.gradients()
    return BucketLayout([f"bucket {bucket.index()} tensor {i}" for i in range(len(grads))],
                        [tuple(g.shape) for g in grads], str(bucket.buffer().dtype).replace("torch.", ""), alignment)


def _check_fits_a_hook(algorithm: Algorithm) -> None:
    name = type(algorithm).__name__
    if algorithm.target is not Target.GRAD or algorithm.phase is not Phase.AFTER_BACKWARD:
        raise BaguaXError(
            f"{name} communicates the {algorithm.target.value} ({algorithm.phase.value}), but a DDP comm hook only "
            "sees gradient buckets during backward; use bagua_x.torch.wrap(model, optimizer, algorithm=...) "
            "instead of DDP for it"
        )
    if Feature.HIERARCHICAL in algorithm.requires:  # hierarchical=None runs flat in a hook
        raise BaguaXError(
            f"{name}(hierarchical=True) needs bagua_x.torch.wrap's node process groups, which a DDP comm hook "
            "does not have; pass hierarchical=None or False (flat), or use bagua_x.torch.wrap"
        )


class CommHookState:
    """The state of :func:`comm_hook`: the algorithm, its per-bucket state and its communication thread.

    Collective: create it on every rank, after ``init_process_group`` and with
    the same ``process_group`` as the DDP model (``None``: the default group).
    """

    def __init__(self, algorithm: Algorithm, process_group: Optional[dist.ProcessGroup] = None):
        _check_fits_a_hook(algorithm)
        if not dist.is_initialized():
            raise BaguaXError("CommHookState needs torch.distributed: call torch.distributed.init_process_group() "
                              "first (the same group DDP uses)")
        self.algorithm = algorithm
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        self.comm = TorchCommunicator(dist.new_group(ranks, backend=dist.get_backend(process_group)))
        #: DDP bucket index -> (padded length, algorithm state)
        self.buckets: "dict[int, tuple[int, dict]]" = {}
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bagua_x-comm-hook")

    def submit(self, bucket: dist.GradBucket) -> "torch.futures.Future[torch.Tensor]":
        """Queue ``bucket`` on the communication thread; the future gets its reduced buffer."""
        fut = torch.futures.Future()
        layout = bucket_layout(bucket, self.algorithm.alignment(self.comm.size))
        self._thread.submit(self._reduce, bucket.index(), bucket.buffer(), layout, fut)
        return fut

    def _reduce(self, index: int, buffer: torch.Tensor, layout: BucketLayout, fut: torch.futures.Future) -> None:
        try:
            padded = layout.padded_numel - buffer.numel()
            flat = torch.cat([buffer, buffer.new_zeros(padded)]) if padded else buffer
            numel, state = self.buckets.get(index, (flat.numel(), None))
            if numel != flat.numel():  # DDP rebuilt its buckets (after its first step, in gradient order)
                log.info("bagua_x comm hook: bucket %d changed size (%d -> %d elements); new algorithm state",
                         index, numel, flat.numel())
                state = None
            self.buckets[index] = (flat.numel(), apply_algorithm(self.algorithm, flat, layout, state, self.comm))
            if padded:
                buffer.copy_(flat[:buffer.numel()])
            fut.set_result(buffer)
        except BaseException as e:  # noqa: BLE001 -- DDP re-raises it from the future at the end of backward
            fut.set_exception(BaguaXError(
                f"bagua_x comm hook: {type(self.algorithm).__name__} on DDP bucket {index} failed: "
                f"{type(e).__name__}: {e}"
            ))

    def algorithm_state_dict(self) -> dict:
        """Per-bucket algorithm state (copies), keyed by DDP bucket index: ``{"numel": n, "state": {...}}``."""
        return {i: {"numel": n, "state": {k: _copy(v) for k, v in s.items()}} for i, (n, s) in self.buckets.items()}

    def load_algorithm_state_dict(self, saved: dict) -> None:
        self.buckets = {int(i): (int(b["numel"]), {k: _copy(v) for k, v in b["state"].items()})
                        for i, b in saved.items()}

    def close(self) -> None:
        """Stop the communication thread (after the last backward)."""
        self._thread.shutdown(wait=True)


# annotations evaluated (no ``from __future__ import annotations``): DDP's register_comm_hook checks them
def comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook running ``state.algorithm`` on each gradient bucket.

    ``ddp_model.register_comm_hook(CommHookState(ByteGrad()), comm_hook)``.
    """
    return state.submit(bucket)


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v
