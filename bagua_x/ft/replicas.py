"""Fault-tolerant replica groups on torchft: lose a node, keep training (both frontends).

A node (torchft's *replica group*: the ranks one ``torchrun`` starts, or one
JAX process and its devices) is the unit that dies and comes back.  Inside it
nothing changes: its ranks (devices) average in full precision.  Between nodes,
every collective of the algorithm goes through a torchft
:class:`~torchft.Manager` and its reconfigurable gloo group, whose members are
the ranks at this rank's place in every live node (bagua_x's ``comm.across``,
:class:`~.communicator.ReplicaCommunicator`).  The frontends build on this
module (``bagua_x.torch.fault_tolerance``, ``bagua_x.jax.fault_tolerance``);
it imports torch and torchft, never a frontend.

One step that crosses nodes is one torchft step:

1. ``begin()``: a synchronous quorum at the lighthouse (who is alive).  A node
   that is behind -- restarted, or new -- *heals* here, before it sends
   anything: it loads a live peer's model, optimizer, algorithm state and the
   user's registered state (e.g. the data position), served over HTTP at the
   address its peers reach (not the host name, which fails across network
   namespaces).  So every member then sends real values and no average needs a
   correction for a member that had none.  A restarted node alone in the
   quorum waits for a peer instead of training on from its initial weights
   (it would overwrite the job's progress when the others come back).
2. the algorithm's exchange, over the quorum's members (the communicator's
   ``across`` is sized at each step).  A collective that fails (a peer died
   mid-step) is reported to the manager instead of raising: the step is
   spoilt, not the process.
3. ``commit()``: every member of the quorum votes; the step is applied only
   when all agree (``should_commit``), else it is discarded -- a gradient
   algorithm's optimizer step is skipped, DiLoCo's exchange is rolled back and
   retried at the next step.

Gradient algorithms cross nodes every step (quorum at each training forward,
commit at ``optimizer.step()``); DiLoCo only at its outer steps
(``Algorithm.communicates``), so its inner steps never wait for the lighthouse.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import logging
import os
import socket
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..algorithms.base import Algorithm
from ..core.errors import BaguaXError

__all__ = ["FaultTolerance", "Replicas", "elastic_algorithm", "reachable_address"]

log = logging.getLogger(__name__)

#: seconds one quorum request may wait before a fresh one is sent (a request lost in a partition is never
#: answered); far above a quorum's usual wait (the lighthouse's join timeout, a few seconds)
QUORUM_ATTEMPT_S = 10.0


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
    """``wrap(..., fault_tolerance=FaultTolerance())``: this node is a torchft replica group.

    Args:
        lighthouse: the torchft lighthouse's address (``http://host:port``); default ``TORCHFT_LIGHTHOUSE``.
        replica_id: this node's name, the same for its ranks and kept across its restarts; default
            ``REPLICA_GROUP_ID``.
        min_replicas: the fewest nodes that may commit a step (1: a lone survivor trains on).
        timeout: seconds each collective between nodes, each vote and each healing transfer may take.
        quorum_timeout: seconds to wait for a quorum (longer than the time between two exchanges: DiLoCo's
            outer steps are H inner steps apart); also how long a restarted node waits for a live node to
            heal from before it gives up (it never trains alone from its initial weights).
        address: the address other nodes reach this node at (its checkpoint server and manager); default
            the address of the interface that routes to the lighthouse.
        init_sync: at the first quorum every node takes one node's state (torchft's keyword).  False where
            every node starts from the same weights (one seed): a node whose first exchange comes after local
            steps (DiLoCo's H inner steps) then keeps them instead of taking a peer's.
    """

    lighthouse: Optional[str] = None
    replica_id: Optional[str] = None
    min_replicas: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    address: Optional[str] = None
    init_sync: bool = True

    def resolved(self) -> "FaultTolerance":
        """The settings with their defaults filled in from the environment (a BaguaXError names what is missing)."""
        lighthouse = self.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        replica_id = self.replica_id or os.environ.get("REPLICA_GROUP_ID")
        missing = [name for name, value in (("lighthouse (or TORCHFT_LIGHTHOUSE)", lighthouse),
                                            ("replica_id (or REPLICA_GROUP_ID)", replica_id)) if not value]
        if missing:
            raise BaguaXError(f"FaultTolerance: {' and '.join(missing)} not set: give each node a name kept across "
                              "its restarts, and the lighthouse's address (`bagua-x cluster --fault-tolerant` "
                              "sets both)")
        if self.min_replicas < 1:
            raise BaguaXError(f"FaultTolerance: min_replicas must be >= 1, got {self.min_replicas}")
        return dataclasses.replace(self, lighthouse=lighthouse, replica_id=replica_id,
                                   address=self.address or reachable_address(lighthouse))


def reachable_address(lighthouse: str) -> str:
    """The local address of the interface that routes to ``lighthouse``: the one peers reach (no packet is sent)."""
    host = lighthouse.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return probe.getsockname()[0]
        except OSError as e:
            raise BaguaXError(f"FaultTolerance: no route to the lighthouse {lighthouse!r} ({e}); check its address, "
                              "or pass FaultTolerance(address=...) with this node's reachable address") from None


def _first_in_node(node_group: Optional[dist.ProcessGroup]) -> bool:
    """Whether this process is its node's first rank (a node without a group is one process)."""
    return node_group is None or dist.get_rank() == dist.get_global_rank(node_group, 0)


def _from_first(value: torch.Tensor, node_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``value`` as the node's first rank has it (collective in the node; a node of one process keeps its own)."""
    if node_group is not None:
        dist.broadcast(value, src=dist.get_global_rank(node_group, 0), group=node_group)
    return value


def _check_lighthouse(settings: FaultTolerance, node_group: Optional[dist.ProcessGroup]) -> None:
    """The node's first rank connects to the lighthouse (retrying for ``timeout`` seconds: it may start later);
    every rank of the node raises the same BaguaXError if it cannot, instead of rank 0 alone after a minute
    and the others with a closed store (collective in the node)."""
    problem = [None]
    if _first_in_node(node_group):
        host, _, port = settings.lighthouse.split("://")[-1].rpartition(":")
        deadline = time.monotonic() + settings.timeout
        while True:
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=settings.timeout).close()
                break
            except (OSError, ValueError) as e:
                if isinstance(e, ValueError) or time.monotonic() > deadline:
                    problem = [f"bagua_x: fault tolerance: the lighthouse {settings.lighthouse!r} cannot be reached "
                               f"({e}, for {settings.timeout:.0f} s); start it first (torchft_lighthouse "
                               "--min_replicas 1) and give every rank its address "
                               "(TORCHFT_LIGHTHOUSE=http://host:port)"]
                    break
                time.sleep(0.5)
    if _from_first(torch.tensor([int(problem[0] is not None)]), node_group).item():
        raise BaguaXError(problem[0] or f"bagua_x: fault tolerance: the lighthouse {settings.lighthouse!r} cannot "
                          "be reached from this node (its first rank says why); start it first and give every rank "
                          "its address (TORCHFT_LIGHTHOUSE=http://host:port)")


def _manager_store(settings: FaultTolerance, node_group: Optional[dist.ProcessGroup]):
    """A fresh TCPStore for this node's torchft managers, on the node's first rank: ``(store or None, port)``.

    Not torchrun's store: that one outlives a restart of the node's ranks (``--max-restarts``), so a rank
    would read the dead manager's address that the previous attempt left there.  Peers reach this one at
    the node's reachable address (torchft's groups between nodes meet in the first member's store).
    """
    store, port = None, torch.zeros(1, dtype=torch.int64)
    if _first_in_node(node_group):
        store = dist.TCPStore(host_name=settings.address, port=0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=settings.timeout))
        port[0] = store.port
    return store, int(_from_first(port, node_group).item())


