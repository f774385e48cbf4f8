"""When a tensor's gradient is final: how many times its hook fires in one backward (DDP's ``static_graph``).

A post-accumulate-grad hook fires once per accumulation.  Usually that is
once per backward, but reentrant activation checkpointing
(``torch.utils.checkpoint(..., use_reentrant=True)``) runs one nested backward
per checkpointed segment, so a parameter used by two segments gets two
firings, the first with a partial gradient.  Communicating its bucket then
would reduce the partial gradient while the rest is still being added.

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
"""

from __future__ import annotations

from typing import Optional, Sequence

from ..core.errors import BaguaXError
from ..core.tensor import RegisteredTensor

__all__ = ["ReadyCounts"]


class ReadyCounts:
    """Per-backward hook firings of ``tensors`` and the number that makes each one final."""

    def __init__(self, tensors: Sequence[RegisteredTensor], static_graph: bool):
        self._tensors = list(tensors)
        self._index = {t.name: i for i, t in enumerate(self._tensors)}
        self.static_graph = static_graph
        # firings that make a tensor final; None while the first static-graph backward counts them
        self.expected: Optional[list[int]] = None if static_graph else [1] * len(self._tensors)
        self._fired = [0] * len(self._tensors)
        self._last: dict[int, None] = {}  # while counting: tensor indices, ordered by their latest firing

    def fire(self, t: RegisteredTensor) -> bool:
        """Count one firing of ``t``'s hook; True when its gradient is final now."""
        i = self._index[t.name]
        self._fired[i] += 1
        if self.expected is None:
            self._last.pop(i, None)
            self._last[i] = None
            return False
        if self._fired[i] > self.expected[i]:
            raise BaguaXError(self._too_many(t.name, self._fired[i], self.expected[i]))
        return self._fired[i] == self.expected[i]

    def end(self) -> list[RegisteredTensor]:
        """At the end of a backward: the tensors that became final only now (the first static-graph
        backward's, in the order their hooks last fired); a tensor whose hook fired fewer times than
        it should have is an error.  The counts start again for the next backward."""
        fired, self._fired = self._fired, [0] * len(self._tensors)
        if self.expected is None:
            self.expected = fired
            last, self._last = self._last, {}
            return [self._tensors[i] for i in last]
        short = [(t.name, n, e) for t, n, e in zip(self._tensors, fired, self.expected) if 0 < n < e] \
            if self.static_graph else []  # else every tensor that fired is final
        if short:
            name, n, e = short[0]
            raise BaguaXError(
                f"bagua_x: the gradient hook of parameter {name!r} fired {n} time(s) in this backward but {e} "
                "times in the first one, so its gradient never became final; static_graph=True needs the same "
                "autograd graph in every iteration: pass static_graph=False if the graph changes"
            )
        return []

    def reset(self) -> None:
        """A backward that raised: forget its firings (a first static-graph backward counts again)."""
        self._fired = [0] * len(self._tensors)
        self._last = {}

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
