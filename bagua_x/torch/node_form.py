"""``hierarchical=None`` on >= 2 nodes of >= 2 ranks: flat or over nodes, chosen by timing training steps.

The first training steps are the trial (:class:`~bagua_x.core.autotune.StepTrial`):
at each one's forward (nothing in flight) the communicator is switched to the
step's form (:meth:`~.communicator.TorchCommunicator.use_nodes`, the node
groups stay), so the engines, QAdam's warmup allreduce included, follow it.
A step is one the engine communicated on every rank (``Engine.synced_steps``),
so a rank's extra forwards (with grad on) never move its plan ahead alone;
after the trial every rank takes the form the slowest rank's median step
favours.  Whole steps are timed, not a reduce alone: what a form costs the
rest of the step (cores shared with compute, links shared with the data
loader) counts.  An algorithm whose state refers to the peers of one form
(``state_follows_form``: LowPrecisionDecentralized's neighbour estimates are of
ranks in one, of nodes in the other) restarts it at each switch from the
ranks' average weights, as at ``wrap``.

The choice is saved in ``algorithm_state_dict()``, and a state that holds one
sets it instead of timing again: a resumed run continues in its form, bitwise.
A checkpoint taken during the trial holds no choice: the resumed run times
again (restarting such state at the trial's first step).  With
``BAGUA_X_FORM_CACHE`` set on rank 0, a decision recorded by an earlier job of
the same topology is checked in its first steps and kept if it still fits
(:mod:`~bagua_x.core.form_cache`); a new decision is recorded there.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import torch

from .. import __version__
from ..algorithms.base import Algorithm
from ..core import form_cache
from ..core.autotune import StepTrial
from ..core.comm import Feature, ReduceOp
from .communicator import TorchCommunicator

__all__ = ["NodeForm", "FORM_KEY"]

log = logging.getLogger(__name__)

FORM_KEY = "hierarchical"  # in algorithm_state_dict(): True over nodes, False flat (absent: not chosen yet)


class NodeForm:
    """The form of a wrapper's algorithm: measured once where ``hierarchical=None`` meets node groups."""

    def __init__(self, algorithm: Algorithm, comm: TorchCommunicator):
        self.algorithm, self.comm = algorithm, comm
        self.measured = algorithm.timed_form and Feature.HIERARCHICAL in comm.features
        self.two_level: Optional[bool] = None  # chosen (or loaded) form; None: not yet
        self._trial: Optional[StepTrial] = None  # the steps being timed
        self._key = ""  # this wrapper's topology in the form cache, known at the trial's first step
        self._running: Optional[bool] = None  # the form the trial's current step runs in
        self._synced = 0  # the engine's synced_steps when the trial last advanced
        self._state_fits = True  # the state fits either form (made at wrap), or the one running
        self._device = torch.device("cpu")

    @property
    def pending(self) -> bool:
        return self.measured and self.two_level is None

    def at_step(self, engine) -> None:
        """A forward with grad (nothing in flight): if the engine communicated a step since the trial last
        advanced, that step is over: end its timing and run the next in the trial's next form; after the trial,
        take the faster form (collective: every rank's steps).

        The trial advances on steps every rank communicated (``engine.synced_steps``), not on forwards: a rank
        running an extra forward with grad on (logging predictions) would otherwise move its plan ahead alone,
        and the ranks, running different forms, would wait on each other until the timeout."""
        if self._trial is None:
            self._device = engine.buckets[0].buffer.device if engine.buckets else torch.device("cpu")
            self._key = self._topology(engine)
            first = self.comm.rank == 0
            self._trial = StepTrial(form_cache.share(form_cache.load(self._key) if first else [], first,
                                                     self._slowest))
        elif engine.synced_steps == self._synced:
            return
        self._synced = engine.synced_steps
        self._trial.end(time.perf_counter())
        form = self._trial.form()
        if form is None:
            checking = bool(self._trial.known)
            choice = self._trial.choose(self._slowest, type(self.algorithm).__name__)
            if choice is not None:
                if not checking and self.comm.rank == 0:
                    form_cache.record(self._key, choice)
                self._trial = None
                self._switch(choice.two_level, engine)
                self.two_level = choice.two_level
                return
            form = self._trial.form()  # the recorded decisions did not fit: both forms are timed
        if form is not self._running or not self._state_fits:
            self._switch(form, engine)
        self._trial.begin(time.perf_counter())

    def _topology(self, engine) -> str:
        """What makes the forms' programs differ, for the form cache (links and load are checked by timing)."""
        return form_cache.topology(
            frontend="torch", algorithm=repr(self.algorithm), world=self.comm.size,
            local=self.comm.node_size,
            buckets=[int(b.buffer.numel()) for b in engine.buckets], dtypes=sorted({str(b.buffer.dtype)
                                                                                    for b in engine.buckets}),
            device=self._device.type, versions=[torch.__version__, __version__])

    def _slowest(self, values: Sequence[float]) -> list[float]:
        values = torch.tensor(values, dtype=torch.float64, device=self._device)
        return self.comm.allreduce(values, ReduceOp.MAX).tolist()

    def _switch(self, two_level: bool, engine) -> None:
        self.comm.use_nodes(two_level)
        other = self._running is not None and two_level is not self._running
        if self.algorithm.state_follows_form and (other or not self._state_fits):
            engine.restart_state()
        self._running, self._state_fits = two_level, True

    def save(self, state: dict) -> dict:
        return state if self.two_level is None or not self.measured else {**state, FORM_KEY: self.two_level}

    def load(self, saved: dict) -> dict:
        """``saved`` without the form, which is taken where this wrapper measures its form."""
        saved = dict(saved)
        form = saved.pop(FORM_KEY, None)
        if form is not None and self.measured:
            log.info("bagua_x: %s runs %s, as in the loaded algorithm state", type(self.algorithm).__name__,
                     "over nodes" if form else "flat")
            self._set(bool(form))
        elif self.measured:  # saved during a trial, in a form not recorded
            self._state_fits = False
        if form is not None and not self.measured:
            log.warning("bagua_x: the loaded algorithm state ran %s by measurement, but here %s runs in the form "
                        "its hierarchical= setting and the node layout give; keeping that",
                        "over nodes" if form else "flat", type(self.algorithm).__name__)
        return saved

    def _set(self, two_level: bool) -> None:
        self.two_level = two_level
        self.comm.use_nodes(two_level)

