"""An in-process Communicator over numpy: N simulated ranks, one thread each.

``run(n, fn)`` calls ``fn(comm)`` on ``n`` threads, each with its own
:class:`SimulatedCommunicator`; the ``n`` communicators share one
:class:`Rendezvous`.  Every collective deposits a copy of its input, waits at a
barrier, computes its result from all ranks' inputs in numpy, and waits again
before the slots can be reused.  So the algorithms run exactly as on real
ranks (each rank its own state, its own branch of ``switch``), in milliseconds.

Safety nets, so a wrong algorithm fails instead of hanging or lying:

* every barrier wait has a timeout (``timeout`` seconds): a rank that skips a
  collective makes the others fail fast with ``CollectiveError``;
* ranks that call different collectives at the same point (or the same one
  with different shapes/dtypes/arguments) all raise ``CollectiveError`` naming
  what each rank called;
* inputs are copied on arrival and results are fresh arrays, so an algorithm
  cannot depend on a collective sharing memory with its input.

Each rank's communicator records what it sends (:attr:`SimulatedCommunicator.sent`):
one :class:`Sent` per collective with the array handed in, its dtype, shape
and the bytes this rank puts on the wire under the usual algorithms:

==================  ==================================================
allreduce           ring: ``2 (N-1)/N * nbytes``
allgather           ``(N-1) * nbytes`` (its array to every other rank)
alltoall            ``(N-1)/N * nbytes`` (every row but its own)
reduce_scatter      ``(N-1)/N * nbytes``
broadcast           ``nbytes`` on the root, 0 elsewhere
permute             ``nbytes`` per pair ``(rank, dst)`` with ``dst != rank``
==================  ==================================================

It shares no code with the algorithms it tests (only core's ReduceOp and Feature names it is called
with, and :func:`flat_layout`, the BucketLayout of a bucket holding one 1-D array).  It imports neither
torch nor jax: an algorithm's ``reduce`` runs here on numpy arrays, as every Array API namespace allows.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

import numpy as np

from bagua_x.core.bucket import BucketLayout
from bagua_x.core.comm import Feature, ReduceOp


class CollectiveError(RuntimeError):
    """A collective that cannot complete: mis-paired across ranks, or a rank that never came."""


@dataclasses.dataclass
class Sent:
    """One collective as one rank saw it (:attr:`SimulatedCommunicator.sent` keeps them in call order)."""

    op: str
    dtype: np.dtype
    shape: tuple
    nbytes: float  # bytes this rank sends for this collective
    data: np.ndarray  # a copy of the array this rank handed to the collective


class Rendezvous:
    """Shared by the N communicators of one simulated job: each collective meets here.

    Args:
      size: the number of ranks.
      timeout: seconds a rank waits at a collective for the others before raising ``CollectiveError``.
    """

    def __init__(self, size: int, timeout: float = 5.0):
        self.size = size
        self.timeout = timeout
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[Any] = [None] * size

    def _wait(self, rank: int, what: str) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise CollectiveError(
                f"rank {rank}: {what} did not complete within {self.timeout} s on all {self.size} ranks "
                "(a rank skipped it, called another collective, or failed)"
            ) from None

    def exchange(self, rank: int, key: tuple, payload: Any) -> list:
        """Deposit ``payload`` under ``key`` (what is being called); return every rank's payload."""
        self._slots[rank] = (key, payload)
        self._wait(rank, key[0])
        entries = list(self._slots)
        self._wait(rank, key[0])  # everyone has read before anyone deposits again
        keys = [e[0] for e in entries]
        if any(k != keys[0] for k in keys):  # every rank sees it and raises: no abort needed
            lines = ", ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
            raise CollectiveError(f"rank {rank}: ranks called mismatched collectives: {lines}")
        return [e[1] for e in entries]


def _reduce(arrays: Sequence[np.ndarray], op: ReduceOp) -> np.ndarray:
    stacked = np.stack(arrays)
    if op is ReduceOp.SUM:
        return np.sum(stacked, axis=0, dtype=stacked.dtype)
    if op is ReduceOp.AVG:
        total = np.sum(stacked, axis=0, dtype=stacked.dtype)
        if np.issubdtype(total.dtype, np.integer):
            return total // len(arrays)
        return (total / len(arrays)).astype(stacked.dtype)
    if op is ReduceOp.MIN:
        return np.min(stacked, axis=0)
    if op is ReduceOp.MAX:
        return np.max(stacked, axis=0)
    raise CollectiveError(f"unknown reduce op {op!r}")


