"""``hierarchical=None`` on >= 2 nodes of >= 2 devices: flat or over nodes, decided by whole training steps.

No step can tell which form is faster from a reduce alone (LowPrecisionDecentralized on CPU nodes reduced
faster over nodes and trained faster flat), so the form is decided by the first 12 training steps through
:meth:`DataParallel.step <bagua_x.jax.wrap.DataParallel.step>` (:class:`StepForms`: the trial of
:class:`~bagua_x.core.topology.StepTrial`, the same as torch's).  Until then, and in a step not run
through ``dp.step`` (bagua_x never sees that loop), the step runs flat; ``wrap`` logs it.

Each bucket's state is a :class:`FormState`: the form the step runs is static, in the tree's structure,
so a step is compiled with one form alone (no ``lax.switch`` between both: on GPU a conditional reads its
predicate back to the host, and on the 2 x 2 CPU cluster a step holding both forms ran up to ~20 % slower
than either alone).  A trial step compiles each form once.  Beside it, a code leaf says which form the
state last ran in and whether a trial decided (``UNDECIDED``), so a checkpoint keeps the decision:
``dp.step`` reads a restored state's code on the host and runs the form it names without a new trial;
one taken during a trial is timed again.  An algorithm whose state refers to the peers of one form
(``state_follows_form``: LowPrecisionDecentralized's neighbour estimates are of devices in one form and
of nodes in the other) restarts where the code's form is not the one the step runs: the weights become
the devices' average and the state starts afresh from them, as at ``init``.  That test is the one
conditional left in its step, so a restored state can never run against peers it does not describe.
Under ``shard_map`` there are no node groups: the step runs flat and ``dp.step`` runs no trial.
"""

from __future__ import annotations

import functools
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
from ..core.topology import StepTrial
from ..core.bucket import BucketLayout
from ..core.comm import Feature, ReduceOp
from .communicator import AxisCommunicator
from .schedule import Scheduled, read_ints, run_scheduled

__all__ = ["FormState", "StepForms", "decided_by_trial", "form_topology", "run_in_form", "storable", "with_form",
           "OVER_NODES", "UNDECIDED"]

log = logging.getLogger(__name__)

OVER_NODES = 1  # bit of FormState.form_code: the form the state last ran in (0: flat)
UNDECIDED = 2  # bit: no trial has decided the form yet; dp.step's trial will


@jax.tree_util.register_pytree_with_keys_class
class FormState:
    """A bucket's state where ``dp.step``'s trial decides the form: the algorithm's state and a code leaf.

    Static (in the tree's structure): ``over_nodes``, the form the step runs, and ``owner``, the wrap whose
    trial may set it (:attr:`StepForms.owner`: the states of two wraps may go through one ``dp.step``, and
    each wrap's trial sets its own only).  The leaf ``form_code`` holds bits (``OVER_NODES``: the form
    last run; ``UNDECIDED``: no trial decided yet), which a checkpoint keeps.
    """

    def __init__(self, form_code: Any, state: Any, owner: object, over_nodes: bool = False):
        self.form_code, self.state, self.owner, self.over_nodes = form_code, state, owner, bool(over_nodes)

    def __repr__(self) -> str:
        return (f"FormState(form_code={self.form_code!r}, state={self.state!r}, owner={id(self.owner):#x}, "
                f"over_nodes={self.over_nodes})")

    def tree_flatten_with_keys(self):
        keys = jax.tree_util.GetAttrKey
        return ((keys("form_code"), self.form_code), (keys("state"), self.state)), (self.owner, self.over_nodes)

    @classmethod
    def tree_unflatten(cls, static: tuple, children) -> "FormState":
        return cls(*children, *static)


