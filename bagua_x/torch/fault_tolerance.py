"""Fault-tolerant replica groups on torchft: lose a node, keep training.

A node (torchft's *replica group*: the ranks one ``torchrun`` starts) is the
unit that dies and comes back.  Inside it nothing changes: its ranks form an
ordinary ``torch.distributed`` world and average in full precision.  Between
nodes, every collective of the algorithm goes through a torchft
:class:`~torchft.Manager` and its reconfigurable gloo group, whose members are
the ranks at this rank's place in every live node (bagua_x's ``comm.across``).

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

import copy
import dataclasses
import datetime
import io
import logging
import os
import socket
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions, BroadcastOptions

from ..algorithms.base import Algorithm
from ..core.comm import Feature, ReduceOp
from ..core.errors import BaguaXError
from .communicator import TorchCommunicator, _op, _reduce_rows
from .store import restart_count

__all__ = ["FaultTolerance", "Replicas", "ReplicaCommunicator", "ReplicaGroups"]

log = logging.getLogger(__name__)


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
    """

    lighthouse: Optional[str] = None
    replica_id: Optional[str] = None
    min_replicas: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    address: Optional[str] = None

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


def _check_lighthouse(settings: FaultTolerance, node_group: dist.ProcessGroup) -> None:
    """The node's first rank connects to the lighthouse (retrying for ``timeout`` seconds: it may start later);
    every rank of the node raises the same BaguaXError if it cannot, instead of rank 0 alone after a minute
    and the others with a closed store (collective in the node)."""
    first = dist.get_global_rank(node_group, 0)
    problem = [None]
    if dist.get_rank() == first:
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
    failed = torch.tensor([int(problem[0] is not None)])
    dist.broadcast(failed, src=first, group=node_group)
    if failed.item():
        raise BaguaXError(problem[0] or f"bagua_x: fault tolerance: the lighthouse {settings.lighthouse!r} cannot "
                          "be reached from this node (its first rank says why); start it first and give every rank "
                          "its address (TORCHFT_LIGHTHOUSE=http://host:port)")


def _manager_store(settings: FaultTolerance, node_group: dist.ProcessGroup):
    """A fresh TCPStore for this node's torchft managers, on the node's first rank: ``(store or None, port)``.

    Not torchrun's store: that one outlives a restart of the node's ranks (``--max-restarts``), so a rank
    would read the dead manager's address that the previous attempt left there.  Peers reach this one at
    the node's reachable address (torchft's groups between nodes meet in the first member's store).
    """
    first = dist.get_global_rank(node_group, 0)
    store, port = None, torch.zeros(1, dtype=torch.int64)
    if dist.get_rank() == first:
        store = dist.TCPStore(host_name=settings.address, port=0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=settings.timeout))
        port[0] = store.port
    dist.broadcast(port, src=first, group=node_group)
    return store, int(port.item())


