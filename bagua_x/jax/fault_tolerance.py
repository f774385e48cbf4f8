"""A JAX node that survives its peers: DiLoCo's outer exchange between nodes on the host, through torchft.

``jax.distributed`` cannot change its members: one process lost ends every
process's collectives, and a new one cannot join.  So here a node is one JAX
job of its own -- one process and its devices, the inner steps in a ``jax.jit``
over its mesh (or ``pmap`` / ``shard_map``), gradients averaged over the
node's devices every step -- and nodes meet only on the host, through torchft
(:mod:`bagua_x.ft`: the quorum, healing, the vote), at the steps the
algorithm crosses nodes (DiLoCo's outer steps, once per ``sync_every``).
There the node's weights and the algorithm's state leave the devices (one
device's copy: a node's devices hold the same values), go to torch over
DLPack, the algorithm's own exchange runs on them over torchft's group (the
same code as every frontend's, a node being one worker), and the result goes
back to every device.  Inner steps never wait for the lighthouse: the host
reads each bucket's step counter (a scalar) and advances it on the devices.
A node that dies costs the others one discarded outer step; when it comes
back it heals from a live one (weights, optimizer state, the algorithm's
state less what is its own, the user's kept state) before it sends anything.

Only weight algorithms that declare ``elastic_nodes`` (DiLoCo, SparseLoCo):
a gradient algorithm would stop every step on the host.  Importing this
module imports torch (an optional extra, ``bagua-x[ft]``); ``bagua_x.jax``
imports it only when ``wrap(..., fault_tolerance=...)`` is asked for.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ..algorithms import Algorithm, Target
from ..core.errors import BaguaXError
from ..ft import FaultTolerance, ReplicaCommunicator, Replicas
from ..ft.replicas import elastic_algorithm
from .schedule import Scheduled, read_ints

__all__ = ["NodeExchange", "check_supported"]

log = logging.getLogger(__name__)


def check_supported(algorithm: Algorithm) -> Algorithm:
    """``algorithm`` as a JAX node runs it between nodes on the host, or a BaguaXError saying what runs."""
    name = type(algorithm).__name__
    if algorithm.target is not Target.WEIGHT or not algorithm.averages_gradients_in_node:
        raise BaguaXError(f"bagua_x.jax.wrap(fault_tolerance=...): the exchange between JAX nodes runs on the host, "
                          f"which pays once per DiLoCo outer step; {name} would cross nodes on the host at every "
                          "step: use DiLoCo or SparseLoCo, or train without fault_tolerance")
    if jax.process_count() > 1:
        raise BaguaXError(f"bagua_x.jax.wrap(fault_tolerance=...): a fault-tolerant JAX node is one process (and its "
                          f"devices); this job has {jax.process_count()}, and jax.distributed cannot lose one and go "
                          "on: start one process per node, each its own job (no jax.distributed.initialize)")
    # the node (this process's devices) is one worker: inside it the gradients are averaged every step
    # (dp.value_and_grad), and between nodes the exchange runs flat on the host
    return dataclasses.replace(elastic_algorithm(algorithm), hierarchical=False)


class NodeExchange:
    """The host side of a fault-tolerant JAX node (made by ``wrap``): :meth:`sync` after each inner step."""

    def __init__(self, dp, settings: FaultTolerance):
        self.dp = dp
        self.replicas = Replicas(settings.resolved(), None)
        self.algorithm = dp.algorithm  # check_supported's: flat over the nodes of the quorum
        self.comm = ReplicaCommunicator(self.replicas)
        self.signature = {"model": [(n, list(s), d) for n, s, d in zip(dp.plan.names, dp.plan.shapes,
                                                                        map(str, dp.plan.dtypes))],
                          "algorithm": dp.algorithm.hyperparameters()}
        self._current: Optional[tuple] = None  # (params, opt_state, state) as of this sync: what a peer heals from
        self._healed: Optional[dict] = None
        self.replicas.keep("bagua_x", self._save, self._load)

    # -- the outer step --------------------------------------------------------------------------
    def sync(self, params: Any, opt_state: Any, state: tuple) -> tuple[Any, Any, tuple]:
        """After an inner step: where a bucket's exchange is due, the quorum (healing first if this node is
        behind), the exchange between nodes and the vote; else the counters advance on the devices."""
        states = self._bucket_states(state)
        steps = read_ints([st.state.step if isinstance(st, Scheduled) else st.step for st in states])
        due = any(self.algorithm.communicates(_inner(st)._replace(step=np.asarray(step, np.int32)))
                  for st, step in zip(states, steps))
        if not due:
            return params, opt_state, _advance(state)
        self._current = (params, opt_state, state)
        self.replicas.begin()  # a node that is behind heals here (self._load), before it sends anything
        if self._healed is not None:
            params, opt_state, state = self._take_healed(params, opt_state, state)
            self._current = (params, opt_state, state)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        rows = self._registered_rows(leaves)
        out_leaves, new_states = list(leaves), []
        for bucket, layout, st in zip(self.dp.bucket_leaves, self.dp.layouts, state):
            flat = layout.pack([rows[i] for i in bucket])
            host_state = _to_host_state(_inner(st), self.algorithm, flat, layout, self.comm.size)
            flat, host_state = self.algorithm.reduce(flat, layout, host_state, self.comm)
            for i, value in zip(bucket, layout.unpack(flat)):
                out_leaves[i] = _on_devices(value, leaves[i])
            new = _from_host_state(host_state, _inner(st))
            new_states.append(Scheduled(new, st.algorithm) if isinstance(st, Scheduled) else new)
        if not self.replicas.commit():  # a member failed: as if this step had not crossed nodes (retried next)
            return params, opt_state, state
        self._current = None
        return jax.tree_util.tree_unflatten(treedef, out_leaves), opt_state, tuple(new_states)

    def _bucket_states(self, state: Any) -> tuple:
        if not isinstance(state, tuple) or len(state) != len(self.dp.bucket_leaves):
            raise BaguaXError(f"dp.sync_replicas(params, opt_state, state): expected this wrap's state (a tuple of "
                              f"{len(self.dp.bucket_leaves)} bucket states), got {type(state).__name__}; pass the "
                              "state of dp.init()")
        return state

    def _registered_rows(self, leaves: list) -> dict[int, torch.Tensor]:
        """One device's copy (row 0) of each registered leaf, as torch CPU tensors over DLPack."""
        plan = self.dp.plan
        if len(leaves) != len(plan.names):
            raise BaguaXError(f"dp.sync_replicas: the params tree has {len(leaves)} leaves, the wrapped one "
                              f"{len(plan.names)}; pass the params of the step, one copy per device")
        rows = {}
        for i in plan.registered:
            shape = tuple(np.shape(leaves[i]))
            if shape[1:] != plan.shapes[i]:
                raise BaguaXError(f"dp.sync_replicas: leaf {plan.names[i]!r} has shape {shape}, expected one copy "
                                  f"per device stacked on a leading axis, (devices, *{plan.shapes[i]}); pass the "
                                  "params as the step returns them (dp.replicate(params, per_device=True))")
            rows[i] = _row(leaves[i])
        return rows

    # -- healing -------------------------------------------------------------------------------------
    def _save(self) -> dict:
        """What a healing peer takes: this node's weights, optimizer state and algorithm state (every device's
        rows: the peer lays them out on its own devices) and the signature it must match."""
        if self._current is None:
            raise BaguaXError("bagua_x: fault tolerance: a peer asked to heal outside an outer step (internal error)")
        params, opt_state, state = self._current
        return {"signature": self.signature,
                "params": [_to_torch(x) for x in jax.tree_util.tree_leaves(params)],
                "optimizer": [_to_torch(x) for x in jax.tree_util.tree_leaves(opt_state)],
                "algorithm": [_to_torch(x) for x in jax.tree_util.tree_leaves(state)]}

    def _load(self, saved: dict) -> None:
        if saved["signature"] != self.signature:
            differs = sorted(k for k in self.signature if saved["signature"].get(k) != self.signature[k])
            raise BaguaXError(f"bagua_x: fault tolerance: this node cannot heal from its peer: the "
                              f"{' and '.join(differs)} {'differs' if len(differs) == 1 else 'differ'} (here "
                              f"{[self.signature[k] for k in differs]}, the peer's "
                              f"{[saved['signature'].get(k) for k in differs]}); every node must train the same "
                              "model with the same algorithm")
        self._healed = saved

    def _take_healed(self, params, opt_state, state) -> tuple:
        """The peer's values on this node's devices (each leaf laid out as this node's own), the algorithm's
        own state (``Algorithm.own_state``: SparseLoCo's error feedback) started at zero."""
        saved, self._healed = self._healed, None
        own = self.dp.algorithm.own_state
        out = []
        for what, tree in (("params", params), ("optimizer", opt_state), ("algorithm", state)):
            paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
            if len(paths) != len(saved[what]):
                raise BaguaXError(f"bagua_x: fault tolerance: this node cannot heal from its peer: its {what} state "
                                  f"has {len(saved[what])} leaves, this node's {len(paths)}; every node must use the "
                                  "same optimizer")
            leaves = []
            for (path, mine), theirs in zip(paths, saved[what]):
                if tuple(theirs.shape) != tuple(np.shape(mine)):
                    raise BaguaXError(f"bagua_x: fault tolerance: this node cannot heal from its peer: {what} leaf "
                                      f"{jax.tree_util.keystr(path)} is {tuple(theirs.shape)} there and "
                                      f"{tuple(np.shape(mine))} here; every node must have as many devices and the "
                                      "same model and optimizer")
                if what == "algorithm" and jax.tree_util.keystr(path).rsplit(".", 1)[-1] in own:
                    theirs = torch.zeros_like(theirs)
                leaves.append(_on_devices(theirs, mine, whole=True))
            out.append(jax.tree_util.tree_unflatten(treedef, leaves))
        log.info("bagua_x: fault tolerance: healed from a live peer")
        return tuple(out)


