"""Flat or over nodes, chosen by timing both forms on the real buckets (Bagua's autotuning, in-process).

Which form of a hierarchical algorithm is faster depends on the links: with
NVLink inside a node the in-node reduce-scatter is nearly free and the two
levels win; on CPU nodes at 1 Gbit/s it costs what it saves, and
LowPrecisionDecentralized over nodes loses outright.  No rule of thumb
predicts it, so a frontend times both.

The two forms run different collectives, so every rank must take the same
branch: each rank times both, the times are replaced by their maximum over
ranks (``slowest``, a collective: every rank gets the same numbers) and every
rank compares the same two numbers.  A round starts on every rank together
(``slowest`` of nothing, untimed), so a rank that finished its last round late
does not make the others wait inside their next timed one.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Callable, Sequence

__all__ = ["FormChoice", "choose_form", "ROUNDS"]

log = logging.getLogger(__name__)

ROUNDS = 3  # timed rounds per form, after one warm-up round of each (compiles kernels, opens connections)


@dataclasses.dataclass(frozen=True)
class FormChoice:
    """The form every rank takes, and the slowest rank's median time of one round in each."""

    two_level: bool
    flat_seconds: float
    two_level_seconds: float


def choose_form(run: Callable[[bool], None], slowest: Callable[[Sequence[float]], Sequence[float]],
                what: str) -> FormChoice:
    """Time ``run(two_level)`` (one reduce of every bucket in that form, finished on return) in both forms.

    ``slowest(values)`` is a collective returning each value's maximum over
    ranks.  Rounds alternate the forms, so a load that comes and goes slows
    both alike; each form's time is its median over :data:`ROUNDS` rounds.  The
    form with the smaller time wins (flat on a tie: it needs no node groups).
    Logs the decision and both times at INFO, naming ``what``.
    """
    run(False)
    run(True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(ROUNDS):
        for two_level in (False, True):
            slowest([0.0])  # every rank starts the round together
            start = time.perf_counter()
            run(two_level)
            times[two_level].append(time.perf_counter() - start)
    flat, two = (float(t) for t in slowest([statistics.median(times[False]), statistics.median(times[True])]))
    choice = FormChoice(two < flat, flat, two)
    log.info("bagua_x: %s runs %s, by measurement: one reduce of every bucket took %.2f ms flat and %.2f ms over "
             "nodes (median of %d rounds, slowest rank)", what, "over nodes" if choice.two_level else "flat",
             flat * 1e3, two * 1e3, ROUNDS)
    return choice