def check_supported(algorithm: Algorithm, optimizer: Optional[torch.optim.Optimizer]) -> Algorithm:
    """``algorithm`` as it runs over replica groups (always over nodes), or a BaguaXError saying what does."""
    if optimizer is None:
        raise BaguaXError("fault_tolerance needs the optimizer: wrap(model, optimizer, ..., fault_tolerance=...): "
                          "a step that some node could not complete must not be applied, and a healing node "
                          "takes the optimizer's state too")
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

    ``manager`` is torchft's own (``batches_committed()``, ``participating_rank()``...); hand further state
    to healing nodes with :meth:`keep` (e.g. the data position), which also keeps a node's ranks agreed.
    """

    def __init__(self, settings: FaultTolerance, node_group: dist.ProcessGroup):
        node_rank, node_size = dist.get_rank(node_group), dist.get_world_size(node_group)
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
            lighthouse_addr=settings.lighthouse,
            replica_id=settings.replica_id, hostname=settings.address, connect_timeout=timeout,
            checkpoint_transport=ReachableHTTPTransport(timeout=timeout, num_chunks=0))
        self._begun = False
        # a node at the job's start may train alone until the others come; a restarted one first finds a peer
        self._joined = restart_count() == 0

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
        self.manager.start_quorum()
        while not self._joined and self.manager.num_participants() < 2:
            # restarted and alone: never become the quorum with a fresh model (the others may be away for a
            # moment: a partition, their own restart); wait for one to heal from
            if time.monotonic() > deadline:
                raise BaguaXError(f"bagua_x: fault tolerance: this node was restarted and found no live node to heal "
                                  f"from within quorum_timeout={self.settings.quorum_timeout:g} s; it will not train "
                                  "alone from its initial weights: restart the job from a checkpoint")
            time.sleep(1.0)
            self.manager.start_quorum()
        self._joined = True
        self._begun = True
        self._agree_in_node()

    def _agree_in_node(self) -> None:
        """Where any rank of this node healed, every rank takes the node's first rank's state (collective in the node).

        torchft picks a healing source per rank, spreading the load: ranks of one node may heal from different
        peers.  Peers at the same committed step hold the same state, except at step 0, where each node still
        has its own initial weights: a node whose ranks healed from two of them would hold two models.
        """
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
            log.warning("bagua_x: fault tolerance: step discarded (%s); the next quorum leaves out the dead",
                        self.manager.errored() or "a member could not complete it")
        return committed

    @property
    def step(self) -> int:
        """Steps committed (the manager's count: the same on every live node)."""
        return self.manager.current_step()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class ReplicaCommunicator:
    """The ranks at this rank's place in every node of the current quorum, over torchft's reconfigurable group.

    Sized at each step.  A failed collective is reported to the manager (the
    step will not commit) and returns zeros of the right shape, so the caller
    goes on to the vote instead of raising.  After a failure the step's further
    collectives are skipped (as torchft's own ``allreduce``).
    """

    features: frozenset[Feature] = frozenset()

    def __init__(self, replicas: Replicas):
        self._replicas = replicas

    @property
    def rank(self) -> int:
        rank = self._replicas.manager.participating_rank()
        if rank is None:
            raise BaguaXError("bagua_x: a collective between nodes outside a quorum (internal error: begin() first)")
        return rank

    @property
    def size(self) -> int:
        return self._replicas.manager.num_participants()

    def __repr__(self) -> str:
        return f"ReplicaCommunicator(replica_id={self._replicas.settings.replica_id!r})"

    def allreduce(self, x: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        if self._replicas.manager.errored() is None:
            torch_op = dist.ReduceOp.AVG if op is ReduceOp.AVG else _op(op)
            self._replicas.manager.allreduce(out, reduce_op=torch_op).wait()  # AVG: over the members that take part
        return out

    def allgather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows = [torch.zeros_like(x) for _ in range(self.size)]
        self._run(lambda: self._replicas.group.allgather([rows], [x], AllgatherOptions()), "allgather")
        return torch.stack(rows)

    def alltoall(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 0 or x.shape[0] != self.size:
            raise BaguaXError(f"alltoall needs one row per node ({self.size}), got shape {tuple(x.shape)}")
        x = x.contiguous()
        out = torch.zeros_like(x)
        self._run(lambda: self._replicas.group.alltoall_base(out, x, [], [], AllToAllOptions()), "alltoall")
        return out

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        out = _reduce_rows(self.alltoall(x), ReduceOp.SUM if op is ReduceOp.AVG else op)
        return out / self.size if op is ReduceOp.AVG else out

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        options = BroadcastOptions()
        options.rootRank = root
        self._run(lambda: self._replicas.group.broadcast([out], options), "broadcast")
        return out

    def permute(self, x, pairs: Sequence[tuple[int, int]]):
        raise BaguaXError("point-to-point exchanges between replica groups are not supported (their members change)")

    def switch(self, index, branches: Sequence[Callable], operand):
        return branches[int(index)](operand)

    def counter(self, step):
        return step  # on the host already

    def _run(self, start: Callable, what: str) -> None:
        manager = self._replicas.manager
        if manager.errored() is not None:
            return
        try:
            start().wait()
        except Exception as e:  # a peer died mid-step: this step is spoilt, the vote discards it
            log.warning("bagua_x: fault tolerance: %s between nodes failed: %s", what, e)
            manager.report_error(e)


class ReplicaGroups(TorchCommunicator):
    """The communicator of a wrapped model over replica groups: its own collectives stay inside the node (set-up
    checks, broadcasts), ``within`` is the node and ``across`` the :class:`ReplicaCommunicator`."""

    def __init__(self, process_group: dist.ProcessGroup, timeout: float, node: TorchCommunicator,
                 replicas: Replicas):
        super().__init__(process_group, timeout=timeout)
        self._node_comms = (node, ReplicaCommunicator(replicas))
        self._features = frozenset({Feature.HIERARCHICAL, Feature.REPLICA_GROUPS})

    def duplicate(self) -> "TorchCommunicator":
        raise BaguaXError("fault_tolerance runs no exchange in flight across steps (internal error)")

    def use_nodes(self, two_level: bool) -> None:
        if not two_level:
            raise BaguaXError("over replica groups a node is always one worker (internal error: no flat form)")


def healing_state(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], engine,
                  algorithm: Algorithm, signature: dict) -> tuple[Callable[[], dict], Callable[[dict], None]]:
    """``(save, load)`` of what a healing node takes from a live one: the model, the optimizer, the algorithm's
    state (less what is each worker's own: ``Algorithm.own_state`` starts at zero), and the ``signature``
    (model and algorithm), which must match the healing node's own."""

    def save() -> dict:
        # copies: on CPU torchft serves the tensors it is given while this node trains on in place
        return {"signature": signature,
                "model": {k: v.detach().clone() for k, v in module.state_dict().items()},
                "optimizer": copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None,
                "algorithm": engine.state_dict()}

    def load(state: dict) -> None:
        if state["signature"] != signature:
            differs = sorted(k for k in set(signature) | set(state["signature"])
                             if signature.get(k) != state["signature"].get(k))
            verb = "differs" if len(differs) == 1 else "differ"
            raise BaguaXError(f"bagua_x: fault tolerance: this node cannot heal from its peer: the "
                              f"{' and '.join(differs)} {verb} (here {[signature.get(k) for k in differs]}, the "
                              f"peer's {[state['signature'].get(k) for k in differs]}); every node must train the "
                              "same model with the same algorithm")
        with torch.no_grad():
            module.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        engine.load_state_dict({bucket: {k: torch.zeros_like(v) if k in algorithm.own_state else v
                                          for k, v in fields.items()} if isinstance(fields, dict) else fields
                                for bucket, fields in state["algorithm"].items()})
        log.info("bagua_x: fault tolerance: healed from a live peer")

    return save, load


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