def elastic_algorithm(algorithm: Algorithm) -> Algorithm:
    """``algorithm`` as it runs over replica groups (a node is one worker: over nodes), or a BaguaXError saying
    which algorithms do: those whose exchange works with any number of nodes, committed with its step."""
    name = type(algorithm).__name__
    if not algorithm.elastic_nodes:
        raise BaguaXError(f"fault_tolerance runs algorithms that declare elastic_nodes (GradientAllReduce, ByteGrad, "
                          f"DiLoCo, SparseLoCo), not {name}, whose exchange needs a fixed set of peers: use one of "
                          f"them, or train {name} without fault_tolerance")
    if algorithm.exchange_lag:
        raise BaguaXError(f"fault_tolerance with {name}'s exchange left in flight across steps (exchange_lag "
                          f"{algorithm.exchange_lag}: DiLoCo's fragment_sync_delay) is not supported: it could not be "
                          "committed or discarded with its step; use fragment_sync_delay=0 (fragments are fine)")
    if "hierarchical" in {f.name for f in dataclasses.fields(algorithm)} and algorithm.hierarchical is not True:
        log.info("bagua_x: fault tolerance: a node is one worker, so %s runs over nodes", name)
        algorithm = dataclasses.replace(algorithm, hierarchical=True)
    return algorithm


