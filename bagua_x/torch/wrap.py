"""``wrap(model, optimizer, algorithm=...)``: data-parallel training of a torch model.

The wrapper is an adapter between a ``torch.nn.Module`` and the framework-free
core and algorithms: it registers the parameters, buckets them, hooks
backward or the optimizer step according to the algorithm's ``target`` and
``phase``, and runs the algorithm with a :class:`TorchCommunicator`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.weak import WeakIdKeyDictionary

from ..algorithms import GradientAllReduce
from ..algorithms.base import Algorithm, Phase, Target
from ..core.bucket import Bucket
from ..core.errors import BaguaXError
from ..ft import FaultTolerance, Replicas
from . import kernels
from .checks import input_problem
from .communicator import TorchCommunicator
from .distributed import (broadcast_tensors, check_one_gpu_per_rank, check_same_model, ensure_initialized,
                          model_device, private_group)
from .engine.background import AsyncAverageEngine
from .engine.gradient import GradientEngine
from .engine.interface import Engine, EngineOptions
from .engine.momentum import MomentumEngine
from .engine.node_worker import weight_engine
from .fault_tolerance import ReplicaGroups, check_supported, healing_state
from .ddp_args import check_ddp_arguments
from .node_form import NodeForm
from .optim import QAdamOptimizer
from .store import resolve_timeout

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.4
    from torch.distributed._tensor import DTensor

__all__ = ["wrap", "DistributedModel"]

log = logging.getLogger(__name__)

TORCHFT_KEY = "torchft"  # in algorithm_state_dict() with fault_tolerance: the committed step count


class DistributedModel(torch.nn.Module):
    """The wrapped model: call it like the model; ``.module`` is the model itself.

    ``state_dict()`` / ``load_state_dict()`` are the model's own (same keys as
    the unwrapped model), so checkpoints load either way.  The algorithm's
    per-bucket state is separate: ``algorithm_state_dict()``.
    """

    def __init__(self, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], algorithm: Algorithm,
                 process_group: Optional[dist.ProcessGroup], bucket_cap_mb: float, find_unused_parameters: bool,
                 broadcast_buffers: bool, timeout: Union[None, float, datetime.timedelta], check_finite: bool,
                 static_graph: bool, local_world_size: Optional[int] = None,
                 fault_tolerance: Optional[FaultTolerance] = None):
        super().__init__()
        self.module = module
        if fault_tolerance is not None:
            algorithm = check_supported(algorithm, optimizer)
        self.algorithm = algorithm
        self.timeout = resolve_timeout(timeout, process_group)
        # a group of the same ranks for this wrapper alone: every collective below, and the communication
        # thread's, never pairs with the user's or another wrapper's on the same group
        #: fault_tolerance's torchft protocol (None without it); ``replicas.manager`` is torchft's Manager
        self.replicas: Optional[Replicas] = None
        if fault_tolerance is None:
            self.comm = TorchCommunicator(private_group(process_group, self.timeout), timeout=self.timeout)
        else:  # this process group is one node; between nodes torchft's (see .fault_tolerance)
            node_group = private_group(process_group, self.timeout)
            self.replicas = Replicas(fault_tolerance.resolved(), node_group)
            node = TorchCommunicator(private_group(node_group, self.timeout), timeout=self.timeout)
            self.comm = ReplicaGroups(node_group, self.timeout, node, self.replicas)
        group = self.comm.group
        check_one_gpu_per_rank(model_device(module), group, self.timeout)
        if fault_tolerance is None:
            # before any other collective: a rank with another setting or node layout fails here with the rest
            self.comm.enable_hierarchical(algorithm.hierarchical_setting, local_world_size)
        # exchanged with the model description, so a problem on any rank is raised on every rank
        problem = misuse_problem(module) or input_problem(module)
        check_same_model(module, {"algorithm": algorithm.hyperparameters(), "bucket_cap_mb": bucket_cap_mb,
                                  "find_unused_parameters": find_unused_parameters, "timeout": self.timeout,
                                  "check_finite": check_finite, "static_graph": static_graph,
                                  "input check": problem or "passed"}, group)
        if problem:
            raise BaguaXError(f"bagua_x.torch.wrap: {problem}")
        params = list(module.parameters())
        if algorithm.uses_kernels and params:
            kernels.agree(self.comm, params[0].device, sum(p.numel() for p in params))
        broadcast_tensors([*module.parameters(), *module.buffers()], group, timeout=self.timeout)
        self._buffers_to_sync = list(module.buffers()) if broadcast_buffers else []
        self._sync_buffers_next = True
        options = EngineOptions(bucket_cap_mb=bucket_cap_mb, optimizer=optimizer,
                                find_unused_parameters=find_unused_parameters, check_finite=check_finite,
                                static_graph=static_graph, replicas=self.replicas)
        self._engine: Engine = _engine_class(algorithm)(list(module.named_parameters()), algorithm, self.comm,
                                                          options=options)
        self._form = NodeForm(algorithm, self.comm)  # hierarchical=None on nodes: the first steps are timed
        self._gated_optimizer: Optional[torch.optim.Optimizer] = None
        if self.replicas is not None:
            signature = {"model": [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters()],
                         "algorithm": algorithm.hyperparameters()}
            self.replicas.keep("bagua_x", *healing_state(module, optimizer, self._engine, algorithm, signature))
            if algorithm.target is Target.GRAD:  # every step crosses nodes: its optimizer step waits for the vote
                self._gated_optimizer = _gate(optimizer, self.replicas)
        for p in params:
            _wrapped_parameters[p] = True

    @property
    def buckets(self) -> list[Bucket]:
        """The core buckets the algorithm runs on (gradient or weight buckets)."""
        return self._engine.buckets

    def forward(self, *args, **kwargs):
        # communication still in flight ends first: the buffer broadcast below must not share the
        # wrapper's process group with it from another thread (the ranks could pair collectives differently)
        self._engine.settle()
        if self._form.pending and torch.is_grad_enabled() and self._engine.enabled:  # a training step starts
            self._form.at_step(self._engine)
        if self._gated_optimizer is not None and torch.is_grad_enabled() and self._engine.enabled:
            self.replicas.begin()  # this step's gradients cross nodes: quorum (and healing) before the forward
        if self._buffers_to_sync and self._sync_buffers_next:
            broadcast_tensors(self._buffers_to_sync, self.comm.group, timeout=self.timeout)
        self._engine.before_forward()
        out = self.module(*args, **kwargs)
        self._engine.after_forward(out)
        # as DDP: buffers follow rank 0 before a forward that follows a synchronised one
        self._sync_buffers_next = torch.is_grad_enabled() and self._engine.enabled
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Skip communication inside the block: gradients accumulate locally and the
        first backward after it communicates their sum."""
        before, self._engine.enabled = self._engine.enabled, False
        try:
            yield
        finally:
            self._engine.enabled = before

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        """The model's own state dict, taken under :meth:`weights_locked`: with AsyncModelAverage averaging,
        a copy in which every tensor comes from the same averaging round (``keep_vars=True``: the live
        parameters, as asked; read them inside ``weights_locked()``)."""
        with self.weights_locked() as written_outside:
            state = self.module.state_dict(*args, **kwargs)
            if written_outside and not kwargs.get("keep_vars", False):
                for name, value in state.items():
                    state[name] = value.clone()
            return state

    def weights_locked(self):
        """Context in which the weights are read consistently.  Only AsyncModelAverage needs it: its thread
        writes the weights whenever it holds the weight lock, and holds it for a whole round, so read them
        (evaluation under ``no_grad``, an EMA update, ``torch.save(model.module.state_dict())``) inside
        ``with model.weights_locked():``; averaging waits meanwhile.  Other algorithms write the weights on the
        training thread only: for them this does nothing."""
        return self._engine.weights_locked()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if assign:
            raise BaguaXError(
                "load_state_dict(assign=True) would replace the registered parameters; "
                "load with assign=False (the default) so values are copied into them"
            )
        return self.module.load_state_dict(state_dict, strict=strict)

    def algorithm_state_dict(self) -> dict:
        """Per-bucket algorithm state (step counters, decentralized neighbour estimates...), the form
        ``hierarchical=None`` took on nodes by measurement (:mod:`.node_form`), which a load restores, and with
        ``fault_tolerance`` torchft's committed step count."""
        state = self._form.save(self._engine.state_dict())
        if self.replicas is not None:
            state[TORCHFT_KEY] = self.replicas.manager.state_dict()
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        state = dict(state)
        committed = state.pop(TORCHFT_KEY, None)
        if self.replicas is not None and committed is not None:
            self.replicas.manager.load_state_dict(committed)
        self._engine.load_state_dict(self._form.load(state))

    # -- asynchronous averaging -------------------------------------------------------------
    def abort(self) -> None:
        """Stop AsyncModelAverage's background averaging (call it on every rank)."""
        self._async_engine().abort()

    def resume(self) -> None:
        """Restart AsyncModelAverage's background averaging (call it on every rank)."""
        self._async_engine().resume()

    def _async_engine(self) -> AsyncAverageEngine:
        if self.algorithm.phase is not Phase.BACKGROUND:
            raise BaguaXError(
                f"abort()/resume() apply to AsyncModelAverage only; this model uses {type(self.algorithm).__name__}"
            )
        return self._engine

    def shutdown(self) -> None:
        """Remove hooks and stop background threads (the model stays usable, unsynchronised, and may be
        wrapped again)."""
        self._engine.close()
        if self._gated_optimizer is not None:
            del self._gated_optimizer.step  # the class's own step again
            self._gated_optimizer = None
        if self.replicas is not None:
            self.replicas.shutdown()
        for p in self.module.parameters():
            _wrapped_parameters.pop(p, None)


