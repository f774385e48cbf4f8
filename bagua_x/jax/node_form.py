"""``hierarchical=None`` on >= 2 nodes of >= 2 devices: flat or over nodes, chosen by timing both.

Two timings, as in torch (:mod:`~bagua_x.core.autotune`):

* At ``wrap`` (every process calls it), both forms of the algorithm's
  ``reduce`` are compiled under ``pmap`` over all devices -- the axis and node
  groups of a pmapped step -- on zero buckets of the real shapes and dtypes
  with throwaway state from ``init``, timed, and every process takes the form
  the slowest device's times favour (:func:`~bagua_x.core.autotune.choose_form`).
  That is the form ``init`` puts in the state.
* Through :meth:`DataParallel.step <bagua_x.jax.wrap.DataParallel.step>`
  (:class:`StepForms`), the first 12 training steps are a trial of whole
  steps in each form (:class:`~bagua_x.core.autotune.StepTrial`), which decides
  in place of the reduce timing: a reduce alone misses what a form costs the
  rest of the step (LowPrecisionDecentralized on CPU nodes reduced faster over
  nodes alone and trained faster flat).  Without ``dp.step`` bagua_x never sees
  the step loop, so the reduce timing stands.

The form is a leaf of each bucket's state: where it is measured, a bucket's
state is a :class:`MeasuredState` (an int32 code and the algorithm's state;
static, the wrap whose trial may switch it), and the step runs the form the
code names (:func:`run_in_form`: ``lax.switch`` between the two forms, both
compiled into the step), so a
trial switches forms by changing a leaf of the step's input, with no new
compile.  The code also says whether a trial may still change the form
(``UNDECIDED``: ``init``'s; a trial's decision clears it), so a state restored
from a checkpoint taken after the decision runs its form, bitwise, whatever
this process measured; one taken before is timed again.  Once decided,
``dp.step`` passes the states on as :class:`DecidedState`, whose form is in
the tree's structure: the step is compiled once more with that form alone,
as fast as a forced form (the switch costs fusion around it).  An algorithm whose
state refers to the peers of one form (``state_follows_form``:
LowPrecisionDecentralized's neighbour estimates are of devices in one form and
of nodes in the other) is restarted at a switch (``RESTART``, cleared by the
step): the weights become the devices' average and the state starts afresh
from them, as at ``init``; whether a step restarts is read from the code of
the state passed in (the form it last ran in), so a call that raised or held
no state (an evaluation through ``dp.step``) loses no restart.  Under
``shard_map`` there are no node groups: the code is carried, the step runs
flat and ``dp.step`` runs no trial.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import __version__
from ..algorithms import Algorithm
from ..algorithms.base import initial_state
from ..core import form_cache
from ..core.autotune import StepTrial, choose_form
from ..core.bucket import BucketLayout
from ..core.comm import Feature, ReduceOp
from .communicator import AxisCommunicator

__all__ = ["DecidedState", "MeasuredState", "StepForms", "form_topology", "measured_form", "run_in_form", "storable", "with_form",
           "OVER_NODES", "UNDECIDED", "RESTART"]

log = logging.getLogger(__name__)

OVER_NODES = 1  # bit of MeasuredState.hierarchical: the form the step runs (0: flat)
UNDECIDED = 2  # bit: the form comes from the reduce timing at wrap; a trial of steps (dp.step) may change it
RESTART = 4  # bit: average the weights and restart the state before this step (a switch; the step clears it)


@jax.tree_util.register_pytree_with_keys_class
class MeasuredState:
    """A bucket's state where the form is measured: the form's code as a leaf, so a checkpoint keeps it.

    ``owner`` (static, in the tree's structure) names the wrap whose trial
    may switch it (:attr:`StepForms.owner`): the states of two wraps may go
    through one ``dp.step``, and each wrap's trial switches its own only.
    """

    def __init__(self, hierarchical: Any, state: Any, owner: int):
        self.hierarchical, self.state, self.owner = hierarchical, state, owner

    def __repr__(self) -> str:
        return f"MeasuredState(hierarchical={self.hierarchical!r}, state={self.state!r}, owner={self.owner})"

    def tree_flatten_with_keys(self):
        keys = jax.tree_util.GetAttrKey
        return ((keys("hierarchical"), self.hierarchical), (keys("state"), self.state)), self.owner

    @classmethod
    def tree_unflatten(cls, owner: int, children) -> "MeasuredState":
        return cls(*children, owner)


@jax.tree_util.register_pytree_with_keys_class
class DecidedState:
    """A bucket's state once ``dp.step``'s trial has decided: the form is static (in the tree's structure).

    So the step is compiled with that form alone, without ``lax.switch``
    between both (on the 2 x 2 CPU cluster, a step holding both forms ran up
    to ~20 % slower than either alone: the branches are not fused with the
    packing around them).  Its leaves and their key paths are
    :class:`MeasuredState`'s, the code decided, so a checkpoint of it restores
    into ``init``'s state, and ``dp.step`` makes that static again.
    """

    def __init__(self, over_nodes: bool, hierarchical: Any, state: Any):
        self.over_nodes, self.hierarchical, self.state = bool(over_nodes), hierarchical, state

    def __repr__(self) -> str:
        return f"DecidedState(over_nodes={self.over_nodes}, hierarchical={self.hierarchical!r}, state={self.state!r})"

    def tree_flatten_with_keys(self):
        keys = jax.tree_util.GetAttrKey
        return ((keys("hierarchical"), self.hierarchical), (keys("state"), self.state)), self.over_nodes

    @classmethod
    def tree_unflatten(cls, over_nodes: bool, children) -> "DecidedState":
        return cls(over_nodes, *children)


def measured_form(algorithm: Algorithm, layouts: Sequence[BucketLayout], axis_name, world_size: int,
                  local: int) -> Optional[bool]:
    """The faster form (True: over nodes), or None where it is not measured here: the setting forces a
    form, there is one node or one device per node, or ``world_size`` is not every device (the step's axis
    is not the pmap over all devices, which is what can be timed)."""
    if not (algorithm.timed_form and local >= 2 and world_size % local == 0 and world_size // local >= 2):
        return None
    if world_size != jax.device_count():
        log.info("bagua_x: %s is not timed flat against over nodes: world_size %d is not the %d devices a pmap "
                 "over all of them has; it runs over nodes where the step has node groups",
                 type(algorithm).__name__, world_size, jax.device_count())
        return None
    run = _timing(algorithm, layouts, axis_name, local)
    return choose_form(run, slowest_over_devices(axis_name), type(algorithm).__name__).two_level


def form_topology(algorithm: Algorithm, layouts: Sequence[BucketLayout], world_size: int, local: int) -> str:
    """What makes the forms' programs differ, for the form cache (links and load are checked by timing)."""
    return form_cache.topology(frontend="jax", algorithm=repr(algorithm), world=world_size, local=local,
                               buckets=[layout.padded_numel for layout in layouts],
                               dtypes=sorted({layout.dtype for layout in layouts}), device=jax.default_backend(),
                               versions=[jax.__version__, __version__])


def with_form(states: tuple, forms: Optional["StepForms"]) -> tuple:
    """Bucket states with the form ``forms``' wrap measured beside them, undecided, owned by that wrap
    (unchanged where no form was measured: ``forms`` None)."""
    if forms is None:
        return states
    code = UNDECIDED | (OVER_NODES if forms.two_level else 0)
    return tuple(MeasuredState(jnp.asarray(code, jnp.int32), st, forms.owner) for st in states)


def run_in_form(fn: Callable, args: Sequence, layout: BucketLayout, state: Any, comm: AxisCommunicator,
                algorithm: Algorithm) -> tuple:
    """``fn(*args, layout, state, comm)`` in the form a :class:`MeasuredState` names, switching on its code, or
    a :class:`DecidedState` fixes (plainly for any other state).

    First, where the code asks for a restart (a switch of a ``state_follows_form`` algorithm, a weight
    algorithm: ``args[0]`` is its weights), the weights become the average over the axis and the state
    ``algorithm.init`` of them.
    """
    flat = AxisCommunicator(comm.axis_name, comm.size)  # one node: no groups
    fn = functools.partial(_unstored, fn, algorithm)
    if isinstance(state, DecidedState):
        over_nodes = state.over_nodes and Feature.HIERARCHICAL in comm.features
        out, inner = fn(*args, layout, state.state, comm if over_nodes else flat)
        return out, DecidedState(state.over_nodes, state.hierarchical, inner)
    if not isinstance(state, MeasuredState):
        return fn(*args, layout, state, comm)
    code, inner, args = state.hierarchical, state.state, tuple(args)
    if algorithm.state_follows_form:
        def restart(operand):
            (x, *rest), _ = operand
            x = flat.allreduce(x, ReduceOp.AVG).astype(x.dtype)
            return (x, *rest), storable(initial_state(algorithm, x, layout, comm.size))

        args, inner = lax.cond(code & RESTART != 0, restart, lambda operand: operand, (args, inner))
    if Feature.HIERARCHICAL not in comm.features:  # shard_map, or the axis does not split into nodes: flat only
        out, inner = fn(*args, layout, inner, comm)
    else:
        out, inner = comm.switch(code & OVER_NODES, [lambda a: fn(*a, layout, inner, flat),
                                                     lambda a: fn(*a, layout, inner, comm)], args)
    return out, MeasuredState(code & ~RESTART, inner, state.owner)


def storable(state: Any) -> Any:
    """``state`` with each zero-size array left out (None, an empty subtree): orbax refuses to save a
    zero-size array, and an algorithm may hold one (DiLoCo's ``pending`` without a delay).  The step's
    state is always in this form; :func:`run_in_form` gives the algorithm the arrays back."""
    return jax.tree.map(lambda a: None if np.size(a) == 0 else a, state)


def _unstored(fn: Callable, algorithm: Algorithm, *args) -> tuple:
    """``fn(*flats, layout, state, comm)`` on the algorithm's whole state (where :func:`storable` left arrays
    out, those of its ``init``'s shapes put back), its new state made storable again."""
    *flats, layout, state, comm = args
    if any(x is None for x in jax.tree.leaves(state, is_leaf=lambda x: x is None)):
        template = jax.eval_shape(lambda x: algorithm.init(x, layout, comm.size),
                                  jax.ShapeDtypeStruct(flats[0].shape, flats[0].dtype))
        given = iter(jax.tree.leaves(state))
        state = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype) if np.size(t) == 0 else next(given), template)
    out, state = fn(*flats, layout, state, comm)
    return out, storable(state)


