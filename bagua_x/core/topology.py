"""The two-level form: when a node layout allows it, and flat or over nodes chosen by timing both forms.

On the layout (:func:`two_level_on`): with one rank per node the two levels
would be the flat exchange again, and on one node there is no slow link to
spare, so ``hierarchical=None`` runs over nodes only on >= 2 nodes of >= 2 ranks.

Which form of a hierarchical algorithm is faster depends on the links: with
NVLink inside a node the in-node reduce-scatter is nearly free and the two
levels win; on CPU nodes at 1 Gbit/s it costs what it saves, and
LowPrecisionDecentralized over nodes loses outright.  No rule of thumb
predicts it, so a frontend times both.

The two forms run different collectives, so every rank must take the same
branch: each rank times both, the times are replaced by their maximum over
ranks (``slowest``, a collective: every rank gets the same numbers) and every
rank compares the same two numbers.

What is timed is whole training steps (:class:`StepTrial`, both frontends;
JAX through ``dp.step``): a reduce timed alone misses what a form costs the
rest of the step.  On CPU nodes LowPrecisionDecentralized over nodes reduced
faster alone and made whole steps slower (the in-node stages compete with
compute for the cores), and a wrap-time reduce timing chose the slower form
in 7 of 8 measured cells, so there is none.

A :class:`StepTrial` given the decisions recorded for this topology by
earlier jobs (:mod:`.form_cache`) first checks them instead: it runs a block
in the latest one's form and keeps the decision whose step time in that form
is within :data:`FITS` of the block's, else times both forms as usual.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from typing import Callable, Optional, Sequence

__all__ = ["FormChoice", "FITS", "StepTrial", "two_level_on"]

log = logging.getLogger(__name__)

FITS = 0.25  # a recorded decision holds while a step in its form takes within 25 % of the recorded time


def two_level_on(setting: Optional[bool], nodes: int, ranks_per_node: int) -> bool:
    """:func:`~bagua_x.algorithms.base.hierarchical`'s decision from the node layout alone, before any node group exists:
    frontends check that every rank decides the same before they make groups."""
    return setting is not False and nodes >= 2 and (setting is True or ranks_per_node >= 2)


@dataclasses.dataclass(frozen=True)
class FormChoice:
    """The form every rank takes, and the slowest rank's median time of one round in each."""

    two_level: bool
    flat_seconds: float
    two_level_seconds: float

    def seconds(self, two_level: bool) -> float:
        return self.two_level_seconds if two_level else self.flat_seconds


def _decide(times: dict[bool, list[float]], slowest: Callable[[Sequence[float]], Sequence[float]], what: str,
            timed: str, count: str) -> FormChoice:
    """The form with the smaller median time at the slowest rank (collective; flat on a tie), logged."""
    flat, two = (float(t) for t in slowest([statistics.median(times[False]), statistics.median(times[True])]))
    choice = FormChoice(two < flat, flat, two)
    log.info("bagua_x: %s runs %s, by measurement: %s took %.2f ms flat and %.2f ms over nodes (median of %s, "
             "slowest rank)", what, "over nodes" if choice.two_level else "flat", timed, flat * 1e3, two * 1e3, count)
    return choice


