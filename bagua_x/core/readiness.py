"""Dispatching ready buckets in one fixed order on every rank.

Tensors become ready in whatever order backward produces them, and that order
may differ across ranks.  Collectives must be issued in the same order
everywhere, so bucket ``k`` is dispatched only once buckets ``0..k-1`` were:
a bucket that becomes ready early waits for its predecessors.
"""

from __future__ import annotations

from typing import Callable, Sequence

from .bucket import Bucket
from .errors import BaguaXError

__all__ = ["BucketDispatcher"]


class BucketDispatcher:
    """Calls ``dispatch(bucket)`` for ready buckets, strictly in list order."""

    def __init__(self, buckets: Sequence[Bucket], dispatch: Callable[[Bucket], None]):
        self.buckets = list(buckets)
        self._dispatch = dispatch
        self._next = 0
        for b in self.buckets:
            b.on_ready = self._on_ready

    def _on_ready(self, _bucket: Bucket) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].ready:
            bucket = self.buckets[self._next]
            self._next += 1
            self._dispatch(bucket)

    @property
    def all_dispatched(self) -> bool:
        return self._next == len(self.buckets)

    def pending(self) -> list[Bucket]:
        """Buckets not dispatched yet (for stall reports)."""
        return self.buckets[self._next :]

    def unready_tensors(self) -> list:
        """Tensors of buckets not dispatched yet that were not marked ready this step
        (e.g. parameters unused in forward), listed before any of them is marked."""
        unready = []
        for bucket in self.pending():
            missing = set(bucket.not_ready())
            unready.extend(t for t in bucket.tensors if t.name in missing)
        return unready

    def check_all_dispatched(self) -> None:
        if not self.all_dispatched:
            stuck = self.buckets[self._next]
            raise BaguaXError(
                f"bucket {stuck.name!r} was never dispatched: tensors {stuck.not_ready()} were not marked ready "
                "this step (a parameter unused in forward? wrap with find_unused_parameters=True)"
            )

    def reset(self) -> None:
        self._next = 0
        for b in self.buckets:
            b.reset_ready()