_owners = itertools.count()  # StepForms.owner: one per wrap with a measured form, in this process


class StepForms:
    """``dp.step``'s trial: its first steps alternate the forms, timed, then every process keeps the faster.

    The forms are switched by writing the code of the wrap's own measured
    states (:class:`MeasuredState`) in the step's arguments
    (:class:`~bagua_x.core.autotune.StepTrial`'s plan; with ``RESTART`` where
    the algorithm's state follows the form and the plan's form is not the one
    the state passed in last ran in, as its code says); the time of a step is
    its call through ``dp.step``, which waits for its results (:meth:`before`,
    the call, :meth:`after`).  A restart runs inside the step, at a block's
    untimed first step (the plan's), so it is not timed.  Only a call whose
    arguments hold the wrap's undecided states is a step of the trial, and
    only once it has returned: a call without them (an evaluation) passes
    through, and a call that raised is not counted, so the next call runs the
    same planned step -- with its restart, since the state passed in says
    which form it ran in.  The decision makes the states
    :class:`DecidedState` (after one more switchable step where it restarts
    the state).  No trial where the arguments hold a decided state (restored:
    keep its form, static), or where the traced step has no node groups
    (``shard_map``: it runs flat).  Another wrap's states pass through
    unchanged: that wrap's own ``dp.step`` drives them.  With
    ``BAGUA_X_FORM_CACHE`` set on process 0, the decisions recorded for
    ``topology`` by earlier jobs are checked first
    (:mod:`~bagua_x.core.form_cache`), and a new decision is recorded.
    """

    def __init__(self, algorithm: Algorithm, axis_name, two_level: bool, topology: str):
        self.algorithm, self.axis_name, self.topology = algorithm, axis_name, topology
        self.two_level = two_level  # the form timed at wrap, which init puts in the states
        self.owner = next(_owners)  # the MeasuredState.owner of this wrap's states
        self.done = False
        #: set while the step is traced: whether it holds both forms (node groups); None: not traced yet
        self.forms_in_step: Optional[bool] = None
        self._trial: Optional[StepTrial] = None  # made at the first trial step (reading the form cache)
        self._form: Optional[int] = None  # the trial's decision
        self._started: Optional[float] = None  # the start of the trial step under way
        self._told: set[str] = set()  # the notes logged once

    def before(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args, kwargs`` with the form of the step about to run written into this wrap's measured states."""
        name, tree, self._started = type(self.algorithm).__name__, (args, kwargs), None
        states = [m for m in jax.tree.leaves(tree, is_leaf=_is_state) if isinstance(m, MeasuredState)]
        mine = [m.hierarchical for m in states if m.owner == self.owner]
        if len(mine) < len(states):
            self._note("others", "bagua_x: %s: the arguments of dp.step's function also hold another wrap's bagua_x "
                       "states; they keep their form unless that wrap's dp.step drives them too "
                       "(dp_a.step(dp_b.step(fn)))", name)
        if not mine:
            self._note("none", "bagua_x: %s: a call through dp.step whose arguments hold no bagua_x state of this "
                       "wrap is not a step of the trial of forms (a step that closes over its state keeps the form "
                       "timed at wrap)", name)
            return args, kwargs
        code = _read(mine[0])
        if not code & UNDECIDED:  # decided: before this trial (a restored state), or by it after a restart
            if self._form is None:
                log.info("bagua_x: %s runs %s, as in the state passed to dp.step (decided before)", name,
                         "over nodes" if code & OVER_NODES else "flat")
            return self._stop(self._write(tree, code, static=True))
        if self.forms_in_step is False:
            log.info("bagua_x: %s runs flat: the step has no node groups (shard_map), so the forms are not timed",
                     name)
            return self._stop(tree)
        if self._trial is None:
            self._slowest, first = slowest_over_devices(self.axis_name), jax.process_index() == 0
            self._trial = StepTrial(form_cache.share(form_cache.load(self.topology) if first else [], first,
                                                     self._slowest))
        planned = self._trial.form()
        if planned is None and self._form is None:
            checking = bool(self._trial.known)
            choice = self._trial.choose(self._slowest, name)
            if choice is None:  # the recorded decisions did not fit: both forms are timed
                planned = self._trial.form()
            else:
                self._form = int(choice.two_level)
                if not checking and jax.process_index() == 0:
                    form_cache.record(self.topology, choice)
        if planned is None:  # decided: the form alone, after one more switchable step where it restarts
            if self._restarts(self._form, code):
                return self._write(tree, self._form | RESTART)
            return self._stop(self._write(tree, self._form, static=True))
        form = int(planned)
        tree = self._write(tree, UNDECIDED | form | (RESTART if self._restarts(form, code) else 0))
        self._started = time.perf_counter()
        return tree

    def after(self) -> None:
        """The call started by the last :meth:`before` has returned, its results ready: a trial step is over."""
        if self._started is not None and self._trial is not None:
            self._trial.begin(self._started)
            self._trial.end(time.perf_counter())
            self._started = None

    def _restarts(self, form: int, code: int) -> bool:
        """Whether running ``form`` on a state whose ``code`` says the form it ran in restarts the state."""
        return self.algorithm.state_follows_form and form != code & OVER_NODES

    def _write(self, tree, code: int, static: bool = False):
        """``tree`` with this wrap's measured states' code set to ``code``, placed as the old one (no new compile);
        with ``static``, as a :class:`DecidedState` of that form (compiled once more, with the form alone)."""
        def put(old):
            value = np.full(np.shape(old), code, np.int32)
            if isinstance(old, jax.Array):
                return jax.make_array_from_callback(old.shape, old.sharding, lambda index: value[index])
            return value

        def rewrite(m):
            if not isinstance(m, MeasuredState) or m.owner != self.owner:
                return m
            if static:
                return DecidedState(bool(code & OVER_NODES), put(m.hierarchical), m.state)
            return MeasuredState(put(m.hierarchical), m.state, m.owner)

        return jax.tree.map(rewrite, tree, is_leaf=_is_state)

    def _note(self, key: str, message: str, *args) -> None:
        """Log ``message`` at the first call that needs it only."""
        if key not in self._told:
            self._told.add(key)
            log.info(message, *args)

    def _stop(self, tree: tuple) -> tuple[tuple, dict]:
        self.done = True
        return tree


def _is_state(x) -> bool:
    return isinstance(x, (MeasuredState, DecidedState))


def _read(code) -> int:
    """One device's value of a code leaf (a tiny transfer, allowed under a transfer guard)."""
    with jax.transfer_guard("allow"):
        shards = getattr(code, "addressable_shards", None)
        return int(np.asarray(shards[0].data if shards else code).reshape(-1)[0])


def slowest_over_devices(axis_name) -> Callable[[Sequence[float]], list[float]]:
    """``slowest(values)``: each value's maximum over every device of every process (a pmap: collective)."""
    devices = jax.local_device_count()
    maximum = jax.pmap(lambda t: lax.pmax(t, axis_name), axis_name=axis_name)

    def slowest(values: Sequence[float]) -> list[float]:
        out = maximum(np.tile(np.asarray(values, np.float32), (devices, 1)))
        return np.asarray(out.addressable_shards[0].data).reshape(-1).tolist()

    return slowest


def _timing(algorithm: Algorithm, layouts: Sequence[BucketLayout], axis_name, local: int) -> Callable[[bool], None]:
    """``run(two_level)``, one reduce of every bucket in that form, for :func:`~bagua_x.core.autotune.choose_form`."""
    devices, world = jax.local_device_count(), jax.device_count()
    per_device = lambda a: np.broadcast_to(np.asarray(a), (devices, *np.shape(a)))  # noqa: E731
    flats = [np.zeros((devices, lay.padded_numel), lay.dtype) for lay in layouts]
    states = [jax.tree.map(per_device, initial_state(algorithm, jnp.zeros((lay.padded_numel,), lay.dtype), lay,
                                                     world)) for lay in layouts]

    def program(two_level: bool):
        def body(flats, states):
            comm = AxisCommunicator(axis_name, local if two_level else world)  # nodes of all devices: flat
            return [algorithm.reduce(x, lay, st, comm)[0] for x, lay, st in zip(flats, layouts, states)]
        return jax.pmap(body, axis_name=axis_name)

    programs = {form: program(form) for form in (False, True)}

    def run(two_level: bool) -> None:
        jax.block_until_ready(programs[two_level](flats, states))

    return run
