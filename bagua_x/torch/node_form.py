"""The two-level form in torch: the node layout every rank agrees on, and ``hierarchical=None``'s trial.

**The layout** (:func:`agree_on_nodes`), agreed by every rank before any node group is made.  Which groups
and collectives a rank uses follows from what that rank sees:
its algorithm's ``hierarchical`` setting and torchrun's ``LOCAL_WORLD_SIZE``.
Ranks that see them differently call ``new_group`` a different number of
times or with other ranks, and hang there or fail in gloo much later.  So each
rank first publishes what it sees through the store (JSON, a bounded wait:
:func:`~.store.store_allgather`), and every rank raises the same error,
naming the ranks and their values, when they differ.

**The trial.**  ``hierarchical=None`` on >= 2 nodes of >= 2 ranks: flat or over nodes, chosen by timing
training steps.  The first training steps are the trial (:class:`~bagua_x.core.topology.StepTrial`):
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

import collections
import dataclasses
import logging
import os
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import __version__
from ..algorithms.base import Algorithm
from ..core import form_cache
from ..core.comm import Feature, ReduceOp
from ..core.errors import BaguaXError
from ..core.topology import StepTrial, two_level_on
from ..core.wire import decode, encode
from .store import check_tag, resolve_timeout, store_allgather

__all__ = ["NodeLayout", "agree_on_nodes", "NodeForm", "FORM_KEY"]

log = logging.getLogger(__name__)

FORM_KEY = "hierarchical"  # in algorithm_state_dict(): True over nodes, False flat (absent: not chosen yet)

_SETTINGS = {True: "True (required)", None: "None (over nodes where there are >= 2 nodes of >= 2 ranks)",
             False: "False (flat)"}


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """What every rank agreed on: ``local`` ranks per node, ``nodes`` nodes, and whether the
    algorithm runs in two levels; ``problem`` says why node groups cannot be made (else None)."""

    setting: Optional[bool]
    local: int
    nodes: int
    problem: Optional[str]

    @property
    def two_level(self) -> bool:
        return self.problem is None and two_level_on(self.setting, self.nodes, self.local)



def agree_on_nodes(group: Optional[dist.ProcessGroup], setting: Optional[bool],
                   local_world_size: Optional[int] = None, timeout: Optional[float] = None) -> NodeLayout:
    """This rank's :class:`NodeLayout`, once every rank of ``group`` (None: the default one) agrees on it
    (collective, no groups made).

    ``setting`` is the algorithm's ``hierarchical=``; ``local_world_size``
    defaults to ``LOCAL_WORLD_SIZE`` (torchrun's).  Raises the same BaguaXError
    on every rank when they differ, and a BaguaXError naming the missing ranks
    when some do not arrive within ``timeout`` seconds (None: the group's).
    """
    size = dist.get_world_size(group)
    layout = _layout(group, size, setting, local_world_size)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    nodes = layout.nodes if layout.local >= 1 and size % layout.local == 0 else \
        f"{size}/{layout.local}, not a whole number"
    mine = [_SETTINGS[setting], layout.local, nodes, "two-level" if layout.two_level else "flat"]
    context = "bagua_x: the ranks' hierarchical settings and node layouts"
    gathered = store_allgather(check_tag("nodes", group), encode(mine), group, resolve_timeout(timeout, group),
                               context)
    views = [decode(data, f"{context}: rank {r}'s view") for r, data in zip(ranks, gathered)]
    for r, v in zip(ranks, views):
        if not (isinstance(v, tuple) and len(v) == len(mine)):
            raise BaguaXError(f"{context}: rank {r} sent {str(v)[:200]!r}; are all ranks on the same bagua_x version?")
    message = _disagreement(ranks, views)
    if message:
        raise BaguaXError(f"bagua_x: ranks disagree on what decides the hierarchical collectives:\n{message}")
    return layout


def _layout(group: Optional[dist.ProcessGroup], size: int, setting: Optional[bool],
            local_world_size: Optional[int]) -> NodeLayout:
    local = int(local_world_size or os.environ.get("LOCAL_WORLD_SIZE", size))
    problem = None
    if group is not None and dist.get_process_group_ranks(group) != list(range(dist.get_world_size())):
        problem = ("hierarchical algorithms need a process group of every rank in order (the default one, or "
                   "new_group() of all ranks)")
    elif local < 1 or size % local:
        problem = (f"world size {size} is not a multiple of LOCAL_WORLD_SIZE={local}; "
                   "launch the same number of ranks on every node")
    return NodeLayout(setting, local, size // local if problem is None else 0, problem)


def _disagreement(ranks: list[int], views: list[tuple]) -> Optional[str]:
    """Each entry that differs, with the ranks that hold each value, and what to do; None if nothing that
    decides collectives differs.

    That is the resolved form, and the layout unless every rank is flat by its
    setting.  Settings that differ but resolve to the same form (e.g. None and
    False on one node) make no group: wrap's model check reports them.
    """
    names = ("hierarchical", "LOCAL_WORLD_SIZE (ranks per node)", "number of nodes", "resolved form")
    settings = {v[0] for v in views}
    differs = [len({v[i] for v in views}) > 1 for i in range(len(names))]
    layout_matters = settings != {_SETTINGS[False]}  # every rank flat: nodes of different sizes do not matter
    if not (differs[3] or (layout_matters and (differs[1] or differs[2]))):
        return None
    lines = []
    for i, name in enumerate(names):
        if not differs[i] or (i in (1, 2) and not layout_matters):
            continue
        holders: dict = collections.defaultdict(list)
        for r, v in zip(ranks, views):
            holders[v[i]].append(r)
        lines.append(f"  {name}: " + "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: "
                                                f"{value}" for value, rs in holders.items()))
    if differs[0]:
        advice = "give every rank the same algorithm, with the same hierarchical= setting"
    else:
        advice = ("launch the same number of ranks on every node (torchrun --nproc_per_node, which sets "
                  "LOCAL_WORLD_SIZE), or pass hierarchical=False on every rank to train flat on uneven nodes")
    return "\n".join(lines) + f"\nFix: {advice}."


class NodeForm:
    """The form of a wrapper's algorithm: measured once where ``hierarchical=None`` meets node groups."""

    def __init__(self, algorithm: Algorithm, comm):
        """``comm``: the wrapper's :class:`~.communicator.TorchCommunicator`, with node groups or without."""
        self.algorithm, self.comm = algorithm, comm
        self.decided_by_trial = algorithm.timed_form and Feature.HIERARCHICAL in comm.features
        self.two_level: Optional[bool] = None  # chosen (or loaded) form; None: not yet
        self._trial: Optional[StepTrial] = None  # the steps being timed
        self._key = ""  # this wrapper's topology in the form cache, known at the trial's first step
        self._running: Optional[bool] = None  # the form the trial's current step runs in
        self._synced = 0  # the engine's synced_steps when the trial last advanced
        self._state_fits = True  # the state fits either form (made at wrap), or the one running
        self._device = torch.device("cpu")

    @property
    def pending(self) -> bool:
        return self.decided_by_trial and self.two_level is None

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
        return state if self.two_level is None or not self.decided_by_trial else {**state, FORM_KEY: self.two_level}

    def load(self, saved: dict) -> dict:
        """``saved`` without the form, which is taken where this wrapper measures its form."""
        saved = dict(saved)
        form = saved.pop(FORM_KEY, None)
        if form is not None and self.decided_by_trial:
            log.info("bagua_x: %s runs %s, as in the loaded algorithm state", type(self.algorithm).__name__,
                     "over nodes" if form else "flat")
            self._set(bool(form))
        elif self.decided_by_trial:  # saved during a trial, in a form not recorded
            self._state_fits = False
        if form is not None and not self.decided_by_trial:
            log.warning("bagua_x: the loaded algorithm state ran %s by measurement, but here %s runs in the form "
                        "its hierarchical= setting and the node layout give; keeping that",
                        "over nodes" if form else "flat", type(self.algorithm).__name__)
        return saved

    def _set(self, two_level: bool) -> None:
        self.two_level = two_level
        self.comm.use_nodes(two_level)

