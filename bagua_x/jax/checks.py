"""Bad input refused with a BaguaXError naming the leaf, and the optional finite check after reduction.

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

__all__ = ["check_registrable", "check_leaf_dtype", "FiniteCheck"]


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