class SimulatedCommunicator:
    """The Communicator protocol for one simulated rank (numpy arrays in, numpy arrays out).

    Made by :func:`run`, one per rank.  ``sent`` records every collective this rank called
    (:class:`Sent`); :meth:`bytes_sent` and :meth:`ops` summarise it.

    Args:
      rendezvous: the job's :class:`Rendezvous`, shared by all its ranks.
      rank: this rank's index, ``0 <= rank < rendezvous.size``.
    """

    def __init__(self, rendezvous: Rendezvous, rank: int):
        self._rv = rendezvous
        self._rank = rank
        self.sent: list[Sent] = []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._rv.size

    @property
    def features(self) -> frozenset:
        return frozenset()

    def __repr__(self) -> str:
        return f"SimulatedCommunicator(rank={self._rank}, size={self.size})"

    # -- bookkeeping ----------------------------------------------------------------------
    def bytes_sent(self, op: str | None = None) -> float:
        """Bytes this rank put on the wire so far, over every collective or only ``op``'s ("allreduce"...)."""
        return sum(s.nbytes for s in self.sent if op is None or s.op == op)

    def ops(self) -> list[str]:
        """The collectives this rank called, in order."""
        return [s.op for s in self.sent]

    def _collective(self, op: str, x, extra: tuple, nbytes_factor: float) -> list[np.ndarray]:
        x = np.array(x, copy=True)  # the sender's array as it was at the call
        self.sent.append(Sent(op, x.dtype, x.shape, nbytes_factor * x.nbytes, x))
        return self._rv.exchange(self._rank, (op, x.dtype.str, x.shape, extra), x)

    def _check_rows(self, x, what: str) -> None:
        if np.ndim(x) == 0 or np.shape(x)[0] != self.size:
            raise CollectiveError(f"{what} needs a first dimension of {self.size}, got shape {np.shape(x)}")

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, x, op: ReduceOp = ReduceOp.SUM):
        n = self.size
        return _reduce(self._collective("allreduce", x, (op,), 2 * (n - 1) / n), op)

    def allgather(self, x):
        return np.stack(self._collective("allgather", x, (), self.size - 1))

    def alltoall(self, x):
        self._check_rows(x, "alltoall")
        n = self.size
        rows = self._collective("alltoall", x, (), (n - 1) / n)
        return np.stack([rows[src][self._rank] for src in range(n)])

    def reduce_scatter(self, x, op: ReduceOp = ReduceOp.SUM):
        self._check_rows(x, "reduce_scatter")
        n = self.size
        rows = self._collective("reduce_scatter", x, (op,), (n - 1) / n)
        return _reduce([r[self._rank] for r in rows], op)

    def broadcast(self, x, root: int = 0):
        if not 0 <= root < self.size:
            raise CollectiveError(f"broadcast root {root} outside {self.size} ranks")
        arrays = self._collective("broadcast", x, (root,), 1.0 if self._rank == root else 0.0)
        return arrays[root].copy()

    def permute(self, x, pairs: Sequence[tuple[int, int]]):
        pairs = tuple((int(s), int(d)) for s, d in pairs)
        sends = sum(1 for s, d in pairs if s == self._rank and d != self._rank)
        arrays = self._collective("permute", x, (pairs,), float(sends))
        sources = [s for s, d in pairs if d == self._rank]
        if len(sources) > 1:
            raise CollectiveError(f"permute: rank {self._rank} is the destination of {sources}")
        return arrays[sources[0]].copy() if sources else np.zeros_like(arrays[self._rank])

    def switch(self, index, branches: Sequence[Callable[[Any], Any]], operand):
        # as lax.switch: an integer index (a Python int or an integer array), in range
        if not (isinstance(index, int) or np.issubdtype(np.asarray(index).dtype, np.integer)):
            raise CollectiveError(f"switch: index {index!r} is not an integer")
        if not 0 <= int(index) < len(branches):
            raise CollectiveError(f"switch: index {int(index)} outside {len(branches)} branches")
        return branches[int(index)](operand)

    def counter(self, step):
        return step  # on the host already


