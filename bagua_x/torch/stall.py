"""Stall reports that name the lagging ranks (as Horovod's stall inspector does).

When a rank dies or stops calling backward, the others block inside a
collective, which cannot say who is missing: it is what is stuck.  So every
rank records in the torch.distributed store how many times it has launched
each bucket (one ``store.set`` per bucket per step, off the training thread).
When a wait fails or times out, the rank reads everyone's counters and names
the ranks that are behind on the stuck bucket.

Keys carry torchrun's restart count, so a restarted job never reads the
previous attempt's counters.
"""

from __future__ import annotations

import itertools
import logging
from typing import Optional

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..core.bucket import Bucket
from .watchdog import restart_count

__all__ = ["StallInspector"]

log = logging.getLogger(__name__)

_inspector_ids = itertools.count()  # engines are created in the same order on every rank


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


