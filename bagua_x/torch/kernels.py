"""Fused kernels for torch: the algorithms' framework-free kernels, compiled by ``torch.compile``.

Eager torch runs MinMaxUInt8 as a dozen passes over memory (measured here:
57 ms to compress 25 MB on one CPU core; compiled: about 4 ms, bitwise equal).
Compiling costs seconds per new shape, so small buckets stay eager.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

from ..algorithms.kernels import register_compiler

log = logging.getLogger(__name__)

MIN_NUMEL = 1 << 20  # compile only for buckets of at least a million elements


def _compiled(fn):
    compiled = torch.compile(fn, dynamic=None)

    @functools.wraps(fn)
    def run(*args):
        with warnings.catch_warnings():  # dynamo notes that array_api_compat's lru_caches are traced through
            warnings.simplefilter("ignore", UserWarning)
            return compiled(*args)

    return run


def install() -> None:
    """Compile the algorithms' kernels for torch arrays (idempotent)."""
    try:
        torch.compile(lambda x: x)
    except RuntimeError as e:  # torch.compile unavailable on this platform: eager is still correct
        log.info("bagua_x: torch.compile unavailable (%s); kernels stay eager", e)
        return
    register_compiler("array_api_compat.torch", _compiled, MIN_NUMEL)
