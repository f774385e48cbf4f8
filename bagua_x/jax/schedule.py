"""Branches the host decides: one compiled program per branch key, with one branch each.

An algorithm that acts every k-th step, warms up first or syncs its fragments in turn picks a branch with
``comm.switch`` from its step counter.  Traced, that is a ``lax.switch`` in every step holding every
branch's collectives; on GPU a conditional reads its predicate back to the host, and collectives inside one
cannot overlap with the rest of the step.  The host knows the counter: through ``dp.step`` it reads each
bucket's counter before the call (a scalar, ready since the last step waited for its results) and writes
the step's :class:`Key` (``Algorithm.branch_key``) into the bucket's :class:`Scheduled` state.  The key is
static, so the call compiles one program per key, in which ``comm.counter`` answers a step of that key and
each ``comm.switch`` runs its branch alone.

A state leaves the step without its key once its counter has moved, so a call not made through ``dp.step``
(an evaluation, a plain loop) traces the switch as before and never runs a stale branch.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional, Sequence

import jax
import numpy as np

from ..algorithms import Algorithm

__all__ = ["Key", "Scheduled", "read_ints", "run_scheduled", "scheduled", "with_keys"]


class Key:
    """The branch key of the step about to run, and a step that has it (what ``comm.counter`` answers).

    Equal, and hashed, by the key alone: steps of one key share a compiled program, since within it the
    step is read only to pick branches (``Communicator.counter``'s contract).
    """

    __slots__ = ("key", "step")

    def __init__(self, key: Hashable, step: int):
        self.key, self.step = key, int(step)

    def __eq__(self, other) -> bool:
        return isinstance(other, Key) and self.key == other.key

    def __hash__(self) -> int:
        return hash((Key, self.key))

    def __repr__(self) -> str:
        return f"Key({self.key!r}, step={self.step})"


@jax.tree_util.register_pytree_with_keys_class
class Scheduled:
    """A bucket's state (the algorithm's ``NamedTuple``, with a ``step`` counter) whose branches the host may
    decide.  Its leaves keep the key paths they have without it, so a checkpoint names them alike, and it
    reads like the state (``st.step``, ``st._replace(step=...)``).  Static:
    the ``algorithm`` (a frozen dataclass: its settings say its keys, so any ``dp.step`` can write them and
    two wraps of one algorithm have states of one structure) and the :class:`Key` of the step about to run
    (None: the switches are traced)."""

    def __init__(self, state: Any, algorithm: Algorithm, key: Optional[Key] = None):
        self.state, self.algorithm, self.key = state, algorithm, key

    def __repr__(self) -> str:
        return f"Scheduled({self.state!r}, key={self.key!r})"

    def __getattr__(self, name: str) -> Any:  # reads the state's fields as the NamedTuple does: st.step
        if name == "state":  # not set yet (unpickling, copying): no recursion
            raise AttributeError(name)
        return getattr(self.state, name)

    def _replace(self, **fields) -> "Scheduled":
        """The NamedTuple's ``_replace``; the key is dropped (the counter may change)."""
        return Scheduled(self.state._replace(**fields), self.algorithm)

    def tree_flatten_with_keys(self):
        fields = type(self.state)._fields
        return ([(jax.tree_util.GetAttrKey(f), getattr(self.state, f)) for f in fields],
                (type(self.state), self.algorithm, self.key))

    @classmethod
    def tree_unflatten(cls, static: tuple, children) -> "Scheduled":
        kind, algorithm, key = static
        return cls(kind(*children), algorithm, key)


def scheduled(states: tuple, algorithm: Algorithm) -> tuple:
    """Bucket states as :class:`Scheduled` where ``algorithm`` has a branch key."""
    if algorithm.branch_key(0) is None:
        return states
    return tuple(Scheduled(st, algorithm) if "step" in getattr(st, "_fields", ()) else st for st in states)


def run_scheduled(fn: Callable, args: Sequence, layout, state: Any, comm) -> tuple:
    """``fn(*args, layout, state, comm)`` on a :class:`Scheduled` state's own, ``comm.counter`` answering its
    key's step; the result keeps the key while the counter is the one passed in (a call that does not step
    it, e.g. DiLoCo's node mean before its ``sync_params``)."""
    if not isinstance(state, Scheduled):
        return fn(*args, layout, state, comm)
    inner = state.state
    if state.key is not None:
        comm = comm.knowing(inner.step, state.key.step)
    out, new = fn(*args, layout, inner, comm)
    return out, Scheduled(new, state.algorithm, state.key if new.step is inner.step else None)


def with_keys(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``dp.step``'s side: ``args, kwargs`` with the :class:`Key` of the step about to run written into every
    :class:`Scheduled` state among them (each by its own algorithm: another wrap's too, alike)."""
    tree = (args, kwargs)
    states = [m for m in jax.tree.leaves(tree, is_leaf=_is_scheduled) if isinstance(m, Scheduled)]
    if not states:
        return tree
    keys = iter([Key(m.algorithm.branch_key(step), step)
                 for m, step in zip(states, read_ints([m.state.step for m in states]))])
    return jax.tree.map(lambda m: Scheduled(m.state, m.algorithm, next(keys)) if isinstance(m, Scheduled) else m,
                        tree, is_leaf=_is_scheduled)


def _is_scheduled(x) -> bool:
    return isinstance(x, Scheduled)


def read_ints(leaves: Sequence[Any]) -> list[int]:
    """One device's value of each scalar-per-device leaf, in one transfer (allowed under a transfer guard)."""
    with jax.transfer_guard("allow"):
        firsts = [leaf.addressable_shards[0].data if hasattr(leaf, "addressable_shards") else leaf
                  for leaf in leaves]
        return [int(np.asarray(v).reshape(-1)[0]) for v in jax.device_get(firsts)]
