"""bagua_x for JAX: data-parallel ``pmap`` / ``shard_map`` training with bagua_x algorithms.

    bagua_x.jax.init_distributed()             # multi-process: torchrun-style env, gloo on CPU
    dp = bagua_x.jax.wrap(params, algorithm=ByteGrad(), axis_name="batch")
    tx = optax.chain(dp.gradient_transformation(), optax.adam(1e-3))
    params, opt_state = dp.replicate(params), dp.replicate(tx.init(params))
    # inside jax.pmap(step, axis_name="batch"): tx.update communicates the gradients
    # (or explicitly: grads, state = dp.reduce_gradients(grads, state), state from dp.init())

Weight algorithms (Decentralized, LowPrecisionDecentralized, ModelAverage) use
``params, state = dp.sync_params(params, state)`` at the point their
``phase`` names; QAdam is an optimizer, ``dp.optimizer()``.  Under
``jax.shard_map`` pass ``mesh`` to ``replicate``/``init`` (see :mod:`.placement`).

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

__all__ = ["AxisCommunicator", "DataParallel", "wrap", "init_distributed", "replicate", "unreplicate"]
