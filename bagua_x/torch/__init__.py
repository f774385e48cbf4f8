"""bagua_x for PyTorch: ``wrap(model, optimizer, algorithm=...)`` and a torch.distributed Communicator.

Launch with ``torchrun --nproc_per_node N train.py`` (wrap() initialises
torch.distributed from its environment: gloo on CPU, NCCL on CUDA)::

    import bagua_x.torch as bxt
    from bagua_x.algorithms import ByteGrad

    model = bxt.wrap(model, optimizer, algorithm=ByteGrad())   # default: GradientAllReduce (what DDP does)
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # buckets are communicated while backward runs
        optimizer.step()

What wrap() gives, DDP-style: rank 0's parameters and buffers on every rank
(buffers re-broadcast before each forward, ``broadcast_buffers=False`` to
skip), ``model.no_sync()`` for gradient accumulation, ``find_unused_parameters``,
tied and frozen parameters, several dtypes (one bucket per dtype), gradients
that are views of the bucket buffers (no copy), ``model.module`` and a
``state_dict()`` with the bare model's keys.  A model or algorithm that
differs across ranks raises a BaguaXError on every rank at wrap().

Algorithms: gradient ones (GradientAllReduce, ByteGrad) run during backward;
Decentralized exchanges weights during forward/backward; LowPrecisionDecentralized
and ModelAverage act after ``optimizer.step()`` (pass the optimizer);
QAdam is an optimizer: ``opt = QAdamOptimizer(model.parameters(), lr=..., warmup_steps=...)``
then ``wrap(model, opt)``; after warmup its momentum is the communicated tensor (8-bit);
AsyncModelAverage averages in a background thread (``model.abort()`` /
``model.resume()`` on every rank; call ``model.abort()`` before exiting).
Per-bucket algorithm state: ``model.algorithm_state_dict()`` /
``model.load_algorithm_state_dict()``.  ``model.shutdown()`` removes hooks and threads.

Checkpoints: save each rank's ``model.state_dict()`` (decentralized ranks'
weights differ), ``optimizer.state_dict()`` and ``model.algorithm_state_dict()``;
to resume, build model and optimizer, ``wrap()``, *then* load all three (wrap
copies rank 0's weights to every rank).  Training then continues bitwise as if
never stopped, for every algorithm except AsyncModelAverage (timing dependent).

Faults: ``wrap(..., timeout=seconds)`` (default: the process group's timeout)
bounds every wait on communication; a dead, hung or out-of-step rank makes the
others raise a BaguaXError naming the bucket, its tensors and the ranks that
had not marked it ready.  Exit then: under ``torchrun --max-restarts N``, the
job restarts from its last checkpoint (wrap() initialises each restart on
fresh store keys).  ``check_finite=True`` raises on NaN/inf communicated
values, naming the tensor.  Bad models (complex or sparse-gradient
parameters, parameters on several devices) are refused at wrap().

Inside stock DDP: ``ddp.register_comm_hook(CommHookState(ByteGrad()), comm_hook)``
runs a gradient algorithm as DDP's communication hook (:mod:`bagua_x.torch.integrations.comm_hook`).

Lightning: ``Trainer(strategy=BaguaXStrategy(algorithm=ByteGrad()))`` with
``from bagua_x.torch import BaguaXStrategy`` (the ``[lightning]`` extra; imported
on first use of the name, so torch users need no Lightning).

``bagua_x.torch.enable_bagua_api()`` adds Bagua's tensor methods
(``ensure_bagua_tensor`` ...) to ``torch.Tensor``; see :mod:`bagua_x.torch.integrations.bagua_compat`.
"""

from .communicator import TorchCommunicator
from .integrations.bagua_compat import enable_bagua_api
from .integrations.comm_hook import CommHookState, comm_hook
from ..ft import FaultTolerance
from .optim import QAdamOptimizer
from .wrap import DistributedModel, wrap

__all__ = ["wrap", "DistributedModel", "TorchCommunicator", "QAdamOptimizer", "enable_bagua_api",
           "CommHookState", "comm_hook", "BaguaXStrategy", "FaultTolerance"]


def __getattr__(name: str):
    """``BaguaXStrategy`` imported when first asked for: importing bagua_x.torch must not need Lightning."""
    if name == "BaguaXStrategy":
        from .integrations.lightning import BaguaXStrategy

        return BaguaXStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
