"""One algorithm's run in the demo, the same for both frontends: when it stops, and what it leaves behind.

At the demo's first link every algorithm trains on the clock for
``seconds`` and on until its held-out accuracy reaches the target (the loss
curve and the time to target).  At a slower link an algorithm takes the same
steps: the seeds are the same and every demo algorithm is synchronous and
deterministic, so it reaches the target at the same step (``reference_step``)
and only the time a step takes changes.  It trains up to that step, or, when
that would take the demo past its few minutes, stops at the ``cap`` on the
clock once it is ``settled``: past its first step (connecting, compiling), its
form trial (ByteGrad & co. on 2 nodes, torch) and one whole exchange period
(DiLoCo syncs once every H steps).  The report then projects the steps left at
the mean step time of that last period (:func:`.demo_report.time_to_target`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Plan:
    """When a run evaluates and when it stops (every rank decides on the same numbers)."""

    seconds: float  # the first link: train at least this long on the clock, then until the target
    target: float  # held-out accuracy
    steps: int  # at most this many steps
    eval_every: int
    reference_step: Optional[int] = None  # a slower link: the step at which the first link reached the target
    cap: float = math.inf  # a slower link: stop past this clock once settled, projecting the rest
    window: int = 1  # steps of one whole exchange period, timed for the projection
    lead: int = 1  # steps before a step is typical: the first one, and a form trial's

    @property
    def settled(self) -> int:
        """Steps run before the run may stop at the cap: the lead-in, then one window."""
        return self.lead + self.window

    def evaluates(self, step: int) -> bool:
        """Whether to evaluate after ``step``: every ``eval_every`` steps, and at a slower link every step once
        settled, where the run may stop at the cap (the evaluation tells every rank the slowest clock)."""
        settled = self.reference_step is not None and step >= self.settled
        return settled or step % self.eval_every == 0 or step in (self.steps, self.reference_step)

    def done(self, step: int, slowest_clock: float, reached: bool) -> bool:
        """After an evaluation at ``step``: whether to stop (``slowest_clock``: the slowest rank's)."""
        if self.reference_step is None:
            return slowest_clock >= self.seconds and reached
        return step >= self.reference_step or (slowest_clock >= self.cap and step >= self.settled)

    def record(self) -> dict:
        """What the report needs to project a run that stopped at the cap."""
        return {"reference_step": self.reference_step, "window": self.window}


def exchange_period(algorithm) -> int:
    """Steps after which the algorithm's communication repeats: DiLoCo's H, ModelAverage's period, the
    decentralized algorithms' interval, else 1."""
    for field in ("sync_every", "period", "communication_interval"):
        if getattr(algorithm, field, None):
            return int(getattr(algorithm, field))
    return 1


def plan_for(algorithm, args, reference_step: Optional[int], trial_steps: int) -> Plan:
    """The plan of one algorithm's run from the demo job's arguments (``trial_steps``: its form trial's)."""
    return Plan(seconds=args.seconds, target=args.target, steps=args.steps, eval_every=args.eval_every,
                reference_step=reference_step, cap=args.cap if reference_step else math.inf,
                window=exchange_period(algorithm), lead=1 + trial_steps)


def job_arguments(description: str, argv=None) -> argparse.Namespace:
    """The arguments of a frontend's demo job (``demo_torch``, ``demo_jax``), as ``bagua-x demo`` passes them."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("algorithms", nargs="+")
    parser.add_argument("--json", required=True, help="where the first process writes the list of runs")
    for name, kind, default in (("steps", int, 200), ("batch", int, 16), ("lr", float, 0.05), ("seed", int, 0),
                                ("hidden", int, 1024), ("eval-every", int, 4), ("seconds", float, 8.0),
                                ("target", float, 0.9), ("cap", float, math.inf)):
        parser.add_argument(f"--{name}", type=kind, default=default)
    parser.add_argument("--reference", nargs="*", default=[], metavar="NAME=STEP",
                        help="a slower link: the step at which each algorithm reached the target at the first link")
    args = parser.parse_args(argv)
    args.reference = {name: int(step) for name, step in (r.split("=") for r in args.reference)}
    return args
