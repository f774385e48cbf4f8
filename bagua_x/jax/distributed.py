"""Starting multi-process JAX from a torchrun-style environment, and cross-process checks.

``torchrun`` (and ``tests/launch.py``) export RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT.  :func:`init_distributed` turns them into
``jax.distributed.initialize`` arguments so one launcher serves both frontends.
JAX's coordinator listens on **MASTER_PORT + 1**: a job that also starts
``torch.distributed`` on MASTER_PORT (e.g. a torch data loader) must not
collide with it.  On CPU, cross-process collectives go through gloo.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from typing import Any, Optional, Sequence

import jax
import numpy as np

from ..core.errors import BaguaXError
from ..core.validation import check_same_everywhere

__all__ = ["init_distributed", "COORDINATOR_PORT_OFFSET", "check_same_across_processes"]

logger = logging.getLogger(__name__)

COORDINATOR_PORT_OFFSET = 1


def init_distributed(
    coordinator_address: Optional[str] = None,
    num_processes: Optional[int] = None,
    process_id: Optional[int] = None,
    local_device_ids: Optional[int | Sequence[int]] = None,
    **kwargs: Any,
) -> None:
    """``jax.distributed.initialize`` from explicit arguments or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.

    Explicit arguments win over the environment; other keyword arguments go to
    ``jax.distributed.initialize`` unchanged.  A world of one process needs no
    initialisation and is skipped, and so is a run with neither arguments nor
    torchrun variables (a plain ``python train.py``); on clusters that JAX
    detects by itself (SLURM, Open MPI, TPU pods) call
    ``jax.distributed.initialize()`` directly.  Call it before any other JAX call.
    """
    env = os.environ
    if num_processes is None and "WORLD_SIZE" in env:
        num_processes = int(env["WORLD_SIZE"])
    if process_id is None and "RANK" in env:
        process_id = int(env["RANK"])
    if coordinator_address is None and "MASTER_ADDR" in env and "MASTER_PORT" in env:
        coordinator_address = f"{env['MASTER_ADDR']}:{int(env['MASTER_PORT']) + COORDINATOR_PORT_OFFSET}"
    if num_processes == 1 or (num_processes is None and coordinator_address is None and process_id is None):
        logger.info("bagua_x.jax.init_distributed: one process, nothing to initialise")
        return
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info(
        "bagua_x.jax.init_distributed: process %s of %s, coordinator %s", process_id, num_processes, coordinator_address
    )
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        **kwargs,
    )


def _gather_bytes(data: bytes) -> list[bytes]:
    """Every process's ``data`` (variable length), in process order."""
    from jax.experimental import multihost_utils

    lengths = multihost_utils.process_allgather(np.array([len(data)], np.int64))
    width = int(lengths.max())
    padded = np.zeros(width, np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = multihost_utils.process_allgather(padded)
    return [bytes(row[: int(n)]) for row, n in zip(rows, lengths.reshape(-1))]


def check_same_across_processes(entries: list, context: str) -> None:
    """Raise the same BaguaXError on every process if ``entries`` (from ``core.describe``) differ.

    A fixed-size digest is compared first (one small collective); only when the
    digests differ are the full descriptions gathered, so that
    ``core.check_same_everywhere`` can name the first leaf or setting that
    differs.  A no-op in a single process.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.frombuffer(hashlib.sha256(repr(entries).encode()).digest(), np.uint8)
    digests = multihost_utils.process_allgather(digest)
    if (digests == digests[0]).all():
        return
    per_process = [pickle.loads(b) for b in _gather_bytes(pickle.dumps(entries))]
    check_same_everywhere(per_process, context)
    raise BaguaXError(f"{context}: the processes' descriptions differ in a way that could not be located: {entries!r}")
