"""Starting multi-process JAX from a torchrun-style environment, and cross-process checks.

``torchrun`` (and ``tests/launch.py``) export RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT.  :func:`init_distributed` turns them into
``jax.distributed.initialize`` arguments so one launcher serves both frontends.
JAX's coordinator listens on **MASTER_PORT + 1**: a job that also starts
``torch.distributed`` on MASTER_PORT (e.g. a torch data loader) must not
collide with it.  On CPU, cross-process collectives go through gloo.

Trust model, as with ``torch.distributed``: whoever can reach MASTER_PORT or
MASTER_PORT + 1 is inside the job (the coordinator's key-value store and the
collectives carry no authentication).  So the coordinator listens on
MASTER_ADDR's interface only, not on all interfaces (JAX's default), and what
processes exchange through it is plain JSON (:mod:`bagua_x.core.wire`),
checked on arrival: data from that port is never unpickled, so at worst a
stranger can disturb the job, not run code in it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Optional, Sequence

import jax
import numpy as np

from ..core import wire
from ..core.errors import BaguaXError
from ..core.validation import check_same_everywhere

__all__ = ["init_distributed", "COORDINATOR_PORT_OFFSET", "check_same_across_processes", "heartbeat_timeout"]

logger = logging.getLogger(__name__)

COORDINATOR_PORT_OFFSET = 1
JAX_HEARTBEAT_TIMEOUT = 100  # jax.distributed.initialize's default heartbeat_timeout_seconds (jax 0.10)
_heartbeat_timeout = JAX_HEARTBEAT_TIMEOUT


def heartbeat_timeout() -> float:
    """Seconds after which JAX's coordination service aborts every process once one stops (see init_distributed)."""
    return _heartbeat_timeout


def _host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets as gRPC wants it."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


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

    The coordinator (on process 0) listens on the address it is reached at
    (MASTER_ADDR), not on every interface; ``coordinator_bind_address=...``
    or JAX_COORDINATOR_BIND_ADDRESS overrides that (e.g. behind NAT, where
    MASTER_ADDR is not an address of process 0's host).  See the module
    docstring for the trust model.

    When a process dies, JAX's coordination service aborts the others after
    ``heartbeat_timeout_seconds`` (default 100) with a terse "another task
    died".  ``bagua_x.jax.wrap(..., timeout=...)`` must stay below it (wrap
    checks) so that its report -- which step, which processes never arrived --
    comes first; raise ``heartbeat_timeout_seconds`` here for longer timeouts.

    Under torchrun with several processes per node, each process takes GPU
    LOCAL_RANK (``local_device_ids=[LOCAL_RANK]``, one GPU per process as with
    torch's DDP) unless ``local_device_ids``, JAX_LOCAL_DEVICE_IDS or a
    per-process CUDA_VISIBLE_DEVICES says otherwise.
    """
    global _heartbeat_timeout
    env = os.environ
    if num_processes is None and "WORLD_SIZE" in env:
        num_processes = int(env["WORLD_SIZE"])
    if process_id is None and "RANK" in env:
        process_id = int(env["RANK"])
    if coordinator_address is None and "MASTER_ADDR" in env and "MASTER_PORT" in env:
        coordinator_address = _host_port(env["MASTER_ADDR"], int(env["MASTER_PORT"]) + COORDINATOR_PORT_OFFSET)
    if num_processes == 1 or (num_processes is None and coordinator_address is None and process_id is None):
        logger.info("bagua_x.jax.init_distributed: one process, nothing to initialise")
        return
    if local_device_ids is None:
        local_device_ids = _one_gpu_per_local_process(env)
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator_address is not None and "JAX_COORDINATOR_BIND_ADDRESS" not in env:
        kwargs.setdefault("coordinator_bind_address", coordinator_address)
    _heartbeat_timeout = kwargs.get("heartbeat_timeout_seconds", JAX_HEARTBEAT_TIMEOUT)
    logger.info(
        "bagua_x.jax.init_distributed: process %s of %s, coordinator %s (listening on %s)", process_id,
        num_processes, coordinator_address, kwargs.get("coordinator_bind_address", "JAX_COORDINATOR_BIND_ADDRESS"),
    )
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        **kwargs,
    )


def _one_gpu_per_local_process(env) -> Optional[list[int]]:
    """``[LOCAL_RANK]`` when torchrun starts several processes per node and nothing chose their GPUs yet.

    Without it every process claims every GPU of the node and JAX preallocates
    most of each one's memory, so the second process runs out of memory (or
    NCCL sees one GPU twice).  torch's DDP convention is one GPU per process,
    GPU LOCAL_RANK; JAX only applies the ids to GPUs (``jax_cuda_visible_devices``),
    so CPU runs are unaffected.  Left alone when JAX_LOCAL_DEVICE_IDS is set, when
    there is one process per node (it keeps all the node's devices), or when
    CUDA_VISIBLE_DEVICES already gives each process fewer GPUs than the node has processes.
    """
    if "JAX_LOCAL_DEVICE_IDS" in env or "LOCAL_RANK" not in env or int(env.get("LOCAL_WORLD_SIZE", "1")) <= 1:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and len([d for d in visible.split(",") if d.strip()]) < int(env["LOCAL_WORLD_SIZE"]):
        return None
    return [int(env["LOCAL_RANK"])]


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

    A fixed-size digest of the JSON encoding is compared first (one small
    collective); only when the digests differ are the full descriptions
    gathered, as JSON, so that ``core.check_same_everywhere`` can name the
    first leaf or setting that differs.  Every process's description, this
    one's included, is compared as decoded (JSON turns tuples into lists; the
    decoder gives tuples back), so equal entries compare equal.  A no-op in a
    single process.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    mine = wire.encode(entries)
    digest = np.frombuffer(hashlib.sha256(mine).digest(), np.uint8)
    digests = multihost_utils.process_allgather(digest)
    if (digests == digests[0]).all():
        return
    check_same_everywhere(decode_descriptions(_gather_bytes(mine)), context)
    raise BaguaXError(f"{context}: the processes' descriptions differ in a way that could not be located: {entries!r}")


def decode_descriptions(gathered: list[bytes]) -> list[list]:
    """Each process's description from the bytes it sent: JSON only, checked (never unpickled)."""
    return [wire.decode_description(data, f"the description sent by process {i}") for i, data in enumerate(gathered)]