class Replicas:
    """This rank's torchft Manager and the step protocol of the module docstring (made by ``wrap``).

    ``node_group`` is the node's ``torch.distributed`` group (its ranks), or None where the node is one
    process (a JAX node: one process and its devices).

    ``manager`` is torchft's own (``batches_committed()``, ``participating_rank()``...); hand further state
    to healing nodes with :meth:`keep` (e.g. the data position), which also keeps a node's ranks agreed.
    """

    def __init__(self, settings: FaultTolerance, node_group: Optional[dist.ProcessGroup] = None):
        node_rank, node_size = (0, 1) if node_group is None else (dist.get_rank(node_group),
                                                                  dist.get_world_size(node_group))
        try:
            from torchft import Manager, ProcessGroupGloo
            from torchft.checkpointing.http_transport import HTTPTransport
        except ImportError as e:
            raise BaguaXError(f"fault_tolerance needs torchft ({e}): pip install 'bagua-x[ft]'") from None

        class ReachableHTTPTransport(HTTPTransport):
            """torchft's checkpoint server, advertised at the address peers reach (it gives the host name)."""

            def address(self) -> str:
                return f"http://{_url_host(settings.address)}:{self._server.socket.getsockname()[1]}/checkpoint/"

        _check_lighthouse(settings, node_group)
        self.settings = settings
        self.node_group = node_group
        self._kept: dict[str, tuple[Callable[[], object], Callable[[object], None]]] = {}
        self._healed = False  # this rank loaded a peer's state since the last begin()
        timeout = datetime.timedelta(seconds=settings.timeout)
        self.group = ProcessGroupGloo(timeout=timeout)
        self._store, store_port = _manager_store(settings, node_group)
        self.manager = Manager(
            pg=self.group, load_state_dict=None, state_dict=None, min_replica_size=settings.min_replicas,
            use_async_quorum=False,  # heal before the exchange: every member then sends real values
            timeout=timeout, quorum_timeout=datetime.timedelta(seconds=settings.quorum_timeout),
            rank=node_rank, world_size=node_size, store_addr=settings.address, store_port=store_port,
            lighthouse_addr=settings.lighthouse, init_sync=settings.init_sync,
            replica_id=settings.replica_id, hostname=settings.address, connect_timeout=timeout,
            checkpoint_transport=ReachableHTTPTransport(timeout=timeout, num_chunks=0))
        self._begun = False
        #: steps this process began across nodes and then discarded (a member failed them): the work faults cost
        self.discarded = 0
        # a node at the job's start may train alone until the others come; a restarted one first finds a peer
        self._joined = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0  # torchrun's restarts

    def keep(self, key: str, save: Callable[[], object], load: Callable[[object], None]) -> None:
        """Send ``save()`` to a healing peer, which gives it to its ``load`` (e.g. the data position)."""
        if key in self._kept:
            raise BaguaXError(f"fault tolerance: state {key!r} is kept already: give each a name of its own")
        self._kept[key] = (save, load)

        def healed(state: object) -> None:
            load(state)
            self._healed = True

        self.manager.register_state_dict_fn(key, healed, save)

    def begin(self) -> None:
        """The quorum before a step that crosses nodes (healing this node first if it is behind); once a step.

        A training loop may call it first, before drawing its batch: the quorum then tells which members
        take part (``manager.participating_rank()``, ``num_participants()``) and healing has restored the
        registered data position.
        """
        if self._begun:
            return
        deadline = time.monotonic() + self.settings.quorum_timeout
        self._quorum(deadline)
        while not self._joined and self.manager.num_participants() < 2:
            # restarted and alone: never become the quorum with a fresh model (the others may be away for a
            # moment: a partition, their own restart); wait for one to heal from
            if time.monotonic() > deadline:
                raise BaguaXError(f"bagua_x: fault tolerance: this node was restarted and found no live node to heal "
                                  f"from within quorum_timeout={self.settings.quorum_timeout:g} s; it will not train "
                                  "alone from its initial weights: restart the job from a checkpoint")
            time.sleep(1.0)
            self._quorum(deadline)
        self._joined = True
        self._begun = True
        self._agree_in_node()

    def _quorum(self, deadline: float) -> None:
        """torchft's quorum, asked again until ``deadline`` when an attempt fails.

        A request made while this node's link is down (a partition) is lost: the lighthouse never answers it,
        even once the link is back.  So each attempt waits at most ``QUORUM_ATTEMPT_S`` and a fresh request
        follows, which the lighthouse sees as soon as it can; the node then heals if the others went on
        without it.  (torchft re-raises a failed quorum at the next ``start_quorum``: the failed one is
        dropped first.)
        """
        while True:
            left = deadline - time.monotonic()
            try:
                self.manager.start_quorum(timeout=datetime.timedelta(seconds=max(1.0, min(QUORUM_ATTEMPT_S, left))))
                return
            except BaguaXError:  # this node's own verdict while healing (another model): final
                raise
            except Exception as e:  # torchft raises the RPC's own errors (TimeoutError, RuntimeError...)
                if time.monotonic() >= deadline:
                    raise BaguaXError(f"bagua_x: fault tolerance: no quorum within quorum_timeout="
                                      f"{self.settings.quorum_timeout:g} s ({e}); is the lighthouse "
                                      f"{self.settings.lighthouse!r} reachable from this node?") from e
                log.warning("bagua_x: fault tolerance: quorum attempt failed (%s); asking again", e)
                self.manager._quorum_future = None

    def _agree_in_node(self) -> None:
        """Where any rank of this node healed, every rank takes the node's first rank's state (collective in the node).

        torchft picks a healing source per rank, spreading the load: ranks of one node may heal from different
        peers.  Peers at the same committed step hold the same state, except at step 0, where each node still
        has its own initial weights: a node whose ranks healed from two of them would hold two models.
        """
        if self.node_group is None:
            self._healed = False
            return
        flag = torch.tensor([int(self._healed)])
        self._healed = False
        dist.all_reduce(flag, dist.ReduceOp.MAX, group=self.node_group)
        if not flag.item():
            return
        first = dist.get_global_rank(self.node_group, 0)
        data, size = torch.zeros(0, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
        if dist.get_rank() == first:
            buffer = io.BytesIO()
            torch.save({key: save() for key, (save, _) in self._kept.items()}, buffer)
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
            size[0] = data.numel()
        dist.broadcast(size, src=first, group=self.node_group)
        if dist.get_rank() != first:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=first, group=self.node_group)
        if dist.get_rank() != first:  # tensors and plain containers only (weights_only): nothing else is run
            state = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
            for key, (_, load) in self._kept.items():
                load(state[key])

    def commit(self) -> bool:
        """Whether every member of the quorum completed the step begun (the caller applies it, or discards it)."""
        if not self._begun:
            return True  # nothing crossed nodes since the last commit: a local step
        self._begun = False
        committed = self.manager.should_commit()
        if not committed:
            self.discarded += 1
            log.warning("bagua_x: fault tolerance: step discarded (%s); the next quorum leaves out the dead",
                        self.manager.errored() or "a member could not complete it")
        return committed

    @property
    def step(self) -> int:
        """Steps committed (the manager's count: the same on every live node)."""
        return self.manager.current_step()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
