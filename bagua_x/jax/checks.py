"""Bad input refused with a BaguaXError naming the leaf (at wrap, in the step, at jit level), and the optional
finite check after reduction.

``check_finite`` uses ``jax.debug.callback`` rather than ``checkify``:
checkify only reports through the function it transforms, so the user would
have to wrap their pmapped step with ``checkify.checkify`` and call
``err.throw()`` after it; a debug callback works inside the user's step
unchanged.  The traced step computes one flag per leaf (a tiny ``pmin`` makes
them the same on every device, also for weight algorithms whose devices hold
different values) and hands only those flags to the host; the callback raises
the same BaguaXError on every device of every process at the same step.  JAX
reports an exception from a callback as a ``JaxRuntimeError`` carrying its
text; :meth:`~.wrap.DataParallel.step` turns it back into the BaguaXError.  With
``check_finite=False`` nothing is added to the traced program.
"""

from __future__ import annotations

import functools
import threading
from typing import Hashable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core.errors import BaguaXError
from .mesh_step import axis_bound, invariant_leaves

__all__ = ["check_registrable", "check_leaf_dtype", "FiniteCheck", "refuse_jit_level", "refuse_invariant",
           "check_stacked", "check_state_stacked"]


def check_registrable(names: Sequence[str], dtypes: Sequence) -> None:
    """Refuse complex leaves at wrap: the algorithms (quantisation, min/max, averaging) work on real floats."""
    complex_leaves = [n for n, d in zip(names, dtypes) if jnp.issubdtype(d, jnp.complexfloating)]
    if complex_leaves:
        raise BaguaXError(
            f"bagua_x.jax.wrap: complex leaves {complex_leaves[:5]} cannot be communicated (bagua_x algorithms "
            "work on real floating-point buffers); keep the real and imaginary parts as two real leaves "
            "(jnp.real / jnp.imag, rebuilt with jax.lax.complex) or leave them out of the wrapped tree"
        )


def check_leaf_dtype(where: str, name: str, dtype, registered) -> None:
    """A value to communicate must be floating point: an integer gradient is a wrong tree, not a value."""
    if not jnp.issubdtype(dtype, jnp.floating):
        raise BaguaXError(
            f"{where}: leaf {name!r} is {dtype}, but wrap registered it as {registered} to be communicated; "
            "pass floating-point values there (an integer leaf here usually means jax.grad(..., allow_int=True) "
            "output or the wrong tree)"
        )


def refuse_jit_level(call: str, axis_name: Hashable, algorithm) -> None:
    """Raise where ``call`` would reduce gradients that XLA has reduced already (jit level: :mod:`.mesh_step`)."""
    if axis_bound(axis_name):
        return
    raise BaguaXError(
        f"{call} was called where axis {axis_name!r} is not bound, outside jax.pmap(..., axis_name={axis_name!r}) "
        f"and jax.shard_map over a mesh axis {axis_name!r}: at jit level the gradients are already XLA's mean over "
        f"the sharded batch (it added its own full-precision allreduce), so nothing is left for {algorithm!r} to "
        "communicate; compute them with (loss, grads), state = dp.value_and_grad(loss_fn)(params, *batch, "
        "state=state), which differentiates per device and communicates, and apply them with a plain optax optimizer"
    )


def refuse_invariant(leaves: Sequence, names: Sequence[str], axis_name: Hashable, algorithm, where: str,
                     what: str) -> None:
    """Raise if typed shard_map says the registered ``leaves`` are the same on every device (:mod:`.mesh_step`):
    gradients JAX summed itself, or a weight algorithm's params passed replicated."""
    same = invariant_leaves(leaves, names, axis_name)
    if not same:
        return
    if what == "params":
        fix = (f"a weight algorithm's params differ per device: pass them one copy per device "
               f"(dp.replicate(params, per_device=True), in_specs=P({axis_name!r}), [0] inside), or call "
               "dp.sync_params at jit level on those")
    else:
        fix = (f"jax.grad with respect to params passed with P() sums the gradient over the axis (JAX adds a "
               f"full-precision psum), so {algorithm!r} would average n equal sums, n times the gradient; "
               f"differentiate a per-device copy, jax.grad(loss)(jax.lax.pcast(params, {axis_name!r}, "
               "to='varying'), ...), or let dp.value_and_grad(loss) do it")
    raise BaguaXError(f"{where}: jax.shard_map types the {what} {', '.join(same[:3])} as the same on every device "
                      f"of axis {axis_name!r}; {fix}")


def check_stacked(leaves: Sequence, names: Sequence[str], shapes: Sequence[tuple], devices: int,
                  axis_name: Hashable, algorithm, call: str) -> None:
    """Raise unless every registered leaf has a leading axis of one entry per device (jit level)."""
    for leaf, name, shape in zip(leaves, names, shapes):
        if tuple(np.shape(leaf)) != (devices,) + shape:
            raise BaguaXError(
                f"{call} at jit level takes one copy per device of {algorithm!r}'s per-device values, stacked "
                f"along a leading axis of axis {axis_name!r}'s {devices} devices, but leaf {name!r} has shape "
                f"{tuple(np.shape(leaf))}, not {(devices,) + shape}; lay them out with dp.replicate(tree, "
                "per_device=True) (weights) or take them from dp.value_and_grad (gradients)"
            )


def check_state_stacked(state, devices: int, axis_name: Hashable, call: str) -> None:
    """Raise unless the bagua_x state at jit level is one per device (``dp.init()``, not ``init_state()``)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != devices:
            raise BaguaXError(
                f"{call} at jit level takes the state of dp.init(): one per device, stacked along a leading axis "
                f"of axis {axis_name!r}'s {devices} devices, but its leaf {jax.tree_util.keystr(path)} has shape "
                f"{tuple(np.shape(leaf))}; pass dp.init() (dp.init_state() is one device's state)"
            )


class FiniteCheck:
    """The traced side (flags + callback) and the host side (raise, remember) of ``check_finite``."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self._lock = threading.Lock()
        self.last_error: Optional[BaguaXError] = None  # what the callback raised, for DataParallel.step

    def insert(self, leaves: Sequence, positions: Sequence[int], axis_name: Hashable, where: str) -> None:
        """Add the flags of ``leaves[i]`` for ``i`` in ``positions`` and the host callback to the traced step."""
        flags = jnp.stack([jnp.all(jnp.isfinite(leaves[i])) for i in positions]).astype(jnp.int32)
        flags = lax.pmin(flags, axis_name)
        jax.debug.callback(functools.partial(self._on_host, tuple(positions), where), flags)

    def _on_host(self, positions: tuple, where: str, flags) -> None:
        bad = [self.names[i] for i, ok in zip(positions, np.asarray(flags)) if not ok]
        if not bad:
            return
        error = BaguaXError(
            f"{where}: NaN or inf after the reduction in leaves {bad[:10]}"
            f"{f' and {len(bad) - 10} more' if len(bad) > 10 else ''} (wrap(check_finite=True)); every process "
            "sees the same reduced values, so every process stops at this step. Look for the cause on the "
            "process whose inputs or loss diverged (learning rate, loss scale, bad data) and restart from the "
            "last checkpoint"
        )
        with self._lock:
            self.last_error = error
        raise error

    def take(self) -> Optional[BaguaXError]:
        """The error the callback raised since the last call, if any (and forget it)."""
        with self._lock:
            error, self.last_error = self.last_error, None
        return error