def decided_by_trial(algorithm: Algorithm, world_size: int, local: int) -> bool:
    """Whether ``dp.step``'s trial decides the form: the setting leaves it open, there are >= 2 nodes of >= 2
    devices, and ``world_size`` is every device (the trial's step is a pmap over all of them)."""
    if not (algorithm.timed_form and local >= 2 and world_size % local == 0 and world_size // local >= 2):
        return False
    name = type(algorithm).__name__
    if world_size != jax.device_count():
        log.info("bagua_x: %s: world_size %d is not the %d devices a pmap over all of them has, so dp.step does "
                 "not time flat against over nodes; it runs flat", name, world_size, jax.device_count())
        return False
    log.info("bagua_x: %s runs flat on %d nodes of %d devices until the first 12 steps through dp.step have timed "
             "both forms; a step not run through dp.step stays flat", name, world_size // local, local)
    return True


def form_topology(algorithm: Algorithm, layouts: Sequence[BucketLayout], world_size: int, local: int) -> str:
    """What makes the forms' programs differ, for the form cache (links and load are checked by timing)."""
    return form_cache.topology(frontend="jax", algorithm=repr(algorithm), world=world_size, local=local,
                               buckets=[layout.padded_numel for layout in layouts],
                               dtypes=sorted({layout.dtype for layout in layouts}), device=jax.default_backend(),
                               versions=[jax.__version__, __version__])


def with_form(states: tuple, forms: Optional["StepForms"]) -> tuple:
    """Bucket states as :class:`FormState` of ``forms``' wrap, flat and undecided (unchanged where no trial
    decides the form: ``forms`` None)."""
    if forms is None:
        return states
    return tuple(FormState(jnp.asarray(UNDECIDED, jnp.int32), st, forms.owner) for st in states)


def run_in_form(fn: Callable, args: Sequence, layout: BucketLayout, state: Any, comm: AxisCommunicator,
                algorithm: Algorithm) -> tuple:
    """``fn(*args, layout, state, comm)``, in the form a :class:`FormState` fixes (plainly for any other state;
    a :class:`~.schedule.Scheduled` one with its branches: :func:`~.schedule.run_scheduled`).

    First, for an algorithm whose state follows the form (a weight algorithm: ``args[0]`` is its weights),
    where the code's form is not the one run: the weights become the average over the axis and the state
    ``algorithm.init`` of them (its branches then traced: that test is in the step, and its counter may be
    ``init``'s).
    """
    flat = AxisCommunicator(comm.axis_name, comm.size)  # one node: no groups
    fn = functools.partial(_unstored, fn, algorithm)
    if not isinstance(state, FormState):
        return run_scheduled(fn, args, layout, state, comm)
    over_nodes = state.over_nodes and Feature.HIERARCHICAL in comm.features
    code, inner, args = state.form_code, state.state, tuple(args)
    if algorithm.state_follows_form:
        if isinstance(inner, Scheduled):  # after the cond the counter may be init's: its branches are traced
            inner = Scheduled(inner.state, inner.algorithm)

        def restart(operand):
            (x, *rest), st = operand
            x = flat.allreduce(x, ReduceOp.AVG).astype(x.dtype)
            fresh = storable(initial_state(algorithm, x, layout, comm.size))
            return (x, *rest), Scheduled(fresh, algorithm) if isinstance(st, Scheduled) else fresh

        args, inner = lax.cond(code & OVER_NODES != int(over_nodes), restart, lambda operand: operand,
                               (args, inner))
    out, inner = run_scheduled(fn, args, layout, inner, comm if over_nodes else flat)
    return out, FormState((code & UNDECIDED) | int(over_nodes), inner, state.owner, state.over_nodes)


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


class StepForms:
    """``dp.step``'s trial: its first steps alternate the forms, timed, then every process keeps the faster.

    Before each call, the form of the step about to run is written into this wrap's :class:`FormState`
    among the call's arguments (static: the call compiles that form alone, once per form); the time of a
    step is its call through ``dp.step``, which waits for its results (:meth:`before`, the call,
    :meth:`after`).  Only a call whose arguments hold the wrap's undecided states is a step of the trial,
    and only once it has returned: a call without them (an evaluation) passes through, and a call that
    raised is not counted, so the next call runs the same planned step.  A restart (a switch of a
    ``state_follows_form`` algorithm) runs inside the step, from the code of the state passed in, at a
    block's untimed first step.  The decision clears ``UNDECIDED`` from the codes; from then on the states
    pass through unchanged, in the decided form.  No trial where the arguments hold a decided state
    (restored: it runs the form its code names), or where the traced step has no node groups
    (``shard_map``: it runs flat).  Another wrap's states pass through unchanged: that wrap's own
    ``dp.step`` drives them.  With ``BAGUA_X_FORM_CACHE`` set on process 0, the decisions recorded for
    ``topology`` by earlier jobs are checked first (:mod:`~bagua_x.core.form_cache`), and a new decision is
    recorded.
    """

    def __init__(self, algorithm: Algorithm, axis_name, topology: str):
        self.algorithm, self.axis_name, self.topology = algorithm, axis_name, topology
        self.owner = object()  # the FormState.owner of this wrap's states: equal to no other wrap's
        self.done = False  # the states carry their form: nothing more to write
        self._stopping = False  # the call under way is the last one written
        #: set while the step is traced: whether it holds both forms (node groups); None: not traced yet
        self.forms_in_step: Optional[bool] = None
        self._trial: Optional[StepTrial] = None  # made at the first trial step (reading the form cache)
        self._form: Optional[int] = None  # the trial's decision
        self._started: Optional[float] = None  # the start of the trial step under way
        self._told: set[str] = set()  # the notes logged once

    def before(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args, kwargs`` with the form of the step about to run set in this wrap's states."""
        name, tree, self._started, self._stopping = type(self.algorithm).__name__, (args, kwargs), None, False
        states = [m for m in jax.tree.leaves(tree, is_leaf=_is_state) if isinstance(m, FormState)]
        mine = [m.form_code for m in states if m.owner == self.owner]
        if len(mine) < len(states):
            self._note("others", "bagua_x: %s: the arguments of dp.step's function also hold another wrap's bagua_x "
                       "states; they keep their form unless that wrap's dp.step drives them too "
                       "(dp_a.step(dp_b.step(fn)))", name)
        if not mine:
            self._note("none", "bagua_x: %s: a call through dp.step whose arguments hold no bagua_x state of this "
                       "wrap is not a step of the trial of forms (a step that closes over its state runs flat)",
                       name)
            return args, kwargs
        (code,) = read_ints(mine[:1])
        if self._form is not None:  # decided by this trial, the call that runs it first not returned yet
            return self._stop(self._write(tree, self._form, code=code & OVER_NODES))
        if not code & UNDECIDED:  # decided before this trial: a restored state
            self._note("restored", "bagua_x: %s runs %s, as in the state passed to dp.step (decided before)", name,
                       "over nodes" if code & OVER_NODES else "flat")
            return self._stop(self._write(tree, code & OVER_NODES))
        if self.forms_in_step is False:
            self._note("flat", "bagua_x: %s runs flat: the step has no node groups (shard_map), so the forms are not "
                       "timed", name)
            return self._stop(tree)
        if self._trial is None:
            self._slowest, first = slowest_over_devices(self.axis_name), jax.process_index() == 0
            self._trial = StepTrial(form_cache.share(form_cache.load(self.topology) if first else [], first,
                                                     self._slowest))
        planned = self._trial.form()
        if planned is None:
            checking = bool(self._trial.known)
            choice = self._trial.choose(self._slowest, name)
            if choice is None:  # the recorded decisions did not fit: both forms are timed
                planned = self._trial.form()
            else:
                if not checking and jax.process_index() == 0:
                    form_cache.record(self.topology, choice)
                # decided: that form from now on, the code's form bit still the last run's (a restart reads it)
                self._form = int(choice.two_level)
                return self._stop(self._write(tree, self._form, code=code & OVER_NODES))
        tree = self._write(tree, int(planned))
        self._started = time.perf_counter()
        return tree

    def after(self) -> None:
        """The call started by the last :meth:`before` has returned, its results ready: a trial step is over
        (or the first call in the form kept: then the states go on in it, and this wrap's trial is done)."""
        self.done = self._stopping
        if self._started is not None and self._trial is not None:
            self._trial.begin(self._started)
            self._trial.end(time.perf_counter())
            self._started = None

    def _write(self, tree, form: int, code: Optional[int] = None):
        """``tree`` with this wrap's states set to run ``form``; with ``code``, their code leaf written too,
        placed as the old one."""
        def put(old):
            if code is None:
                return old
            value = np.full(np.shape(old), code, np.int32)
            if isinstance(old, jax.Array):
                return jax.make_array_from_callback(old.shape, old.sharding, lambda index: value[index])
            return value

        def rewrite(m):
            if not isinstance(m, FormState) or m.owner != self.owner:
                return m
            return FormState(put(m.form_code), m.state, m.owner, bool(form))

        return jax.tree.map(rewrite, tree, is_leaf=_is_state)

    def _note(self, key: str, message: str, *args) -> None:
        """Log ``message`` at the first call that needs it only."""
        if key not in self._told:
            self._told.add(key)
            log.info(message, *args)

    def _stop(self, tree: tuple) -> tuple[tuple, dict]:
        """``tree``, the last written: once its call has returned (:meth:`after`), the states carry their form.
        A call that raises is not over: the next call is written again."""
        self._stopping = True
        return tree


def _is_state(x) -> bool:
    return isinstance(x, FormState)


def slowest_over_devices(axis_name) -> Callable[[Sequence[float]], list[float]]:
    """``slowest(values)``: each value's maximum over every device of every process (a pmap: collective)."""
    devices = jax.local_device_count()
    maximum = jax.pmap(lambda t: lax.pmax(t, axis_name), axis_name=axis_name)

    def slowest(values: Sequence[float]) -> list[float]:
        out = maximum(np.tile(np.asarray(values, np.float32), (devices, 1)))
        return np.asarray(out.addressable_shards[0].data).reshape(-1).tolist()

    return slowest