#: the parameters of every wrapper not shut down (its hooks, buckets and thread act on them)
_wrapped_parameters = WeakIdKeyDictionary()


def misuse_problem(module: torch.nn.Module) -> Optional[str]:
    """What makes ``module`` one wrap() would train wrong (or crash on), and the fix; None if nothing.

    Wrapping a wrapper, DDP, or a model a live wrapper holds makes two communication layers act on the
    same gradients (averaged twice, or out of step across ranks: weights drift apart silently); FSDP's
    sharded parameters (DTensors) are not whole tensors bagua_x can replicate.
    """
    for name, sub in module.named_modules():
        where = "the model" if not name else f"its submodule {name!r}"
        if isinstance(sub, DistributedModel):
            return (f"{where} is already wrapped by bagua_x.torch.wrap: train with that wrapper as it is, or call "
                    "its shutdown() and wrap its .module (wrapping a wrapper communicates every gradient twice)")
        if isinstance(sub, torch.nn.parallel.DistributedDataParallel):
            return (f"{where} is a torch DistributedDataParallel, which already averages the gradients: wrap the "
                    "model itself, wrap(ddp.module), without DDP; or keep DDP and run the bagua_x algorithm as its "
                    "communication hook: ddp.register_comm_hook(bxt.CommHookState(algorithm), bxt.comm_hook)")
        if isinstance(sub, FullyShardedDataParallel):
            return (f"{where} is sharded by FSDP, which bagua_x does not support (it keeps whole parameters on "
                    "every rank): train it with FSDP alone, or wrap the model without FSDP")
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            return (f"parameter {name!r} is a DTensor (sharded: FSDP's fully_shard, tensor parallelism), which "
                    "bagua_x does not support (it keeps whole parameters on every rank): train with FSDP alone, "
                    "or wrap the model with plain parameters")
        if p in _wrapped_parameters:
            return (f"parameter {name!r} already belongs to a model wrapped by bagua_x.torch.wrap (this model, or "
                    "one sharing its parameters): use that wrapper, or call its shutdown() before wrapping again "
                    "(two wrappers would each communicate and overwrite the same gradients)")
    return None


