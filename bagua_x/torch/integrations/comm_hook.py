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
the algorithm state lives, so it can be saved
(:meth:`CommHookState.algorithm_state_dict`) like any other part of a checkpoint.

DDP decides the buckets: its first step runs on buckets in parameter order,
then it regroups them once in gradient order, and a fresh DDP after a resume
starts from the first grouping again.  So the state follows the tensors, not
the bucket index: each parameter is known by its position in the first step's
buckets (the same in every run of the same model), and when a bucket's
tensors change, their states are cut out of the old buckets
(``Algorithm.split_state``) and joined into the new one.  A checkpoint holds
the state per parameter position and resumes bitwise, whichever grouping
comes next.

DDP calls the hook from backward, in bucket order, on every rank.  The hook
only queues the bucket on one communication thread (a
:class:`~..engine.comm_thread.CommWorker`: FIFO, so collectives keep that order on every
rank) and returns a ``torch.futures.Future`` that the thread completes:
backward goes on while the algorithm communicates, and DDP waits for the
futures at the end of backward.  On CUDA the thread runs on a stream of its
own, after an event recorded on the stream DDP called the hook on, and the
future is CUDA-aware (:func:`..streams.future`): completed while that stream is
current, so DDP's stream waits for the reduction without a host sync.  The thread uses its own process group
(made from DDP's ranks), so its collectives never interleave with the ones DDP
issues itself (buffer broadcasts, the unused-parameter map).

Bounds, ``timeout`` seconds (as ``wrap(timeout=...)``; default the process
group's): a collective still running on the device past its deadline (NCCL
returns at once, so the thread polls an event recorded after it) breaks the
thread: every later bucket is skipped there and fails its future with the
report, which DDP raises at the end of that backward.  A bucket whose
reduction raised (gloo's timeout, a failed check) breaks it too: the step's
later buckets are skipped (not one timeout each), and every later hook call
raises the BaguaXError from backward.  The run-ahead bound of ``wrap``
(:meth:`~..engine.comm_thread.CommWorker.run_ahead`), since DDP never waits for the thread
itself: each step's first bucket waits (polling an event, no host sync) for the
communication of the step before the last, so on CUDA a collective stuck on the
device raises the report from backward at its deadline instead of letting the
host queue work until a kernel launch blocks in C.

Only gradient algorithms (``target`` GRAD, ``phase`` AFTER_BACKWARD: GradientAllReduce,
ByteGrad, PowerSGD) fit in a hook: weight and momentum algorithms act on parameters or
optimizer state after the step, which DDP never hands to a hook; use
:func:`bagua_x.torch.wrap` for those.
"""

import datetime
import logging
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from ...algorithms.base import Algorithm, Phase, Target, initial_state, state_from_dict
from ...core.bucket import BucketLayout
from ...core.comm import Feature
from ...core.errors import BaguaXError
from .. import kernels, streams
from ..communicator import TorchCommunicator
from ..distributed import private_group
from ..engine.comm_thread import BucketSlot, CommWorker, reduce_in_place
from ..engine.registration import keep_state_for
from ..store import resolve_timeout

__all__ = ["CommHookState", "comm_hook"]

log = logging.getLogger(__name__)


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
    ``timeout`` (seconds or a timedelta; default the group's own) bounds each
    bucket's collective on the device (see the module docstring).
    """

    def __init__(self, algorithm: Algorithm, process_group: Optional[dist.ProcessGroup] = None,
                 timeout: Union[None, float, datetime.timedelta] = None):
        _check_fits_a_hook(algorithm)
        if not dist.is_initialized():
            raise BaguaXError("CommHookState needs torch.distributed: call torch.distributed.init_process_group() "
                              "first (the same group DDP uses)")
        self.algorithm = algorithm
        timeout = resolve_timeout(timeout, process_group)
        self.comm = TorchCommunicator(private_group(process_group, timeout), timeout=timeout)
        kernels.install()  # as wrap does where every rank can compile (here a failure falls back per rank)
        #: DDP bucket index -> (its parameters' positions, its layout, its algorithm state)
        self.buckets: "dict[int, tuple[tuple[int, ...], BucketLayout, NamedTuple]]" = {}
        #: parameter position -> its state while in no bucket (left behind by DDP's regrouping: a NamedTuple;
        #: loaded: the saved dict, typed when its parameter's bucket comes)
        self._loose: "dict[int, Union[NamedTuple, dict]]" = {}
        self._positions: "dict[int, int]" = {}  # id(parameter) -> position, in the order the hook first sees them
        self._parameters: "list[torch.Tensor]" = []  # kept alive, so no other tensor takes their ids
        self._worker: Optional[CommWorker] = None  # started at the first bucket, on the gradients' device
        self._failed: Optional[BaguaXError] = None  # a bucket's failure: every later hook call raises it

    def submit(self, bucket: dist.GradBucket) -> "torch.futures.Future[torch.Tensor]":
        """Queue ``bucket`` on the communication thread; the future gets its reduced buffer."""
        index, buffer = bucket.index(), bucket.buffer()
        if self._worker is None:
            self._worker = CommWorker("bagua_x-comm-hook", buffer.device, self.comm.timeout)
        if self._failed is not None:  # the process group is broken: say so here, not in another collective
            raise BaguaXError(f"{self._failed}; so this hook cannot communicate any more: exit and restart from "
                              "a checkpoint (torchrun --max-restarts restarts all ranks)") from self._failed
        if index == 0:  # a step's first bucket (DDP calls the hook in bucket order)
            self._worker.run_ahead()
        fut = streams.future(buffer.device)
        layout = bucket_layout(bucket, self.algorithm.alignment(self.comm.size))
        keys = self._keys(bucket)
        self._worker.submit(f"DDP bucket {index}", lambda: self._reduce(index, keys, buffer, layout, fut),
                            skipped=fut.set_exception)
        return fut

    def _keys(self, bucket: dist.GradBucket) -> "tuple[int, ...]":
        """The positions of the bucket's parameters.  DDP calls the hook in bucket order, so the first step
        numbers its first grouping's parameters in order: the same numbers in every run of the model."""
        keys = []
        for p in bucket.parameters():
            if id(p) not in self._positions:
                self._positions[id(p)] = len(self._parameters)
                self._parameters.append(p)
            keys.append(self._positions[id(p)])
        return tuple(keys)

    def _reduce(self, index: int, keys: "tuple[int, ...]", buffer: torch.Tensor, layout: BucketLayout,
                fut: torch.futures.Future) -> None:
        """On the communication thread, its stream current (so ``set_result`` hands DDP that stream's work)."""
        try:
            padded = layout.padded_numel - buffer.numel()
            flat = torch.cat([buffer, buffer.new_zeros(padded)]) if padded else buffer
            state = self._state(index, keys, flat, layout)
            slot = BucketSlot(layout, state, f"DDP bucket {index}")
            reduce_in_place(self.algorithm, flat, slot, self.comm)
            self.buckets[index] = (keys, layout, slot.state)
            if padded:
                buffer.copy_(flat[:buffer.numel()])
            fut.set_result(buffer)
        except BaseException as e:  # noqa: BLE001 -- DDP re-raises it from the future at the end of backward
            self._failed = BaguaXError(
                f"bagua_x comm hook: {type(self.algorithm).__name__} on DDP bucket {index} failed: "
                f"{type(e).__name__}: {e}"
            )
            fut.set_exception(self._failed)
            raise self._failed from e  # the thread skips this step's later buckets (their futures fail with it)

    def _state(self, index: int, keys: "tuple[int, ...]", flat: torch.Tensor, layout: BucketLayout) -> NamedTuple:
        """The bucket's algorithm state: kept if it holds the same parameters as last time, else joined from its
        parameters' states, wherever they are (a fresh state for a parameter that has none)."""
        kept = self.buckets.get(index)
        if kept is not None and kept[0] == keys:
            return kept[2]
        for i, (old_keys, old_layout, old_state) in list(self.buckets.items()):
            if i == index or not set(old_keys).isdisjoint(keys):  # cut up: these parameters move
                del self.buckets[i]
                self._loose.update(zip(old_keys, self.algorithm.split_state(old_state, old_layout)))
        if kept is not None:
            log.info("bagua_x comm hook: DDP bucket %d now holds parameters %s; their states follow them", index,
                     list(keys))
        fresh = self.algorithm.split_state(initial_state(self.algorithm, flat, layout, self.comm.size), layout)
        pieces = []
        for key, new in zip(keys, fresh):
            piece = self._loose.pop(key, new)
            if isinstance(piece, dict):  # loaded: copied on the training thread's stream, read on this one
                piece = keep_state_for(state_from_dict(new, piece, f"parameter {key}"), self._worker.stream)
            piece = type(new)(*(_like(v, fresh_v) for v, fresh_v in zip(piece, new)))
            if _shapes(piece) != _shapes(new):
                raise BaguaXError(
                    f"the loaded state of parameter {key} has shapes {_shapes(piece)}, but this DDP model and "
                    f"{type(self.algorithm).__name__}'s settings need {_shapes(new)}: the checkpoint was saved for "
                    "another model or other settings; load it into the same ones, or do not load the hook state"
                )
            pieces.append(piece)
        return self.algorithm.join_state(pieces, layout)

    def algorithm_state_dict(self) -> dict:
        """The algorithm state per parameter (copies), keyed by position: ``{"parameters": {position: {...}}}``."""
        pieces = dict(self._loose)
        for keys, layout, state in self.buckets.values():
            pieces.update(zip(keys, self.algorithm.split_state(state, layout)))
        as_dict = lambda piece: piece if isinstance(piece, dict) else piece._asdict()  # noqa: E731 (loaded: a dict)
        return {"parameters": {k: {name: _copy(v) for name, v in as_dict(piece).items()}
                               for k, piece in sorted(pieces.items())}}

    def load_algorithm_state_dict(self, saved: dict) -> None:
        """Before the first step: each parameter's state, taken up when DDP first hands the hook its bucket."""
        if "parameters" not in saved:
            raise BaguaXError(
                f"not a CommHookState.algorithm_state_dict() (keys {sorted(saved)}; per-bucket states of older "
                "bagua_x versions cannot follow DDP's regrouping): save it again with this version, or do not load it"
            )
        self.buckets = {}
        self._loose = {int(k): {name: _copy(v) for name, v in piece.items()}
                       for k, piece in saved["parameters"].items()}

    def close(self) -> None:
        """Stop the communication thread (after the last backward)."""
        if self._worker is not None:
            self._worker.close()


# annotations evaluated (no ``from __future__ import annotations``): DDP's register_comm_hook checks them
def comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook running ``state.algorithm`` on each gradient bucket.

    ``ddp_model.register_comm_hook(CommHookState(ByteGrad()), comm_hook)``.
    """
    return state.submit(bucket)


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _like(v, template):
    """A loaded state value on its fresh counterpart's device: arrays on the bucket's, the step counter on the
    host (``algorithms.base.counter``), so ``comm.switch`` never reads it back from the GPU."""
    return v.to(template.device) if isinstance(v, torch.Tensor) else v


def _shapes(piece: NamedTuple) -> dict:
    return {k: tuple(v.shape) for k, v in piece._asdict().items()}
