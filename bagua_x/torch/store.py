"""Bounded waits: the timeout every wait uses, and cross-rank checks through the store.

Stall reports (which ranks are behind on a stuck bucket) are in :mod:`.stall`.
The store carries small cross-rank checks that must not be collectives
(:func:`store_allgather`): a rank that never arrives then fails a bounded
``store.wait`` instead of pairing with an unrelated collective.  What goes
through the store is bytes that the caller decodes as plain JSON
(``core.wire``), never pickle: anyone who can reach the store's port can write to it.

Keys carry torchrun's restart count: after an elastic restart the store may
still hold the previous attempt's keys, which must not be read as this one's.
A check's tag (:func:`check_tag`) is counted in the store, per group and kind
of check, not in the process: two wraps (each on a process group of its own)
never share a count, and nothing in a module remembers earlier calls.
"""

from __future__ import annotations

import datetime
import os
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..core.errors import BaguaXError

__all__ = ["check_tag", "resolve_timeout", "restart_count", "store_allgather", "store_broadcast"]


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted the workers (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def resolve_timeout(timeout: Union[None, float, datetime.timedelta],
                    group: Optional[dist.ProcessGroup]) -> float:
    """Seconds: ``timeout`` (a timedelta or seconds), else the process group's own timeout."""
    if timeout is None:
        group = group if group is not None else dist.group.WORLD
        timeout = c10d.default_pg_timeout
        for device in ("cuda", "cpu"):
            try:
                timeout = group._get_backend(torch.device(device)).options._timeout
                break
            except (RuntimeError, AttributeError):  # no backend for that device / an older torch
                continue
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise BaguaXError(f"timeout must be positive (seconds or a datetime.timedelta), got {timeout!r}")
    return seconds


def check_tag(kind: str, group: Optional[dist.ProcessGroup]) -> str:
    """A tag for the next check of ``kind`` over ``group``: the same on every rank of the group that made the
    same checks of that kind over it before, and never used twice.

    The count is this rank's own key in the store (``store.add``), so it
    belongs to the group -- torch names a group identically on each of its
    ranks -- and to the job, not to the process: a second wrap (a new group)
    counts from the start, and two objects checking over one group never
    reuse each other's keys.
    """
    name = c10d._get_process_group_name(group if group is not None else dist.group.WORLD)
    count = c10d._get_default_store().add(f"bagua_x/count/{restart_count()}/{name}/{kind}/{dist.get_rank()}", 1)
    return f"{name}/{kind}/{count}"


def store_allgather(tag: str, data: bytes, group: Optional[dist.ProcessGroup], timeout: float,
                    context: str) -> list[bytes]:
    """Every rank's ``data`` through the store (not a collective), waiting at most ``timeout`` seconds.

    The caller encodes and decodes (``core.wire``: plain JSON, checked on
    arrival).  Each call must use a ``tag`` unique to the check and to its
    occurrence, the same on every rank (:func:`check_tag`); ``context`` starts
    the error messages.
    """
    store, ranks, keys = _keys(tag, group)
    store.set(keys[ranks.index(dist.get_rank())], data)
    _wait(store, ranks, keys, timeout, context)
    return [store.get(k) for k in keys]


def store_broadcast(tag: str, data: Optional[bytes], group: Optional[dist.ProcessGroup], timeout: float,
                    context: str) -> bytes:
    """The group's first rank's ``data`` on every rank, through the store (others pass None).

    One key, read by every rank, instead of :func:`store_allgather`'s one key
    per rank read by every rank: a value only one rank decides (e.g. an order
    of buckets) costs O(ranks), not O(ranks^2).  Same ``tag`` rules.
    """
    store, ranks, keys = _keys(tag, group)
    if dist.get_rank() == ranks[0]:
        store.set(keys[0], data)
    _wait(store, ranks[:1], keys[:1], timeout, context)
    return store.get(keys[0])


def _keys(tag: str, group: Optional[dist.ProcessGroup]):
    store = c10d._get_default_store()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return store, ranks, [f"bagua_x/check/{restart_count()}/{tag}/{r}" for r in ranks]


def _wait(store, ranks: list[int], keys: list[str], timeout: float, context: str) -> None:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 -- a store timeout is a RuntimeError or a DistStoreError
        try:
            missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        except Exception:  # noqa: BLE001
            raise BaguaXError(
                f"{context}: the torch.distributed store became unreachable ({type(e).__name__}: {e}); the rank hosting "
                "it (MASTER_ADDR, usually rank 0) has probably died or exited"
            ) from e
        raise BaguaXError(
            f"{context}: ranks {missing} did not arrive within {timeout:g} s ({type(e).__name__}); they died, hang, or "
            "are at a different step (e.g. resumed from a different checkpoint)"
        ) from e
