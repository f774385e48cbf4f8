"""Fused kernels for torch: the algorithms' framework-free kernels, compiled by ``torch.compile``.

Eager torch runs MinMaxUInt8 as a dozen passes over memory; compiled, it is one
fused pass with bitwise equal results (an order of magnitude faster: see the docs'
Performance page).  Compiling costs seconds per new shape, so small buckets stay eager.
On CUDA, compressing and decompressing rows use the hand-written Triton kernels
of :mod:`.cuda_compression` instead, which also write the packed bytes directly.

``torch.compile`` compiles nothing until it is first called, so a missing
compiler (no C++ toolchain on a CPU node, no Triton on a GPU one) would only
show on the communication thread at the first large bucket.  :func:`agree`
runs at ``wrap()``: every rank compiles a small kernel on the model's device,
the ranks agree, and only if all succeeded are the compiled kernels installed;
else all stay eager, with one warning.  Importing bagua_x.torch installs
nothing.  A compile that still fails later falls back to eager in the same
way, for the whole process: a compiler that failed once (the toolchain is the
process's) is not tried again by a later wrap.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Optional

import torch

from ..algorithms import compression
from ..algorithms.kernels import register_compiler, unregister_compiler
from ..core.comm import ReduceOp

log = logging.getLogger(__name__)

NAMESPACE = "array_api_compat.torch"
MIN_NUMEL = 1 << 20  # compile only for buckets of at least a million elements
_failure: Optional[str] = None  # why kernels stay eager in this process, once decided


def _compiled(fn):
    compiled = torch.compile(fn, dynamic=None)

    @functools.wraps(fn)
    def run(*args):
        if _failure is not None:
            return fn(*args)
        try:
            with warnings.catch_warnings():  # dynamo notes that array_api_compat's lru_caches are traced through
                warnings.simplefilter("ignore", UserWarning)
                return compiled(*args)
        except Exception as e:  # noqa: BLE001 - a compiler failure; a real error recurs in eager below
            fall_back(f"compiling {fn.__name__} failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            return fn(*args)

    return run


# kernels with a hand-written CUDA version in .cuda_compression (which writes the packed rows directly)
_ON_CUDA = {compression.compress_rows.plain: "compress_rows", compression.decompress_rows.plain: "decompress_rows",
            compression.reduce_requantize.plain: "reduce_requantize"}


def _compile(fn):
    """``fn``'s Triton version for CUDA tensors where :mod:`.cuda_compression` has one (else, and on the
    CPU, ``fn`` itself, whose inner kernels compile), or ``fn`` compiled by ``torch.compile``."""
    name = _ON_CUDA.get(fn)
    if name is None:
        return _compiled(fn)

    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        if x.is_cuda and _failure is None:
            try:
                from . import cuda_compression

                if cuda_compression.applies(x, kwargs.get("out")):
                    return getattr(cuda_compression, name)(x, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - Triton missing or failing: eager, as any compiler failure
                fall_back(f"the Triton kernel {name} failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        return fn(x, *args, **kwargs)

    return run


def install() -> None:
    """Compile the algorithms' kernels for torch arrays (idempotent)."""
    register_compiler(NAMESPACE, _compile, MIN_NUMEL)


def fall_back(why: str) -> None:
    """Run every kernel eager from now on in this process, with one warning saying ``why``."""
    global _failure
    if _failure is None:
        _failure = why
        unregister_compiler(NAMESPACE)
        warnings.warn(f"bagua_x: {why}; compression kernels run eager (correct, slower)", RuntimeWarning,
                      stacklevel=3)


@functools.lru_cache(maxsize=None)
def probe(device: torch.device) -> Optional[str]:
    """Compile and run a small kernel on ``device``: None when it works, else why not (once per device)."""
    try:
        out = torch.compile(lambda x: torch.round(x * 2.5) - 1.0)(torch.arange(8.0, device=device))
        if not torch.equal(out.cpu(), torch.round(torch.arange(8.0) * 2.5) - 1.0):
            return "a compiled test kernel gave a wrong result"
    except Exception as e:  # noqa: BLE001 - whatever the compiler raised
        return f"torch.compile does not work on {device} ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return None


def agree(comm, device: torch.device, numel: int) -> None:
    """At wrap: compile on every rank where a bucket of ``numel`` elements could use compiled kernels, and
    install them only if every rank could (collective: every rank calls it with the same ``numel``)."""
    if numel < MIN_NUMEL or _failure is not None:
        return
    why = probe(device)
    ok = torch.tensor([0 if why else 1], dtype=torch.int32, device=device)
    if int(comm.allreduce(ok, ReduceOp.MIN)[0]) == 0:  # once at wrap: the ranks must take the same path
        fall_back(why or "torch.compile failed on another rank")
    else:
        install()
