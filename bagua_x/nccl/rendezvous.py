"""The NCCL unique-id exchange through the job's existing key-value store.

Rank 0 creates the unique id and publishes it under a key; the other ranks
wait for it (:func:`exchange_unique_id`).  Any object with ``set(key, bytes)``
and ``get(key) -> bytes`` works: ``torch.distributed.TCPStore`` as it is, JAX's
distributed client through :func:`jax_kv_store`.  Neither torch nor JAX is
imported here; the stores are duck-typed.
"""

from __future__ import annotations

import itertools
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
    ``try_get``), and the str variants on older clients; JAX itself is not imported.
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


_generations: dict = {}


def next_unique_id_key(name: str) -> str:
    """``bagua_x/nccl/<name>/<n>``: the n-th communicator of that name made by this process.

    Every rank creates its communicators in the same order, so the n-th ones meet
    under the same key and never read a previous communicator's id.
    """
    counter = _generations.setdefault(name, itertools.count())
    return f"bagua_x/nccl/{name}/{next(counter)}"
