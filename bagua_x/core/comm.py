"""The Communicator protocol: the only way algorithms talk to other ranks.

Algorithms are written once against this protocol; each frontend implements it
on an existing engine (``torch.distributed`` process groups, XLA collectives
under a named axis).  Shapes follow one convention so the same algorithm code
runs on both:

* ``allreduce(x, op)`` -> same shape, reduced over ranks.
* ``allgather(x)`` -> shape ``(size, *x.shape)``, row ``i`` from rank ``i``.
* ``alltoall(x)`` with ``x.shape[0] == size`` -> row ``j`` goes to rank ``j``;
  row ``i`` of the result came from rank ``i``.
* ``reduce_scatter(x, op)`` with ``x.shape[0] == size`` -> row ``rank`` reduced
  over ranks, shape ``x.shape[1:]``.
* ``broadcast(x, root)`` -> ``root``'s ``x``.
* ``permute(x, pairs)`` -> each rank gets the ``x`` of the rank that lists it as
  destination in the static ``(src, dst)`` pairs, zeros when none does.
* ``switch(index, branches, operand)`` -> ``branches[index](operand)``.  Not a
  collective: the one piece of control flow whose form depends on the engine
  (``lax.switch`` when ``index`` is traced, plain Python elsewhere), needed by
  algorithms that act only every k-th step or rotate peers.
* ``counter(step)`` -> the host's value of a state's step counter where the
  frontend knows it (JAX through ``dp.step``), else ``step``: an index computed
  from it is a plain int, so ``switch`` compiles one branch.

Optional features are declared in ``features`` (a frozenset of
:class:`Feature`), never probed: an algorithm asks ``Feature.HIERARCHICAL in
comm.features`` before using ``comm.within`` (a communicator over the ranks of
this rank's node) and ``comm.across`` (over the ranks at this rank's place in
every node, one per node), which is how hierarchical variants keep the slow
links between nodes for the algorithm's own (compressed) exchange.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

__all__ = ["ReduceOp", "Feature", "Communicator"]


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"


class Feature(enum.Enum):
    HIERARCHICAL = "hierarchical"  # comm.within / comm.across: sub-communicators inside a node / between nodes
    #: with HIERARCHICAL: the nodes are fault-tolerant replica groups, whose number changes between steps (a node
    #: dies, another heals and rejoins); a node is always one worker, so node-aware algorithms run over nodes
    #: whatever their count, and ``comm.across`` is sized anew at each step
    REPLICA_GROUPS = "replica_groups"


@runtime_checkable
class Communicator(Protocol):
    @property
    def rank(self) -> Any:
        """This rank's index (an int, or a traced scalar under a JAX axis)."""

    @property
    def size(self) -> int:
        """Number of ranks (always a Python int)."""

    @property
    def features(self) -> frozenset[Feature]:
        """The optional operations this communicator offers (see :class:`Feature`)."""

    def allreduce(self, x, op: ReduceOp = ReduceOp.SUM):
        """``x`` reduced with ``op`` over every rank, the same shape and dtype on each.

        Every rank must call it with the same shape, dtype and ``op``; ``AVG`` divides the sum by ``size``.
        """

    def allgather(self, x):
        """Every rank's ``x`` stacked: shape ``(size, *x.shape)``, row ``i`` from rank ``i``."""

    def alltoall(self, x):
        """Rows exchanged: ``x.shape[0] == size``; row ``j`` of ``x`` goes to rank ``j``, and row ``i`` of the
        result came from rank ``i`` (the first half of a reduce-scatter that compresses in between)."""

    def reduce_scatter(self, x, op: ReduceOp = ReduceOp.SUM):
        """Row ``rank`` of ``x`` reduced with ``op`` over every rank: ``x.shape[0] == size``, the result has
        shape ``x.shape[1:]``."""

    def broadcast(self, x, root: int = 0):
        """Rank ``root``'s ``x`` on every rank (the others' ``x`` gives only the shape and dtype)."""

    def permute(self, x, pairs: Sequence[tuple[int, int]]):
        """Point to point: each rank gets the ``x`` of the rank that names it as destination in ``pairs``
        (static ``(src, dst)`` tuples, the same on every rank), zeros where none does."""

    def switch(self, index, branches: Sequence[Callable[[Any], Any]], operand):
        """``branches[index](operand)``: the step-dependent control flow of an algorithm that acts every k-th
        step or rotates peers.  Not a collective; ``lax.switch`` where ``index`` is traced (every branch is
        traced, so each must return the same shapes and dtypes), a plain call elsewhere.  Every rank must
        take the same branch, or pair its collectives with another's."""

    def counter(self, step):
        """``step`` (a state's step counter, as the state holds it), or the host's value of it where the
        frontend knows it: a NumPy integer, for which an index computed in its namespace is concrete and
        :meth:`switch` runs one branch, so a compiled step holds one.

        Only for :meth:`switch`'s index: the frontend may give any step with the same
        :meth:`~bagua_x.algorithms.Algorithm.branch_key` (one compiled program serves them all), so a value
        read here must not reach the arithmetic (a bias correction, a seed).  Torch's counters live on the
        host already: its communicators return ``step``."""
