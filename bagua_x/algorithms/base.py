"""The algorithm interface: what is communicated, when, and how -- once for every framework.

An algorithm is a small frozen dataclass of hyperparameters with an optax-style
pair of pure functions over one bucket -- its flat buffer and its
:class:`~bagua_x.core.bucket.BucketLayout` (each tensor's name, shape and
offset, so an algorithm can work per tensor, as PowerSGD does per matrix):

* ``init(flat, layout, world_size) -> state``: the per-bucket state, a
  ``NamedTuple`` of arrays defined next to its algorithm (``PowerSGDState``...),
  as optax does: JAX threads it through a jitted step as a pytree, torch saves
  its ``_asdict()`` and loads it back with :func:`state_from_dict`, and a
  misspelt field is an ``AttributeError`` instead of a silent miss.
* ``reduce(flat, layout, state, comm) -> (flat, state)``: the communication,
  using the Array API (``array_api_compat.array_namespace``) for math and the
  :class:`~bagua_x.core.Communicator` for collectives.

``target`` says which tensor of each parameter is the effective tensor
(gradient, weight or optimizer momentum); ``phase`` says when the frontend runs
``reduce``.  Frontends derive their getters, setters and hooks from these two.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Hashable, NamedTuple, Optional

import array_api_compat

from ..core.bucket import BucketLayout
from ..core.comm import Communicator, Feature, ReduceOp
from ..core.errors import BaguaXError
from ..core.topology import two_level_on

__all__ = ["Target", "Phase", "Algorithm", "EmptyState", "initial_state", "state_from_dict", "namespace", "counter",
           "every",
           "ring_allreduce_bytes", "compressed_bytes",
           "NodeAware", "hierarchical", "over_nodes"]


class Target(enum.Enum):
    GRAD = "grad"  # p.grad / the gradient tree
    WEIGHT = "weight"  # the parameter itself / the params tree
    MOMENTUM = "momentum"  # the optimizer's first moment


class Phase(enum.Enum):
    AFTER_BACKWARD = "after_backward"  # before the optimizer reads the gradients
    AFTER_STEP = "after_step"  # after the optimizer changed the weights
    BEFORE_FORWARD = "before_forward"  # launched at forward, finished before the step
    BACKGROUND = "background"  # on a thread of its own, decoupled from the steps (torch only)


class EmptyState(NamedTuple):
    """The state of a stateless algorithm (optax's ``EmptyState``)."""


def initial_state(algorithm: "Algorithm", flat, layout: BucketLayout, world_size: int) -> NamedTuple:
    """``algorithm.init`` of one bucket, refused at once unless it is a ``NamedTuple``.

    Frontends build every state through here: a dict (or list) would train, then fail
    at the first checkpoint (torch saves ``_asdict()``) far from its cause.
    """
    state = algorithm.init(flat, layout, world_size)
    if not (isinstance(state, tuple) and hasattr(type(state), "_fields")):
        name = type(algorithm).__name__
        raise BaguaXError(
            f"{name}.init returned a {type(state).__name__} for the bucket of {layout.names}; an algorithm's "
            f"state must be a typing.NamedTuple of arrays (class {name}State(NamedTuple): ...; a stateless one "
            "returns EmptyState()), so that torch can checkpoint it and JAX can trace it"
        )
    return state


def state_from_dict(template: NamedTuple, saved: dict, where: str) -> NamedTuple:
    """``saved`` (a state's ``_asdict()``, e.g. from a checkpoint) as a state of ``template``'s type.

    Raises naming ``where`` and the missing or unknown fields, so a checkpoint of
    another algorithm (or version) never loads half its state silently.
    """
    fields = type(template)._fields
    # a field that is empty here carries nothing to restore: a state saved before it existed (DiLoCo's ``error``
    # without compression) still loads
    saved = {**{f: getattr(template, f) for f in fields if f not in saved and _empty(getattr(template, f))}, **saved}
    missing = [f for f in fields if f not in saved]
    unknown = sorted(str(k) for k in saved if k not in fields)
    if missing or unknown:
        raise BaguaXError(
            f"the saved algorithm state of {where} does not fit {type(template).__name__} (fields {list(fields)}): "
            f"missing {missing}, unknown {unknown}; it was saved with another algorithm or settings: load a state "
            "saved with the same ones"
        )
    return type(template)(**{f: saved[f] for f in fields})


def _empty(value) -> bool:
    shape = getattr(value, "shape", None)
    return shape is not None and 0 in tuple(shape)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """Base class; subclasses are frozen dataclasses of hyperparameters."""

    #: what the frontend hands ``reduce``: gradients, weights or the optimizer's momentum
    target = Target.GRAD
    #: when in the step the frontend runs it (after backward, before forward, after the optimizer step...)
    phase = Phase.AFTER_BACKWARD
    #: ``reduce`` consumes ``flat``: it may write its result over it (where arrays are
    #: mutable) and never reads it after handing it to its first collective, so a
    #: frontend may let that collective work in place on the bucket buffer (no copy).
    #: Frontends hand such an algorithm only buffers they overwrite with the result.
    donates_input = False
    #: ``reduce`` works elementwise and keeps no state, so a frontend may run it on each
    #: tensor alone instead of on the packed bucket (where that is faster: JAX, large leaves).
    elementwise = False
    #: ``reduce`` runs :func:`~.kernels.kernel` functions (MinMaxUInt8...), which a frontend may compile;
    #: it then checks at set-up that its compiler works, so a missing one never fails mid-training.
    uses_kernels = False
    #: the state refers to peers of one form (ranks flat, nodes over nodes): a frontend that changes
    #: the form of a running algorithm restarts its state from the ranks' average values (as at set-up).
    state_follows_form = False
    #: where ``reduce`` runs over nodes, a node is one worker: the frontend also averages the gradients inside
    #: each node every step (before the optimizer), so a node's ranks stay identical (DiLoCo).
    averages_gradients_in_node = False
    #: ``reduce`` runs over a set of nodes that changes between steps (fault-tolerant replica groups): its
    #: exchange between nodes needs no fixed peers (allreduce, allgather, alltoall over whoever is there) and
    #: its state names none, so a frontend may run it over torchft's reconfigured groups
    elastic_nodes = False
    #: state fields that are each worker's own, not the same on every worker (an error-feedback residual):
    #: a worker that heals from a peer starts them afresh (zeros) instead of copying the peer's, which the
    #: peer still holds and would send again
    own_state = frozenset()  # of field names (no annotation: a class constant, not a dataclass field)

    @property
    def exchange_lag(self) -> int:
        """Steps the collectives of one ``reduce`` may stay in flight while training goes on (0: none).

        An algorithm with a lag splits ``reduce`` into :meth:`apply` then
        :meth:`exchange`, and promises that what ``exchange`` writes is first
        read by the ``apply`` of a later step, and that ``apply`` never writes
        what ``exchange`` reads.  So a frontend may run ``exchange`` on a
        snapshot of the buffer on its communication thread, go on training,
        and wait for it only before the next ``apply`` (Streaming DiLoCo's
        overlap, torch).  A frontend that does not (JAX, where XLA schedules
        the step) calls ``reduce``, which gives the same values (DiLoCo's
        ``reduce`` sends the previous step's launch from the state alone, so
        XLA may overlap it with the step).
        """
        return 0

    def apply(self, flat: Any, layout: BucketLayout, state: NamedTuple, comm: Communicator
              ) -> tuple[Any, NamedTuple]:
        """The local half of ``reduce`` (where :attr:`exchange_lag` > 0), first: no collective; ``comm`` only
        for ``comm.switch``."""
        raise NotImplementedError(f"{type(self).__name__} has no exchange_lag: call reduce")

    def exchange(self, flat: Any, layout: BucketLayout, state: NamedTuple, comm: Communicator) -> NamedTuple:
        """The collective half of ``reduce`` (where :attr:`exchange_lag` > 0), after :meth:`apply`: reads
        ``flat`` and returns the state with what it received."""
        raise NotImplementedError(f"{type(self).__name__} has no exchange_lag: call reduce")

    @property
    def uses(self) -> frozenset[Feature]:
        """Optional communicator features ``reduce`` uses where offered (a frontend sets them up)."""
        return frozenset()

    @property
    def requires(self) -> frozenset[Feature]:
        """The features of :attr:`uses` the user asked for explicitly: a frontend that cannot offer one refuses."""
        return frozenset()

    @property
    def hierarchical_setting(self) -> Optional[bool]:
        """The ``hierarchical=`` that :attr:`uses` and :attr:`requires` amount to: True (node groups required),
        None (used where offered, the faster form), False (never used)."""
        if Feature.HIERARCHICAL in self.requires:
            return True
        return None if Feature.HIERARCHICAL in self.uses else False

    @property
    def timed_form(self) -> bool:
        """Whether a frontend with node groups picks flat or over nodes by timing both (``hierarchical=None``:
        the two forms give the same result, only their speed differs).  False where the setting decides."""
        return self.hierarchical_setting is None

    def communicates(self, state: NamedTuple) -> bool:
        """Whether ``reduce`` on ``state`` makes any collective, decided on the host from the state's counters.

        A frontend that must prepare the peers before an exchange (fault-tolerant replica groups agree on who
        takes part first) does so only for the steps that exchange.  True unless an algorithm says otherwise.
        """
        return True

    def branch_key(self, step: int) -> Optional[Hashable]:
        """What decides every ``comm.switch`` index at step counter ``step`` (``state.step``, on the host), or
        None where nothing does (no switch, or one that does not depend on the step alone).

        Steps with the same key take the same branches, so a frontend that compiles the step
        (JAX, through ``dp.step``) compiles one program per key, with one branch each, instead of all
        branches behind a traced switch: it reads ``state.step`` on the host and hands a step of that key to
        :meth:`~bagua_x.core.comm.Communicator.counter`, from which the algorithm computes its indices
        (``tests/algorithms/test_branch_key.py`` checks each algorithm's key against its switches).
        """
        return None

    def alignment(self, world_size: int) -> int:
        """Bucket buffers are padded to a multiple of this many elements."""
        return 1

    def init(self, flat, layout: BucketLayout, world_size: int) -> NamedTuple:
        """Per-bucket state, built from the bucket's initial flat buffer."""
        return EmptyState()

    def reduce(self, flat: Any, layout: BucketLayout, state: NamedTuple, comm: Communicator
               ) -> tuple[Any, NamedTuple]:
        """One bucket's communication: ``(new_flat, new_state)`` from ``flat`` and the bucket's ``state``.

        Args:
            flat: the bucket's 1-D buffer of ``target`` values (gradients, weights or momenta) laid out as
                ``layout``: numpy in tests, a torch tensor, or a traced JAX array.  Math goes through
                :func:`namespace` (the Array API), so one code serves all three.
            layout: each tensor's name, shape and offset in ``flat`` (padding at the end).
            state: this bucket's state, as :meth:`init` or the previous call returned it.
            comm: a :class:`~bagua_x.core.Communicator`; every rank must make the same collectives in the
                same order with the same shapes (branch with ``comm.switch`` on state, never on values).

        Returns:
            The communicated buffer (same shape and dtype as ``flat``) and the new state (same type).
        """
        raise NotImplementedError

    def split_state(self, state: NamedTuple, layout: BucketLayout) -> list[NamedTuple]:
        """``state`` cut into one piece per tensor of ``layout`` (padding dropped).

        So a frontend whose buckets are regrouped by someone else (DDP's rebuild
        after its first step, or a fresh DDP after a resume: the comm hook) can
        keep each tensor's state instead of starting the new bucket afresh.
        Each piece is of the state's own type.  :meth:`join_state` is the inverse.
        Stateless algorithms need nothing more.
        """
        if state._fields:
            raise BaguaXError(
                f"{type(self).__name__} keeps per-bucket state ({list(state._fields)}) that it cannot split per "
                "tensor, so it cannot follow tensors into other buckets; keep the same buckets (bagua_x.torch.wrap)"
            )
        return [EmptyState() for _ in layout.slots]

    def join_state(self, pieces: list[NamedTuple], layout: BucketLayout) -> NamedTuple:
        """A bucket's state (laid out as ``layout``) from its tensors' pieces (:meth:`split_state`), in slot order."""
        return EmptyState()

    def wire_bytes(self, layout: BucketLayout, itemsize: int, world_size: int) -> float:
        """Bytes each rank sends per training step for a bucket laid out as ``layout`` (steady state)."""
        return ring_allreduce_bytes(layout.padded_numel, itemsize, world_size)

    def hyperparameters(self) -> dict:
        """Name and settings, compared across ranks at wrap."""
        return {"algorithm": type(self).__name__, **dataclasses.asdict(self)}


def namespace(x):
    return array_api_compat.array_namespace(x)


def counter(xp) -> Any:
    """A scalar step counter in the state (int32, so JAX can trace it).

    The one array an algorithm makes off its bucket's device, on purpose: on
    the host (torch: the CPU) ``comm.switch`` picks a branch from it without
    waiting for the GPU.  It only ever meets bucket arrays as a scalar.
    """
    return xp.zeros((), dtype=xp.int32)  # no device=: the namespace's host default, on purpose (see above)


def every(comm, step, interval: int, fn, operand):
    """``fn(operand)`` when ``step % interval == 0``, else ``operand`` unchanged (``step``: from
    ``comm.counter``, so it may be the host's)."""
    if interval == 1:
        return fn(operand)
    xp = namespace(step)
    skip = xp.astype(step % interval != 0, xp.int32)
    return comm.switch(skip, [fn, lambda o: o], operand)


def ring_allreduce_bytes(numel: int, itemsize: int, world_size: int) -> float:
    """A ring allreduce sends ``2 (N-1)/N`` of the buffer from each rank."""
    return 2 * (world_size - 1) / world_size * numel * itemsize


def compressed_bytes(numel: int, world_size: int) -> float:
    """ByteGrad's alltoall + allgather of uint8 chunks, each with an 8-byte min/max header."""
    return 2 * (world_size - 1) * (numel / world_size + 8)


class NodeAware:
    """Mixin for algorithms with a ``hierarchical: Optional[bool]`` field (Bagua's option).

    ``None`` uses the frontend's node groups where it has them and they are
    faster (the frontend times both forms and offers the groups or withholds
    them: :mod:`bagua_x.core.topology`), ``True`` requires them (a frontend
    that has none refuses), ``False`` stays flat.
    """

    hierarchical: Optional[bool]

    @property
    def uses(self) -> frozenset[Feature]:
        return frozenset() if self.hierarchical is False else frozenset({Feature.HIERARCHICAL})

    @property
    def requires(self) -> frozenset[Feature]:
        return frozenset({Feature.HIERARCHICAL}) if self.hierarchical is True else frozenset()

    def two_level(self, comm) -> bool:
        """Whether ``reduce`` runs over nodes on ``comm`` (see :func:`hierarchical`)."""
        return hierarchical(self.hierarchical, comm)


def hierarchical(setting: Optional[bool], comm) -> bool:
    """Whether a ``hierarchical=`` setting runs in two levels on ``comm``.

    ``None`` (the default): when there are >= 2 nodes of >= 2 ranks (with one
    rank per node the two levels would be the flat exchange again, and on one
    node there is no slow link to spare) and the frontend found the two levels
    faster: it times both forms and withholds the node groups from ``comm``
    when flat wins.  ``True``: whenever the communicator knows the nodes.
    """
    if setting is False or Feature.HIERARCHICAL not in comm.features:
        return False
    if Feature.REPLICA_GROUPS in comm.features:  # a node is the unit that survives: never a form that is not over nodes
        return True
    return two_level_on(setting, comm.across.size, comm.within.size)


def over_nodes(flat, comm, exchange: Callable, op: ReduceOp = ReduceOp.AVG):
    """Bagua's hierarchical scheme: full precision inside each node, ``exchange`` between nodes.

    ``exchange(shard, comm.across)`` is the flat algorithm run among the nodes
    on node averages (``op``: the in-node reduction).  Bagua funnels a node
    through one leader (reduce to it, leaders exchange, broadcast); under SPMD
    every rank runs the same program, so each of a node's L ranks carries one
    shard instead: reduce-scatter inside the node, the exchange among the ranks
    holding that shard in every node, allgather inside the node.  The bytes
    between nodes are the leader scheme's, spread over every rank's link.
    ``flat`` is padded to a multiple of L elements when it is not one (a bucket
    aligned to the world size never is).
    """
    xp = namespace(flat)
    within, shape = comm.within, flat.shape
    flat = xp.reshape(flat, (-1,))
    n = flat.shape[0]
    pad = -n % within.size
    if pad:
        flat = xp.concat([flat, xp.zeros((pad,), dtype=flat.dtype, device=array_api_compat.device(flat))])
    shard = within.reduce_scatter(xp.reshape(flat, (within.size, -1)), op)
    out = xp.reshape(within.allgather(exchange(shard, comm.across)), (-1,))
    return xp.reshape(out[:n] if pad else out, shape)