@jax.jit
def _advance(state: tuple) -> tuple:
    """Every bucket's step counter one step on (an inner step that crosses no node), on the devices."""
    return tuple(st._replace(step=st.step + 1) for st in state)


def _inner(st):
    return st.state if isinstance(st, Scheduled) else st


def _row(x) -> torch.Tensor:
    """One device's copy of a leaf stacked one copy per device, as a torch CPU tensor of its own (DLPack from
    the first device's shard: no other device's data moves)."""
    shard = x.addressable_shards[0].data
    return torch.from_dlpack(shard).reshape(tuple(x.shape[1:])).to("cpu", copy=True)


def _to_torch(x) -> torch.Tensor:
    """A JAX array as a torch CPU tensor of its own (DLPack from one CPU device's copy, then cloned: torch may
    write it, and a JAX array must never change under its owner)."""
    host = jax.device_put(x, jax.local_devices(backend="cpu")[0])
    return torch.from_dlpack(host).clone()


def _on_devices(value: torch.Tensor, like, whole: bool = False):
    """``value`` (one device's copy, or with ``whole`` every device's rows) laid out as ``like`` is."""
    array = jnp.from_dlpack(value.contiguous())
    if not whole:
        array = jnp.broadcast_to(array, np.shape(like))
    return jax.device_put(array.astype(like.dtype), like.sharding)


def _to_host_state(state, algorithm: Algorithm, flat: torch.Tensor, layout, size: int):
    """A bucket state of one device's rows as torch tensors; fields kept as None (zero-size) from ``init``."""
    template = algorithm.init(flat, layout, size)
    return type(state)(*[t if x is None else _row(x) for x, t in zip(state, template)])


def _from_host_state(host_state, like):
    """The host's new bucket state on the devices, laid out as ``like`` (zero-size fields None, as stored)."""
    return type(like)(*[None if old is None else _on_devices(new, old) for new, old in zip(host_state, like)])
