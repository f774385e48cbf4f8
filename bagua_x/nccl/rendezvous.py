"""The NCCL unique-id exchange through the job's existing key-value store.

Rank 0 creates the unique id and publishes it under a key; the other ranks
wait for it (:func:`exchange_unique_id`); the key counts each rank's
communicators in the store itself (:func:`next_unique_id_key`), not in this
module.  Any object with ``set(key, bytes)``, ``get(key) -> bytes`` and
``add(key, amount)`` works: ``torch.distributed.TCPStore`` as it is, JAX's
distributed client through :func:`jax_kv_store`.  Neither torch nor JAX is
imported here; the stores are duck-typed.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from bagua_x.core.errors import BaguaXError

__all__ = ["exchange_unique_id", "JaxKeyValueStore", "jax_kv_store", "next_unique_id_key"]


def exchange_unique_id(store, rank: int, key: str, create: Callable[[], bytes], *,
                       timeout: float = 300.0, poll: float = 0.02) -> bytes:
    """Rank 0 calls ``create()`` and publishes the bytes under ``key``; other ranks wait for them.

    ``store`` is any key-value store with ``set(key, bytes)`` and ``get(key) -> bytes``
    (``torch.distributed.TCPStore``, :func:`jax_kv_store`); when it also has
    ``check([key]) -> bool`` (TCPStore), waiting polls that instead of a blocking ``get``.
    A rank that has not seen the id after ``timeout`` seconds raises :class:`BaguaXError`.
    """
    if rank == 0:
        uid = bytes(create())
        if not uid:
            raise BaguaXError("the NCCL unique-id generator returned no bytes")
        store.set(key, uid)
        return uid
    check = getattr(store, "check", None)
    deadline = time.monotonic() + timeout
    last_error: Optional[BaseException] = None
    while True:
        ready = True
        if callable(check):
            try:
                ready = bool(check([key]))
            except Exception as e:  # noqa: BLE001 - a store may refuse check(); fall back to get()
                last_error, check = e, None
        if ready:
            try:
                value = store.get(key)
            except Exception as e:  # noqa: BLE001 - stores signal "absent" differently (KeyError, NOT_FOUND, timeout)
                last_error = e
            else:
                if value:
                    return value.encode() if isinstance(value, str) else bytes(value)
        if time.monotonic() >= deadline:
            detail = f" (last store error: {last_error})" if last_error is not None else ""
            raise BaguaXError(
                f"rank {rank} waited {timeout:g} s for the NCCL unique id under key {key!r} in the rendezvous store, "
                f"but rank 0 never published it{detail}; check that rank 0 is running, creates its "
                f"NcclCommunicator with the same name, and uses the same store"
            )
        time.sleep(poll)


class JaxKeyValueStore:
    """``set``/``get`` over JAX's distributed runtime client (``jax._src.distributed.global_state.client``).

    Duck-typed: uses the client's ``key_value_set_bytes`` / ``key_value_try_get_bytes``
    (or ``blocking_key_value_get_bytes`` with a short timeout on clients without
    ``try_get``), and the str variants on older clients; ``add`` is the client's
    ``key_value_increment``.  JAX itself is not imported.
    """

    def __init__(self, client, poll_ms: int = 100):
        if client is None:
            raise BaguaXError("no JAX distributed client: call jax.distributed.initialize() first")
        self.client = client
        self.poll_ms = poll_ms

    def set(self, key: str, value: bytes) -> None:
        c = self.client
        if hasattr(c, "key_value_set_bytes"):
            c.key_value_set_bytes(key, bytes(value))
        else:
            c.key_value_set(key, bytes(value).hex())

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the integer under ``key`` (0 when absent) and returns the sum."""
        return int(self.client.key_value_increment(key, amount))

    def get(self, key: str) -> bytes:
        c = self.client
        if hasattr(c, "key_value_try_get_bytes"):
            return bytes(c.key_value_try_get_bytes(key))
        if hasattr(c, "blocking_key_value_get_bytes"):
            return bytes(c.blocking_key_value_get_bytes(key, self.poll_ms))
        if hasattr(c, "key_value_try_get"):
            return bytes.fromhex(c.key_value_try_get(key))
        return bytes.fromhex(c.blocking_key_value_get(key, self.poll_ms))


def jax_kv_store(client) -> JaxKeyValueStore:
    """Adapter: JAX's distributed client as a ``set``/``get`` store for :func:`exchange_unique_id`.

    Pass ``jax._src.distributed.global_state.client`` after ``jax.distributed.initialize()``.
    """
    return JaxKeyValueStore(client)


def next_unique_id_key(store, rank: int, name: str) -> str:
    """``bagua_x/nccl/<restart>/<name>/<n>``: the key of this rank's n-th communicator of that name in this job.

    The count lives in the store, under this rank's own key (``store.add``), so
    it belongs to the job, not to the process: every rank that created the same
    communicators before meets under the same key, and a torchrun restart
    (``TORCHELASTIC_RESTART_COUNT``) counts afresh without reading the id that
    the previous round's rank 0 left in torchrun's store.
    """
    add = getattr(store, "add", None)
    if not callable(add):
        raise BaguaXError(
            f"the rendezvous store {type(store).__name__} has no add(key, amount) to count NcclCommunicator "
            f"{name!r}'s generations; pass key=... (the same on every rank), or a torch.distributed.TCPStore "
            "or jax_kv_store(client)"
        )
    prefix = f"bagua_x/nccl/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"
    return f"{prefix}/{int(add(f'{prefix}/count/{rank}', 1)) - 1}"