def _gate(optimizer: torch.optim.Optimizer, replicas: Replicas) -> torch.optim.Optimizer:
    """``optimizer.step()`` steps only when the replica groups commit the step (the instance's own ``step``, as
    torch's LR schedulers wrap it; ``shutdown()`` removes it)."""
    step = optimizer.step

    def committed_step(*args, **kwargs):
        if replicas.commit():
            return step(*args, **kwargs)
        return None

    optimizer.step = committed_step
    return optimizer


def _engine_class(algorithm: Algorithm):
    """The engine for what the algorithm declares it communicates (``target``) and when (``phase``); a weight
    algorithm's engine also depends on the communicator (:func:`~.engine.node_worker.weight_engine`)."""
    if algorithm.phase is Phase.BACKGROUND:
        return AsyncAverageEngine
    return {Target.GRAD: GradientEngine, Target.WEIGHT: weight_engine, Target.MOMENTUM: MomentumEngine}[algorithm.target]


def wrap(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         algorithm: Optional[Algorithm] = None, process_group: Optional[dist.ProcessGroup] = None,
         bucket_cap_mb: Optional[float] = 25.0, find_unused_parameters: bool = False,
         broadcast_buffers: bool = True, timeout: Union[None, float, datetime.timedelta] = None,
         check_finite: bool = False, device_ids: Optional[Sequence[Union[int, str, torch.device]]] = None,
         output_device: Union[None, int, str, torch.device] = None, gradient_as_bucket_view: bool = True,
         static_graph: bool = False, local_world_size: Optional[int] = None,
         fault_tolerance: Optional[FaultTolerance] = None) -> DistributedModel:
    """Make ``model`` data parallel with ``algorithm``: ``DDP(model, ...)`` -> ``wrap(model, ...)`` is a rename.

    Collective: every rank must call it with the same model and algorithm.  It
    initialises torch.distributed from torchrun's environment if needed (with
    ``timeout`` as the group's own), checks that ranks agree (a BaguaXError on
    every rank otherwise, before any collective that could hang) and copies
    rank 0's parameters and buffers to all ranks.  DDP's keywords are honoured
    or refused before any communication, with the reason.

    On a GPU the default paths never wait for the GPU on the host; bagua_x
    communicates on CUDA streams of its own (see ``docs/architecture.md``).

    Args:
        model: the module, on the device it trains on (one device per process): the plain model, not
            a wrapper (DDP, FSDP, wrap's own) nor one a wrapper not shut down holds (refused, with the fix).
            Freeze parameters (``requires_grad=False``) before wrapping: wrap registers those that train.
        optimizer: needed by algorithms that act after ``optimizer.step()``
            (weight algorithms, AsyncModelAverage); a
            :class:`~bagua_x.torch.QAdamOptimizer` makes QAdam the default algorithm.
        algorithm: default ``GradientAllReduce()`` (what DDP does), or QAdam
            with a QAdamOptimizer.
        process_group: as in DDP (default: the whole world).  bagua_x communicates on a new group of
            the same ranks and backend made here (every rank of ``process_group`` calls wrap), so the
            user's collectives, SyncBatchNorm's or another wrapped model's never pair with its own.
        bucket_cap_mb: as in DDP; ``None`` is DDP's 25.
        find_unused_parameters: as in DDP: parameters that get no gradient are
            communicated as zeros (and keep ``p.grad`` None where no rank used
            them).  Reads a flag per parameter once per step on the host.
        broadcast_buffers: as in DDP: buffers follow rank 0 before each
            forward that follows a synchronised one.
        timeout: seconds or a ``datetime.timedelta`` (default: the process
            group's timeout) bounding every wait on communication: a bucket that
            does not complete in time -- a rank died, hangs, or skipped a
            backward -- makes the waiting call (``backward()``,
            ``optimizer.step()``, ``forward``) raise a BaguaXError naming the
            bucket, its tensors and the ranks that had not marked it ready.  The
            process group is unusable afterwards: exit and restart from a checkpoint.
        check_finite: raise when a communicated value (gradient, weight or QAdam
            momentum) is NaN or infinite after the reduction, naming the tensor,
            on every rank at the same step.  Allreduces one flag per bucket and reads it on the host.
        device_ids: ``None`` or ``[the parameters' device]`` (an int is an index
            on that device type); several devices are refused (one process per device).
        output_device: ``None`` or the parameters' device; outputs stay where the
            model puts them and inputs are not moved.
        gradient_as_bucket_view: must be True: bagua_x always makes gradients
            views of the bucket buffers (there is no second copy to give).
        static_graph: as in DDP: the first backward counts how many times each
            parameter's gradient hook fires (reentrant activation checkpointing
            fires it once per checkpointed segment using the parameter) and is
            communicated at its end; later ones communicate a parameter after
            that many firings.  Without it a second firing raises a BaguaXError
            naming the parameter.  Parameters that get no gradient still need
            ``find_unused_parameters=True``.
        local_world_size: ranks per node for hierarchical algorithms (default
            torchrun's ``LOCAL_WORLD_SIZE``); every rank must see the same
            setting and node layout, else all raise the same BaguaXError before
            any node group is made.  On >= 2 nodes of >= 2 ranks,
            ``hierarchical=None`` takes the faster form, timed over the first
            12 training steps, which alternate the forms;
            ``algorithm_state_dict()`` keeps the choice and a load restores it
            (:mod:`.node_form`).
        fault_tolerance: a :class:`~bagua_x.torch.FaultTolerance`: this process group is one node of a
            torchft job (a replica group): nodes may die and come back while the others train on, a node
            that comes back heals from a live one, and a step some node could not complete is discarded
            (:mod:`.fault_tolerance`).  GradientAllReduce, ByteGrad and DiLoCo (over nodes).  Needs
            ``bagua-x[ft]``.

    Returns:
        The wrapped model: call it like the model; ``.module`` is the model.
    """
    if not isinstance(model, torch.nn.Module):
        raise BaguaXError(f"wrap() expects a torch.nn.Module, got {type(model).__name__}")
    bucket_cap_mb = check_ddp_arguments(model, optimizer, device_ids, output_device, gradient_as_bucket_view,
                                        bucket_cap_mb)
    ensure_initialized(model, timeout)
    if algorithm is None:
        algorithm = optimizer.algorithm if isinstance(optimizer, QAdamOptimizer) else GradientAllReduce()
    return DistributedModel(model, optimizer, algorithm, process_group, bucket_cap_mb,
                            find_unused_parameters, broadcast_buffers, timeout, check_finite, static_graph,
                            local_world_size, fault_tolerance)
