"""``hierarchical=None`` on >= 2 nodes of >= 2 devices: flat or over nodes, chosen by timing both.

At ``wrap`` (every process calls it), both forms of the algorithm's
``reduce`` are compiled under ``pmap`` over all devices -- the axis and node
groups of a pmapped step -- on zero buckets of the real shapes and dtypes
with throwaway state from ``init``, timed, and every process takes the form
the slowest device's times favour (:func:`~bagua_x.core.autotune.choose_form`).

The choice is a leaf of each bucket's state: where it was measured, a bucket's
state is a :class:`MeasuredState` (the form, int32: 1 over nodes, 0 flat; and the algorithm's state),
and the step runs the form that leaf names
(:func:`run_in_form`: ``lax.switch`` between the two forms, both compiled
into the step).  So a state restored from a checkpoint runs the form it was
built in, whatever this wrap measured: LowPrecisionDecentralized's neighbour
estimates are of devices in one form and of nodes in the other, and a resume
continues bitwise.  Under ``shard_map`` there are no node groups: the leaf is
carried and the step runs flat.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..algorithms import Algorithm
from ..core.autotune import choose_form
from ..core.bucket import BucketLayout
from ..core.comm import Feature
from .communicator import AxisCommunicator

__all__ = ["MeasuredState", "measured_form", "run_in_form", "with_form"]

log = logging.getLogger(__name__)

class MeasuredState(NamedTuple):
    """A bucket's state where the form was measured: the form as a leaf, so a checkpoint keeps it."""

    hierarchical: Any  # int32 scalar: 1 over nodes, 0 flat
    state: Any  # the algorithm's own state


def measured_form(algorithm: Algorithm, layouts: Sequence[BucketLayout], axis_name, world_size: int,
                  local: int) -> Optional[bool]:
    """The faster form (True: over nodes), or None where it is not measured here: the setting forces a
    form, there is one node or one device per node, or ``world_size`` is not every device (the step's axis
    is not the pmap over all devices, which is what can be timed)."""
    setting_is_none = Feature.HIERARCHICAL in algorithm.uses and Feature.HIERARCHICAL not in algorithm.requires
    if not (setting_is_none and local >= 2 and world_size % local == 0 and world_size // local >= 2):
        return None
    if world_size != jax.device_count():
        log.info("bagua_x: %s is not timed flat against over nodes: world_size %d is not the %d devices a pmap "
                 "over all of them has; it runs over nodes where the step has node groups",
                 type(algorithm).__name__, world_size, jax.device_count())
        return None
    return choose_form(*_timing(algorithm, layouts, axis_name, local), type(algorithm).__name__).two_level


def with_form(states: tuple, two_level: Optional[bool]) -> tuple:
    """Bucket states with the measured form beside them (unchanged where it was not measured)."""
    if two_level is None:
        return states
    return tuple(MeasuredState(jnp.asarray(1 if two_level else 0, jnp.int32), st) for st in states)


def run_in_form(fn: Callable, args: Sequence, layout: BucketLayout, state: Any, comm: AxisCommunicator) -> tuple:
    """``fn(*args, layout, state, comm)`` in the form a :class:`MeasuredState` names (plainly for any other state)."""
    if not isinstance(state, MeasuredState):
        return fn(*args, layout, state, comm)
    inner = state.state
    if Feature.HIERARCHICAL not in comm.features:  # shard_map, or the axis does not split into nodes: flat only
        out, inner = fn(*args, layout, inner, comm)
    else:
        flat = AxisCommunicator(comm.axis_name, comm.size)  # one node: no groups
        out, inner = comm.switch(state.hierarchical, [lambda a: fn(*a, layout, inner, flat),
                                                   lambda a: fn(*a, layout, inner, comm)], tuple(args))
    return out, MeasuredState(state.hierarchical, inner)


def _timing(algorithm: Algorithm, layouts: Sequence[BucketLayout], axis_name, local: int):
    """``run(two_level)`` and ``slowest(values)`` for :func:`~bagua_x.core.autotune.choose_form`."""
    devices, world = jax.local_device_count(), jax.device_count()
    per_device = lambda a: np.broadcast_to(np.asarray(a), (devices, *np.shape(a)))  # noqa: E731
    flats = [np.zeros((devices, lay.padded_numel), lay.dtype) for lay in layouts]
    states = [jax.tree.map(per_device, algorithm.init(jnp.zeros((lay.padded_numel,), lay.dtype), lay, world))
              for lay in layouts]

    def program(two_level: bool):
        def body(flats, states):
            comm = AxisCommunicator(axis_name, local if two_level else world)  # nodes of all devices: flat
            return [algorithm.reduce(x, lay, st, comm)[0] for x, lay, st in zip(flats, layouts, states)]
        return jax.pmap(body, axis_name=axis_name)

    programs = {form: program(form) for form in (False, True)}
    maximum = jax.pmap(lambda t: lax.pmax(t, axis_name), axis_name=axis_name)

    def run(two_level: bool) -> None:
        jax.block_until_ready(programs[two_level](flats, states))

    def slowest(values: Sequence[float]) -> list[float]:
        out = maximum(np.tile(np.asarray(values, np.float32), (devices, 1)))
        return np.asarray(out.addressable_shards[0].data).reshape(-1).tolist()

    return run, slowest

