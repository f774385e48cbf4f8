"""Readiness, written once: when a tensor's value is final, and which buckets may go.

**Which buckets may go.**  Tensors become final in whatever order backward
produces them, and that order may differ across ranks, while collectives must
be issued in the same order everywhere: bucket ``k`` is launched only once
buckets ``0..k-1`` were, so a bucket complete early waits for its
predecessors.  One counter per bucket (tensors still missing), decremented by
tensor index: a backward hook's hot path is a few list operations.

**When a gradient is final.**  A post-accumulate-grad hook fires once per
accumulation.  Usually that is once per backward, but reentrant activation
checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) runs one
nested backward per checkpointed segment, so a parameter used by two segments
gets two firings, the first with a partial gradient.  Communicating its bucket
then would reduce the partial gradient while the rest is still being added.
As DDP's reducer (``numGradHooksTriggeredMap_``):

* without ``static_graph`` a tensor is final at its first firing, and a
  second firing in the same backward is an error naming the parameter;
* with ``static_graph=True`` the first synchronised backward only counts the
  firings and makes every tensor final at its end (in the order of each one's
  last firing); from then on a tensor is final when its hook has fired that
  many times in the backward.

Errors come from the graph's structure, which every rank shares, so every
rank raises at the same hook; buckets already launched were launched
everywhere and the next forward's ``settle()`` ends them.

:class:`ReadyCounts` is the one implementation; the torch engines drive it by
tensor index from their hooks, and :class:`BucketDispatcher` drives it from
core :class:`~.bucket.Bucket` objects for Bagua's tensor API
(``bagua_mark_communication_ready``).
"""


from __future__ import annotations

from typing import Callable, Optional, Sequence

from .bucket import Bucket
from .errors import BaguaXError

__all__ = ["ReadyCounts", "BucketDispatcher"]

_NONE = range(0)


