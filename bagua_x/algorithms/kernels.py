"""Kernels: the elementwise pieces of the algorithms, which a frontend may fuse.

Eager array libraries (torch) run an expression like ``x + l/3 + r/3 - 5w/3``
as one pass over memory per operator, each into a fresh buffer; compiled, it
is one pass.  An algorithm marks such pure array functions with
:func:`kernel`; a frontend registers a compiler for its array namespace
(:func:`register_compiler`), and calls on large enough arrays of that namespace
go to the compiled version, compiled once per kernel on first use.  JAX needs
no compiler here: the whole step is traced and XLA fuses it.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

from .base import namespace

__all__ = ["kernel", "register_compiler", "unregister_compiler"]

_COMPILERS: dict[str, tuple[Callable, int]] = {}  # namespace name -> (compile, min_numel)


def register_compiler(namespace_name: str, compile: Callable[[Callable], Callable], min_numel: int = 0) -> None:
    """Run kernels on arrays of ``namespace_name`` with at least ``min_numel`` elements as
    ``compile(kernel)`` (below that, compiling does not pay off).  ``compile`` gets the plain function
    and may return a hand-written equivalent of its own instead of compiling it."""
    _COMPILERS[namespace_name] = (compile, min_numel)


def unregister_compiler(namespace_name: str) -> None:
    """Run kernels on arrays of ``namespace_name`` uncompiled from now on."""
    _COMPILERS.pop(namespace_name, None)


def kernel(fn: Callable) -> Callable:
    """Mark ``fn`` (a pure function of arrays, its first argument the largest) as a kernel.

    ``fn.plain`` stays the uncompiled function, for use inside other kernels.
    """
    compiled: dict[str, Callable] = {}

    @functools.wraps(fn)
    def dispatch(x, *args, **kwargs):
        name = namespace(x).__name__
        entry = _COMPILERS.get(name)
        if entry is None or math.prod(x.shape) < entry[1]:
            return fn(x, *args, **kwargs)
        if name not in compiled:
            compiled[name] = entry[0](fn)
        return compiled[name](x, *args, **kwargs)

    dispatch.plain = fn
    return dispatch