class StepTrial:
    """The first training steps, run in each form in turn, each timed from :meth:`begin` to :meth:`end`.

    The plan: ``ROUNDS`` rounds of a block flat and a block over nodes, each
    block one untimed step then ``BLOCK`` timed ones.  The untimed first step
    of a block takes what a switch costs once: the first builds buckets, opens
    connections and compiles; later, the first step after a switch ran up to
    80 % slower than the next on the 2 x 2 CPU cluster (ByteGrad over nodes,
    300 ms on a 350 ms step), a cost training in one form never pays, which
    made the trial choose flat where over nodes was 20 % faster.  A frontend
    calls, at each training step's start: :meth:`end` (the step before it is
    over), then :meth:`form` (the form to run, switching if it changed; None
    when a decision is due: then :meth:`choose`, and :meth:`form` again if it
    returned None), then :meth:`begin` once switched, so a switch's own cost is
    not timed either.

    With ``known`` decisions (the same on every rank: recorded for this
    topology by earlier jobs, latest first), the plan is one block in the
    latest one's form; :meth:`choose` then keeps the decision whose time in
    that form is closest to the block's median, if within :data:`FITS` of it
    (the link and the load are as they were then), and otherwise the usual
    plan follows.  A kept decision costs no step in the other form.
    """

    BLOCK = 2  # timed steps in a row in one form, after the block's untimed first step
    ROUNDS = 2  # so 12 steps in all, 4 timed in each form

    def __init__(self, known: Sequence[FormChoice] = ()):
        self.known = list(known)
        self._plan: list[tuple[bool, bool]] = []  # (over nodes, timed) of each step
        if self.known:
            self._add_block(self.known[0].two_level)
        else:
            self._add_rounds()
        self._next = 0  # index in the plan of the step to start next
        self._started: Optional[float] = None
        self.times: dict[bool, list[float]] = {False: [], True: []}

    def _add_block(self, two_level: bool) -> None:
        self._plan += [(two_level, False)] + [(two_level, True)] * self.BLOCK

    def _add_rounds(self) -> None:
        for _ in range(self.ROUNDS):
            for two_level in (False, True):
                self._add_block(two_level)

    @property
    def steps(self) -> int:
        """Training steps the trial takes (checking known decisions: if one fits)."""
        return len(self._plan)

    def end(self, now: float) -> None:
        """The step begun last (if any) is over at ``now``."""
        if self._started is not None:
            two_level, timed = self._plan[self._next - 1]
            log.debug("bagua_x: trial step %d (%s%s): %.2f ms", self._next - 1, "over nodes" if two_level else "flat",
                      "" if timed else ", untimed", (now - self._started) * 1e3)
            if timed:
                self.times[two_level].append(now - self._started)
            self._started = None

    def form(self) -> Optional[bool]:
        """The form of the step about to start (True: over nodes), or None when a decision is due."""
        return self._plan[self._next][0] if self._next < len(self._plan) else None

    def begin(self, now: float) -> None:
        """The step in :meth:`form` starts at ``now``."""
        self._next += 1
        self._started = now

    def choose(self, slowest: Callable[[Sequence[float]], Sequence[float]], what: str) -> Optional[FormChoice]:
        """The faster form by the slowest rank's median step (collective: every rank takes the same form), logged; while
        checking known decisions, the one that fits, or None (then the plan goes on: both forms are timed)."""
        if not self.known:
            return _decide(self.times, slowest, what, "a training step", f"{len(self.times[False])} steps each")
        form = self.known[0].two_level
        name = "over nodes" if form else "flat"
        (seconds,) = slowest([statistics.median(self.times[form])])
        recorded = min(self.known, key=lambda c: abs(c.seconds(form) - seconds))
        if abs(recorded.seconds(form) - seconds) <= FITS * recorded.seconds(form):
            log.info("bagua_x: %s runs %s, as recorded for this topology: a training step took %.2f ms %s, "
                     "recorded %.2f ms (decided then on %.2f ms flat and %.2f ms over nodes)", what,
                     "over nodes" if recorded.two_level else "flat", seconds * 1e3, name,
                     recorded.seconds(form) * 1e3, recorded.flat_seconds * 1e3, recorded.two_level_seconds * 1e3)
            return recorded
        log.info("bagua_x: %s: a training step took %.2f ms %s, no recorded decision for this topology within "
                 "%d %% of it (%s); timing both forms", what, seconds * 1e3, name, round(FITS * 100),
                 ", ".join(f"{c.seconds(form) * 1e3:.2f} ms" for c in self.known))
        self.known, self.times = [], {False: [], True: []}
        self._add_rounds()
        return None