class ReadyCounts:
    """Per-backward hook firings of the tensors ``names`` (by index) and their buckets' missing counts."""

    def __init__(self, names: Sequence[str], static_graph: bool):
        self._names = list(names)
        self.static_graph = static_graph
        # firings that make a tensor final; None while the first static-graph backward counts them
        self.expected: Optional[list[int]] = None if static_graph else [1] * len(self._names)
        self._members: list[list[int]] = []
        self._buckets: list[str] = []
        self._bucket_of: list[int] = []
        self.reset()

    def set_buckets(self, names: Sequence[str], members: Sequence[Sequence[int]]) -> None:
        """The buckets, in launch order: their ``names`` and the tensor indices in each; counts start again."""
        self._buckets, self._members = list(names), [list(m) for m in members]
        self._bucket_of = [0] * len(self._names)
        for k, m in enumerate(self._members):
            for i in m:
                self._bucket_of[i] = k
        self.reset()

    # -- firings ------------------------------------------------------------------------
    def fire(self, i: int) -> bool:
        """Count one firing of tensor ``i``'s hook; True when its gradient is final now."""
        self._fired[i] += 1
        if self.expected is None:
            self._last.pop(i, None)
            self._last[i] = None
            return False
        if self._fired[i] > self.expected[i]:
            raise BaguaXError(self._too_many(self._names[i], self._fired[i], self.expected[i]))
        return self._fired[i] == self.expected[i]

    def end(self) -> list[int]:
        """At the end of a backward: the tensors that became final only now (the first static-graph
        backward's, in the order their hooks last fired); a tensor whose hook fired fewer times than
        it should have is an error."""
        if self.expected is None:
            self.expected = self._fired
            return list(self._last)
        short = [(self._names[i], n, e) for i, (n, e) in enumerate(zip(self._fired, self.expected)) if 0 < n < e] \
            if self.static_graph else []  # else every tensor that fired is final
        if short:
            name, n, e = short[0]
            raise BaguaXError(
                f"bagua_x: the gradient hook of parameter {name!r} fired {n} time(s) in this backward but {e} "
                "times in the first one, so its gradient never became final; static_graph=True needs the same "
                "autograd graph in every iteration: pass static_graph=False if the graph changes"
            )
        return []

    # -- buckets ------------------------------------------------------------------------
    def ready(self, i: int) -> range:
        """Tensor ``i`` is final (again: no effect): the buckets to launch now, in order (often none)."""
        if self._done[i]:
            return _NONE
        self._done[i] = True
        k = self._bucket_of[i]
        self._left[k] -= 1
        if k != self._next or self._left[k]:
            return _NONE
        first, n = self._next, len(self._left)
        while self._next < n and not self._left[self._next]:
            self._next += 1
        return range(first, self._next)

    @property
    def launched(self) -> int:
        """How many buckets (the first ones, in order) were launched in this backward."""
        return self._next

    def unready(self) -> list[int]:
        """Tensors not final in the buckets not launched yet (e.g. parameters unused in forward), in bucket order."""
        return [i for m in self._members[self._next:] for i in m if not self._done[i]]

    def check_all_launched(self, frozen: Callable[[int], bool]) -> None:
        """Raise naming the first bucket not launched and its tensors never marked ready; ``frozen(i)``:
        tensor ``i``'s parameter no longer requires grad (frozen after wrap, so its hook never fires)."""
        if self._next < len(self._members):
            missing = [i for i in self._members[self._next] if not self._done[i]]
            names = [self._names[i] for i in missing]
            now_frozen = [self._names[i] for i in missing if frozen(i)]
            cause = (f"parameters {now_frozen} have requires_grad=False, set after wrap() registered them: freeze "
                     "parameters before wrap(), or call shutdown() and wrap the model again after freezing"
                     if now_frozen else "a parameter unused in forward? wrap with find_unused_parameters=True")
            raise BaguaXError(
                f"bucket {self._buckets[self._next]!r} was never dispatched: tensors {names} were not marked ready "
                f"this step ({cause})"
            )

    def reset(self) -> None:
        """A new backward (or one that raised): no firing, no tensor final, no bucket launched."""
        self._fired = [0] * len(self._names)
        self._last: dict[int, None] = {}  # while counting: tensor indices, ordered by their latest firing
        self._done = [False] * len(self._names)
        self._left = [len(m) for m in self._members]
        self._next = 0

    def _too_many(self, name: str, fired: int, expected: int) -> str:
        if not self.static_graph:
            return (
                f"bagua_x: the gradient hook of parameter {name!r} fired a second time in one backward, after "
                "the parameter was marked ready, so its bucket would be communicated with a partial gradient. "
                "A parameter used by several reentrant activation-checkpointed segments "
                "(torch.utils.checkpoint(..., use_reentrant=True)) gets one hook call per segment: pass "
                "wrap(..., static_graph=True) (the first iteration counts the calls, as DDP does), or "
                "checkpoint with use_reentrant=False"
            )
        return (
            f"bagua_x: the gradient hook of parameter {name!r} fired {fired} times in this backward but "
            f"{expected} time(s) in the first one; static_graph=True needs the same autograd graph in every "
            "iteration: pass static_graph=False if the graph changes"
        )


class BucketDispatcher:
    """Calls ``dispatch(bucket)`` for core buckets as their tensors are marked ready
    (``RegisteredTensor.mark_ready``), strictly in list order, through a :class:`ReadyCounts`."""

    def __init__(self, buckets: Sequence[Bucket], dispatch: Callable[[Bucket], None]):
        self.buckets = list(buckets)
        self._dispatch = dispatch
        self._tensors = [t for b in self.buckets for t in b.tensors]
        self._index = {id(t): i for i, t in enumerate(self._tensors)}
        self.counts = ReadyCounts([t.name for t in self._tensors], static_graph=False)
        starts = [0]
        for b in self.buckets:
            starts.append(starts[-1] + len(b.tensors))
        self.counts.set_buckets([b.name for b in self.buckets],
                                [range(a, z) for a, z in zip(starts, starts[1:])])
        for b in self.buckets:
            b.on_ready = self._on_ready

    def _on_ready(self, tensor) -> None:
        for k in self.counts.ready(self._index[id(tensor)]):
            self._dispatch(self.buckets[k])

    @property
    def all_dispatched(self) -> bool:
        return self.counts.launched == len(self.buckets)

    def pending(self) -> list[Bucket]:
        """Buckets not dispatched yet (for stall reports)."""
        return self.buckets[self.counts.launched:]

    def unready_tensors(self) -> list:
        """Tensors of buckets not dispatched yet that were not marked ready this step (e.g. parameters unused
        in forward)."""
        return [self._tensors[i] for i in self.counts.unready()]

    def check_all_dispatched(self) -> None:
        """Raise naming the first bucket not dispatched and its tensors never marked ready."""
        self.counts.check_all_launched(lambda i: False)

    def reset(self) -> None:
        """A new step: no tensor marked ready, no bucket dispatched."""
        self.counts.reset()
