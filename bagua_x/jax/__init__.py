"""bagua_x for JAX: data-parallel training with bagua_x algorithms, in a ``jax.jit`` step over a mesh,
inside ``jax.shard_map`` or inside ``jax.pmap``.

    bagua_x.jax.init_distributed()             # multi-process: torchrun-style env, gloo on CPU
    dp = bagua_x.jax.wrap(params, algorithm=ByteGrad(), axis_name="batch", mesh=mesh)
    params, opt_state, state = dp.replicate(params), dp.replicate(tx.init(params)), dp.init()
    # in the jitted step, the batch sharded along "batch":
    (loss, grads), state = dp.value_and_grad(loss_fn)(params, x, y, state=state)
    # inside your own shard_map / pmap step: optax.chain(dp.gradient_transformation(), optax.adam(1e-3)),
    # or grads, state = dp.reduce_gradients(grads, state)

Weight algorithms (DiLoCo, Decentralized, LowPrecisionDecentralized, ModelAverage) use
``params, state = dp.sync_params(params, state)`` at the point their
``phase`` names, their params one copy per device (``dp.replicate(params, per_device=True)``);
QAdam is an optimizer, ``dp.optimizer()``.  What runs at jit level, and why
gradients inside a typed ``shard_map`` need care: :mod:`.mesh_step`.

Losing a node: ``wrap(..., algorithm=DiLoCo(...), fault_tolerance=bagua_x.jax.FaultTolerance())`` makes
this process and its devices one node of a torchft job that trains on when another dies, DiLoCo's exchange
between nodes on the host through ``dp.sync_replicas`` (see :mod:`.fault_tolerance`; needs ``bagua-x[ft]``).

Faults: ``wrap(..., timeout=s, check_finite=True)`` with the step called as
``train_step = dp.step(jax.pmap(step, axis_name="batch"))``: a step that does
not finish in time ends the process with a report naming the processes that
never arrived (see :mod:`.watchdog`), and a NaN or inf after the reduction
raises a BaguaXError naming the leaves (see :mod:`.checks`).

The algorithms are the framework-free ones of :mod:`bagua_x.algorithms`,
traced by JAX through :class:`AxisCommunicator` (XLA collectives).

Checkpoints: the algorithm state is an ordinary pytree threaded through the
step, so save its leaves with the params' and the optimizer state's (e.g.
``np.savez`` of ``jax.tree.leaves((params, opt_state, state))``, this
process's rows) and restore with the structure of a fresh
``(dp.replicate(params), dp.replicate(tx.init(params)), dp.init())``: training
continues bitwise as if never stopped, QAdam (``dp.optimizer()``) included.
"""

from .communicator import AxisCommunicator
from .distributed import init_distributed
from .placement import replicate, unreplicate
from .wrap import DataParallel, wrap

__all__ = ["AxisCommunicator", "DataParallel", "wrap", "init_distributed", "replicate", "unreplicate",
           "FaultTolerance"]


def __getattr__(name: str):
    """``FaultTolerance`` (:mod:`bagua_x.ft`) imported when first asked for: it imports torch, which
    ``bagua_x.jax`` needs only for ``wrap(..., fault_tolerance=...)``."""
    if name == "FaultTolerance":
        from ..ft import FaultTolerance

        return FaultTolerance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
