"""Bounded waits and stall reports: no rank hangs silently when another stops communicating.

When a rank dies or stops calling backward, the others block inside a
collective.  The collective cannot say who is missing -- it is what is stuck --
so, as Horovod's stall inspector does, every rank records in the
torch.distributed store how many times it has launched each bucket
(:class:`StallInspector`, one ``store.set`` per bucket per step, off the
training thread).  When a wait times out, the rank reads everyone's counters
and names the ranks that are behind on the stuck bucket.

The store also carries small cross-rank checks that must not be collectives
(:func:`store_allgather`): a rank that never arrives then fails a bounded
``store.wait`` instead of pairing with an unrelated collective.  What goes
through the store is bytes that the caller decodes as plain JSON
(``core.wire``), never pickle: anyone who can reach the store's port can write to it.

Keys carry torchrun's restart count: after an elastic restart the store may
still hold the previous attempt's keys, which must not be read as this one's.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..core.bucket import Bucket
from ..core.errors import BaguaXError

__all__ = ["resolve_timeout", "restart_count", "StallInspector", "store_allgather"]

log = logging.getLogger(__name__)

_inspector_ids = itertools.count()  # engines are created in the same order on every rank


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


class StallInspector:
    """Per-rank launch counters of one engine's buckets, kept in the torch.distributed store."""

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self._store = c10d._get_default_store()
        self._ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self._me = dist.get_rank()
        # the restart count keeps a restarted job from reading the previous attempt's counters
        self._prefix = f"bagua_x/stall/{restart_count()}/{next(_inspector_ids)}"
        self._counts: dict[str, int] = {}

    def _key(self, bucket: str, rank: int) -> str:
        return f"{self._prefix}/{bucket}/{rank}"

    def launched(self, bucket: Bucket) -> None:
        """Record that this rank marked ``bucket`` ready once more (called before its collective)."""
        count = self._counts.get(bucket.name, 0) + 1
        self._counts[bucket.name] = count
        try:
            self._store.set(self._key(bucket.name, self._me), str(count))
        except Exception as e:  # noqa: BLE001 -- diagnostics must never break training
            log.debug("bagua_x: could not record readiness of %s: %s", bucket.name, e)

    def report(self, bucket: Optional[Bucket], stuck: bool = False) -> str:
        """The bucket's tensors and the ranks that had not marked it ready as often as this rank (for errors).

        ``stuck``: the collective did not return; if no rank is behind, say that the collective itself hangs.
        """
        if bucket is None:
            return ""
        mine = self._counts.get(bucket.name, 0)
        counts: dict[int, Optional[int]] = {}
        try:
            for r in self._ranks:
                key = self._key(bucket.name, r)
                counts[r] = int(self._store.get(key)) if self._store.check([key]) else None
        except Exception as e:  # noqa: BLE001
            return (f"; the readiness of other ranks is unknown: the torch.distributed store is unreachable ({e}), "
                    "so the rank hosting it (MASTER_ADDR, usually rank 0) has probably died")
        behind = [r for r, c in counts.items() if c is None or c < mine]
        tensors = f"; tensors {bucket.layout.names}"
        if not behind:
            return tensors + (f"; every rank marked it ready ({_times(mine)}), so the collective itself hangs: a "
                              "rank died or its network failed (see the other ranks' logs)" if stuck else "")
        seen = ", ".join(f"rank {r}: {'never' if counts[r] is None else _times(counts[r])}" for r in behind)
        return (f"{tensors}; ranks {behind} had not marked it ready ({seen}; this rank {self._me}: {_times(mine)}): "
                "they died, hang, or skipped a backward / optimizer step that this rank ran")


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def store_allgather(tag: str, data: bytes, group: Optional[dist.ProcessGroup], timeout: float,
                    what: str) -> list[bytes]:
    """Every rank's ``data`` through the store (not a collective), waiting at most ``timeout`` seconds.

    The caller encodes and decodes (``core.wire``: plain JSON, checked on
    arrival).  Each call must use a ``tag`` unique to the check and to its
    occurrence (e.g. a rebuild counter), the same on every rank; ``what``
    starts the error messages.
    """
    store = c10d._get_default_store()
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    keys = [f"bagua_x/check/{restart_count()}/{tag}/{r}" for r in ranks]
    store.set(keys[ranks.index(dist.get_rank())], data)
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 -- a store timeout is a RuntimeError or a DistStoreError
        try:
            missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        except Exception:  # noqa: BLE001
            raise BaguaXError(
                f"{what}: the torch.distributed store became unreachable ({type(e).__name__}: {e}); the rank hosting "
                "it (MASTER_ADDR, usually rank 0) has probably died or exited"
            ) from e
        raise BaguaXError(
            f"{what}: ranks {missing} did not arrive within {timeout:g} s ({type(e).__name__}); they died, hang, or "
            "are at a different step (e.g. resumed from a different checkpoint)"
        ) from e
    return [store.get(k) for k in keys]