class HierarchicalSimulatedCommunicator(SimulatedCommunicator):
    """Also offers ``within`` / ``across`` (Feature.HIERARCHICAL): simulated communicators over this rank's node
    (``local_size`` consecutive ranks) and over the ranks at its place in every node, each with its own rendezvous
    and its own ``sent`` record (so the bytes between nodes are ``across.sent``)."""

    def __init__(self, rendezvous: Rendezvous, rank: int, within: SimulatedCommunicator,
                 across: SimulatedCommunicator):
        super().__init__(rendezvous, rank)
        self.within, self.across = within, across

    @property
    def features(self) -> frozenset:
        return frozenset({Feature.HIERARCHICAL})


def _hierarchical(n: int, local: int, timeout: float) -> list[HierarchicalSimulatedCommunicator]:
    if n % local:
        raise ValueError(f"{n} ranks do not split into nodes of {local}")
    rv, nodes = Rendezvous(n, timeout), n // local
    blocks = [Rendezvous(local, timeout) for _ in range(nodes)]
    places = [Rendezvous(nodes, timeout) for _ in range(local)]
    return [HierarchicalSimulatedCommunicator(rv, r, SimulatedCommunicator(blocks[r // local], r % local),
                                              SimulatedCommunicator(places[r % local], r // local))
            for r in range(n)]


def run(n: int, fn: Callable[[SimulatedCommunicator], Any], timeout: float = 5.0, local_size: int | None = None):
    """``fn(comm)`` on ``n`` simulated ranks; returns ``(results, comms)``, one per rank.

    The first exception raised on any rank is re-raised here (a rank's own error
    before the ``CollectiveError`` it caused on the others).

    Args:
      n: the number of ranks (threads).
      fn: called once per rank with that rank's :class:`SimulatedCommunicator`.
      timeout: seconds a collective waits for every rank; a rank that skips one fails the others this fast.
      local_size: ranks per node: each communicator is then a :class:`HierarchicalSimulatedCommunicator`
        (``comm.within``, ``comm.across``), for algorithms that run over nodes.

    Example:
        ```python
        import numpy as np
        from bagua_x.algorithms import GradientAllReduce
        from bagua_x.testing import flat_layout, run

        xs = [np.full(4, r, np.float32) for r in range(3)]
        def step(comm):
            algorithm, x = GradientAllReduce(), xs[comm.rank]
            state = algorithm.init(x, flat_layout(x), comm.size)
            return algorithm.reduce(x, flat_layout(x), state, comm)[0]
        results, comms = run(3, step)  # every result is [1, 1, 1, 1]; comms[r].sent: what rank r sent
        ```
    """
    if local_size is None:
        rendezvous = [Rendezvous(n, timeout)]
        comms = [SimulatedCommunicator(rendezvous[0], r) for r in range(n)]
    else:
        comms = _hierarchical(n, local_size, timeout)
        rendezvous = list({id(rv): rv for c in comms for rv in (c._rv, c.within._rv, c.across._rv)}.values())
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def worker(r: int) -> None:
        try:
            results[r] = fn(comms[r])
        except CollectiveError as e:
            errors[r] = e
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors[r] = e
            for rv in rendezvous:  # the others fail now instead of waiting for the timeout
                rv._barrier.abort()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    if any(t.is_alive() for t in threads):
        raise CollectiveError(f"a simulated rank is still running after {timeout * 4} s")
    own = [e for e in errors if e is not None and not isinstance(e, CollectiveError)]
    if own:
        raise own[0]
    collective = [e for e in errors if e is not None]
    if collective:
        raise collective[0]
    return results, comms


def flat_layout(x_or_numel: Any, dtype: str = "float32") -> BucketLayout:
    """The layout of a bucket holding one 1-D tensor named "x": ``x``'s length, or ``numel`` elements.

    Args:
      x_or_numel: a 1-D array (its length is used) or an element count.
      dtype: the bucket's dtype name.
    """
    numel = x_or_numel if isinstance(x_or_numel, int) else len(x_or_numel)
    return BucketLayout(["x"], [(numel,)], dtype)
