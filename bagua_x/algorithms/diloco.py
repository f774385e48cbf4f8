"""DiLoCo and Streaming DiLoCo: H local steps, then an outer Nesterov step on the averaged pseudo-gradient.

DiLoCo (arXiv 2311.08105): each worker runs ``sync_every`` = H steps of its
own (inner) optimizer; then the pseudo-gradient ``global - local`` (the global
copy is state) is averaged over the workers and an outer SGD with Nesterov
momentum steps the global copy, exactly as ``torch.optim.SGD(nesterov=True)``
would: ``m = mu m + g``; ``g' = g + mu m``; ``global -= lr g'``.  Every worker
continues from the new global weights.  Traffic: one exchange per H steps.

Streaming DiLoCo (arXiv 2501.18512; torchft's keywords): ``fragments`` = P
splits each bucket into P contiguous element ranges, fragment i synced at
steps ``o_i + kH`` with ``o_i = floor(H (i + 1) / P)`` (torchft's schedule),
so one exchange moves 1/P of the model.  With ``fragment_sync_delay`` = tau
the pseudo-gradient is taken at the launch step and its average lands tau
steps later: on landing, the global copy takes the outer step and
``local = global + alpha (local - global)`` (``fragment_update_alpha``; 0 takes
the global weights, dropping the local steps made in between, as torchft).
The exchange overlaps training in both frontends, with the same result:
torch calls ``apply`` (the landing) and leaves ``exchange`` (the launch) in
flight on its communication thread while the next step trains
(``exchange_lag``); JAX calls ``reduce``, which sends the fragment staged at
the previous step from the state alone, so that XLA may run those
collectives beside the step's compute.

``bits`` 8 or 4 sends the pseudo-gradient quantised, as ByteGrad does
(MinMaxUInt8 chunks, alltoall, reduce and re-quantise, allgather); 4 bits
pack two codes a byte.  The average lands identical on every worker.
``compression=TopK(...)`` sends it sparse instead, with error feedback
(SparseLoCo: :mod:`.sparse`): gathered, decoded and summed in rank order; the
error-feedback buffer is state (``error``, empty without compression).

Two levels: where the frontend has node groups, a node is one worker
(:attr:`averages_gradients_in_node`: the frontend averages gradients inside
each node every inner step, so a node's ranks stay identical) and only the
outer exchange crosses nodes, each of a node's ranks carrying one shard
(:func:`~.base.over_nodes`).  Which form runs is not timed, unlike
``hierarchical=None`` elsewhere: the two are different algorithms (a worker
is a rank or a node), so the setting decides.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import array_api_compat
import numpy as np

from ..core.comm import Feature, ReduceOp
from ..core.errors import BaguaXError
from .base import Algorithm, Phase, Target, counter, hierarchical, namespace, over_nodes, ring_allreduce_bytes
from .bytegrad import compressed_allreduce
from .sparse import TopK

__all__ = ["DiLoCo", "DiLoCoState", "SparseLoCo"]


class DiLoCoState(NamedTuple):
    step: Any  # inner (optimizer) steps so far (counter)
    global_weights: Any  # the weights every worker agreed on at each fragment's last landing
    momentum: Any  # the outer optimizer's momentum buffer
    pending: Any  # pseudo-gradients in flight (fragment_sync_delay > 0): staged, then averaged once sent; else empty
    error: Any  # the error-feedback buffer of ``compression`` (what was not sent yet), else empty


@dataclasses.dataclass(frozen=True)
class DiLoCo(Algorithm):
    """DiLoCo (``fragments=1``) and Streaming DiLoCo over the user's own (inner) optimizer.

    Args:
        sync_every: H, inner steps between two exchanges of a fragment.
        outer_lr: the outer SGD's learning rate (DiLoCo's 0.7).
        outer_momentum: its momentum (0.9).
        nesterov: Nesterov momentum (as torch's SGD), else heavy ball.
        fragments: P, the parts of the model synchronised at staggered steps (Streaming DiLoCo); each
            bucket is split into P contiguous element ranges.  ``sync_every >= fragments``.
        fragment_sync_delay: tau, inner steps between a fragment's launch and its landing;
            ``tau < sync_every // fragments`` (a fragment lands before the next one launches).
        fragment_update_alpha: on landing, ``local = global + alpha (local - global)``; 0 takes the global.
        bits: 32 (full precision), 8 or 4: how the pseudo-gradient travels (dense).
        compression: a :class:`~.sparse.TopK` sends it sparse instead, with error feedback (``bits`` stays 32).
        hierarchical: ``None`` (default): a node is one worker where the frontend knows >= 2 nodes of
            >= 2 ranks; ``True``: require node groups; ``False``: every rank is a worker.
    """

    sync_every: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    bits: int = 32
    compression: Optional[TopK] = None
    hierarchical: Optional[bool] = None

    target = Target.WEIGHT
    phase = Phase.AFTER_STEP
    state_follows_form = True  # the global copy and momentum are a worker's: a rank's or a node's
    averages_gradients_in_node = True
    own_state = frozenset({"error"})  # what this worker has not sent yet
    elastic_nodes = True  # any number of nodes: what crosses them is an average (or a gather) over those there
    timed_form = False  # a worker is a rank or a node: two algorithms, not two speeds of one

    def __post_init__(self):
        problems = []
        if self.sync_every < 1:
            problems.append(f"sync_every must be >= 1, got {self.sync_every}")
        if self.fragments < 1 or self.fragments > self.sync_every:
            problems.append(f"fragments must be between 1 and sync_every ({self.sync_every}): one fragment is "
                            f"synchronised at a time, got {self.fragments}")
        elif not 0 <= self.fragment_sync_delay < self.sync_every // self.fragments:
            problems.append(f"fragment_sync_delay must be >= 0 and < sync_every // fragments = "
                            f"{self.sync_every // self.fragments} (a fragment lands before the next one launches), "
                            f"got {self.fragment_sync_delay}")
        if not 0.0 <= self.fragment_update_alpha <= 1.0:
            problems.append(f"fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha}")
        if self.bits not in (32, 8, 4):
            problems.append(f"bits must be 32, 8 or 4, got {self.bits}")
        if self.compression is not None and not isinstance(self.compression, TopK):
            problems.append(f"compression must be a bagua_x.algorithms.TopK or None, got {self.compression!r}")
        elif self.compression is not None and self.bits != 32:
            problems.append(f"bits={self.bits} and compression=TopK(...) both set how the pseudo-gradient travels: "
                            "give the bits to TopK(bits=...) and leave DiLoCo's bits at 32")
        if self.outer_lr <= 0 or not 0.0 <= self.outer_momentum < 1.0:
            problems.append(f"outer_lr must be > 0 and outer_momentum in [0, 1), got {self.outer_lr} and "
                            f"{self.outer_momentum}")
        if problems:
            raise BaguaXError("DiLoCo: " + "; ".join(problems))

    @property
    def uses(self) -> frozenset[Feature]:
        return frozenset() if self.hierarchical is False else frozenset({Feature.HIERARCHICAL})

    @property
    def requires(self) -> frozenset[Feature]:
        return frozenset({Feature.HIERARCHICAL}) if self.hierarchical is True else frozenset()

    # -- the schedule (static: from the hyperparameters alone) ---------------------------------------------
    def fragment_bounds(self, numel: int) -> list[tuple[int, int]]:
        """Each fragment's element range ``[start, stop)`` in a bucket of ``numel`` elements."""
        cuts = [i * numel // self.fragments for i in range(self.fragments + 1)]
        return list(zip(cuts[:-1], cuts[1:]))

    def offsets(self) -> list[int]:
        """The step (1-based, mod H) at which each fragment launches: ``floor(H (i + 1) / P)``."""
        return [self.sync_every * (i + 1) // self.fragments for i in range(self.fragments)]

    # -- the algorithm ----------------------------------------------------------------------------------------
    def init(self, flat, layout, world_size):
        xp = namespace(flat)
        device = array_api_compat.device(flat)
        in_flight = flat.shape[0] if self.fragment_sync_delay else 0
        feedback = flat.shape[0] if self.compression is not None else 0
        return DiLoCoState(step=counter(xp), global_weights=xp.asarray(flat, copy=True),
                           momentum=xp.zeros_like(flat), pending=xp.zeros((in_flight,), dtype=flat.dtype, device=device),
                           error=xp.zeros((feedback,), dtype=flat.dtype, device=device))

    def wire_bytes(self, layout, itemsize, world_size):
        n = layout.padded_numel
        if self.compression is not None:  # an allgather of every fragment's payload
            per_sync = sum((world_size - 1) * self.compression.payload_bytes(b - a) for a, b in self.fragment_bounds(n))
        elif self.bits == 32:
            per_sync = ring_allreduce_bytes(n, itemsize, world_size)
        else:  # alltoall + allgather of each fragment's rank chunks, each with its 8-byte min/max
            per_sync = 2 * (world_size - 1) * (n * self.bits / 8 / world_size + 8 * self.fragments)
        return per_sync / self.sync_every

    def communicates(self, state) -> bool:
        """Only at the steps whose ``reduce`` sends a fragment: the one launching (``fragment_sync_delay`` 0:
        sent and landed), or with a delay the one launched at the step before (see :meth:`reduce`)."""
        return int(self._due(state.step + 1, 1 if self.fragment_sync_delay else 0)) != self.fragments

    def branch_key(self, step):
        """The fragments this step's ``reduce`` acts on (P: none): the one launching; with a delay also the one
        sent (launched the step before) and the one landing."""
        step = np.asarray(step + 1, np.int32)
        delays = (1, self.fragment_sync_delay, 0) if self.fragment_sync_delay else (0,)
        return tuple(int(self._due(step, delay)) for delay in delays)

    @property
    def exchange_lag(self) -> int:
        """tau: a fragment's exchange, launched at one step, is read at its landing tau steps later."""
        return self.fragment_sync_delay

    def reduce(self, flat, layout, state, comm):
        """With a delay (a frontend that does not overlap it on a thread of its own, JAX): the fragment launched
        at the previous step is sent first, from the state alone, so XLA may run its collectives beside the
        step's compute; then the landing (:meth:`apply`); then the fragment launching is staged for the next
        step.  The same values as :meth:`apply` then :meth:`exchange`: only when the collectives run moves."""
        if self.fragment_sync_delay:  # the fragments from the counter as passed in (comm.counter knows it)
            step = comm.counter(state.step) + 1
            state = self._send_staged(state, comm, self._due(step, 1))
            flat, state = self.apply(flat, layout, state, comm)
            return flat, self._stage(flat, state, comm, self._due(step, 0))
        branches = [self._sync_now(a, b, comm, hierarchical(self.hierarchical, comm))
                    for a, b in self.fragment_bounds(flat.shape[0])]
        flat, *rest = comm.switch(self._due(comm.counter(state.step) + 1, 0), branches + [_unchanged],
                                  (flat, *state[1:]))
        return flat, DiLoCoState(state.step + 1, *rest)

    def apply(self, flat, layout, state, comm):
        """tau > 0: the step advances and the fragment launched tau steps ago lands (no collective).  The
        fragment launching at this step (:meth:`exchange`) is another one: ``tau < H / P``."""
        branches = [self._land(a, b) for a, b in self.fragment_bounds(flat.shape[0])]
        flat, *rest = comm.switch(self._due(comm.counter(state.step) + 1, self.fragment_sync_delay),
                                  branches + [_unchanged], (flat, *state[1:]))
        return flat, DiLoCoState(state.step + 1, *rest)

    def exchange(self, flat, layout, state, comm):
        """tau > 0, after :meth:`apply` (``state.step`` is this step): the fragment due launches, its averaged
        pseudo-gradient kept in ``pending`` until it lands (and, compressed, what it did not send in ``error``)."""
        due = self._due(comm.counter(state.step), 0)
        return self._send_staged(self._stage(flat, state, comm, due), comm, due)

    def _stage(self, flat, state, comm, due):
        """Fragment ``due`` (P: none) launches: its pseudo-gradient ``global - local`` into ``pending``, to be
        sent by :meth:`_send_staged` (no collective)."""
        branches = [self._staged(a, b) for a, b in self.fragment_bounds(flat.shape[0])]
        _, _, _, pending, _ = comm.switch(due, branches + [_unchanged], (flat, *state[1:]))
        return state._replace(pending=pending)

    def _send_staged(self, state, comm, due):
        """Fragment ``due`` (P: none), staged: its pseudo-gradient in ``pending`` becomes the workers' mean, and
        the error-feedback buffer what it did not send.  Reads the state alone, never the weights."""
        two_level = hierarchical(self.hierarchical, comm)
        branches = [self._sent(a, b, comm, two_level) for a, b in self.fragment_bounds(state.pending.shape[0])]
        pending, error = comm.switch(due, branches + [_unchanged], (state.pending, state.error))
        return state._replace(pending=pending, error=error)

    def _due(self, step, delay: int):
        """The fragment launched ``delay`` steps before ``step`` (an int32 counter), or P where none was.

        In the counter's namespace and on its device (the host, ``base.counter``), not the bucket's: it is
        ``comm.switch``'s index, which a frontend reads on the host."""
        xp = namespace(step)
        due = xp.asarray(self.fragments, dtype=xp.int32)
        for i, o in enumerate(self.offsets()):
            since = step - o - delay  # >= 0: launched at least once
            hit = xp.logical_and(since >= 0, since % self.sync_every == 0)
            due = xp.where(hit, xp.asarray(i, dtype=xp.int32), due)
        return due

    def _average(self, pseudo, error, comm, two_level: bool):
        """The workers' mean pseudo-gradient (as ``bits`` or ``compression`` send it), identical on every rank,
        and the error-feedback buffer after it (``error`` unchanged without compression)."""
        if self.compression is not None:
            return _sparse_mean(self.compression, pseudo, error, comm, two_level)

        def exchange(x, c):
            if self.bits == 32:
                return c.allreduce(x, ReduceOp.AVG)
            xp = namespace(x)
            shape = x.shape
            x = xp.reshape(x, (-1,))
            multiple = c.size * (2 if self.bits == 4 else 1)
            pad = -x.shape[0] % multiple
            if pad:
                x = xp.concat([x, xp.zeros((pad,), dtype=x.dtype, device=array_api_compat.device(x))])
            out = compressed_allreduce(x, c, True, bits=self.bits)
            return xp.reshape(out[:out.shape[0] - pad] if pad else out, shape)

        if two_level:
            return over_nodes(pseudo, comm, exchange), error
        return exchange(pseudo, comm), error

    def _outer(self, g, global_weights, momentum):
        """torch.optim.SGD's step (no dampening, no weight decay) on ``global_weights`` with gradient ``g``."""
        momentum = momentum * self.outer_momentum + g
        direction = g + momentum * self.outer_momentum if self.nesterov else momentum
        return global_weights - direction * self.outer_lr, momentum

    def _landed(self, local, new_global):
        if self.fragment_update_alpha == 0.0:
            return new_global
        return new_global + (local - new_global) * self.fragment_update_alpha

    def _sync_now(self, a: int, b: int, comm, two_level: bool):
        def branch(operand):
            flat, global_weights, momentum, pending, error = operand
            g, sent_error = self._average(global_weights[a:b] - flat[a:b], _part(error, a, b), comm, two_level)
            new_global, new_momentum = self._outer(g, global_weights[a:b], momentum[a:b])
            return (_put(flat, a, b, self._landed(flat[a:b], new_global)), _put(global_weights, a, b, new_global),
                    _put(momentum, a, b, new_momentum), pending, _put_part(error, a, b, sent_error))
        return branch

    def _staged(self, a: int, b: int):
        def branch(operand):
            flat, global_weights, momentum, pending, error = operand
            return flat, global_weights, momentum, _put(pending, a, b, global_weights[a:b] - flat[a:b]), error
        return branch

    def _sent(self, a: int, b: int, comm, two_level: bool):
        def branch(operand):
            pending, error = operand
            g, sent_error = self._average(pending[a:b], _part(error, a, b), comm, two_level)
            return _put(pending, a, b, g), _put_part(error, a, b, sent_error)
        return branch

    def _land(self, a: int, b: int):
        def branch(operand):
            flat, global_weights, momentum, pending, error = operand
            new_global, new_momentum = self._outer(pending[a:b], global_weights[a:b], momentum[a:b])
            return (_put(flat, a, b, self._landed(flat[a:b], new_global)), _put(global_weights, a, b, new_global),
                    _put(momentum, a, b, new_momentum), pending, error)
        return branch


def _unchanged(operand):
    return operand


def _put(x, a: int, b: int, value):
    """``x`` with ``[a:b]`` replaced by ``value``: a new array (JAX's are immutable, and a branch must not
    write a buffer another branch's caller still reads)."""
    xp = namespace(x)
    return xp.concat([x[:a], xp.astype(value, x.dtype), x[b:]])


def _part(error, a: int, b: int):
    """The error-feedback buffer of ``[a:b]``, or the empty buffer (no compression) as it is."""
    return error[a:b] if error.shape[0] else error


def _put_part(error, a: int, b: int, value):
    return _put(error, a, b, value) if error.shape[0] else error


def _sparse_mean(topk: TopK, pseudo, error, comm, two_level: bool):
    """SparseLoCo's exchange: ``e = decay e + pseudo``; each worker's top-k payload of ``e`` gathered and summed
    in rank order; ``e`` less what it sent.  Returns ``(mean, e)``.

    Two levels (a node is one worker, its ranks identical): each rank computes the node's whole payload, cut in
    L parts on chunk boundaries, and sends its own part across nodes; the parts received come back together
    inside the node (a gather of compressed bytes).  Every rank thus decodes the same bytes in the same order,
    and a node's ranks keep identical buffers."""
    xp = namespace(pseudo)
    e = error * topk.error_decay + pseudo
    if not two_level:
        payload, sent = topk.encode(e)
        return topk.mean(comm.allgather(payload), e.shape[0]), e - sent
    within, numel = comm.within, e.shape[0]
    span = -(-topk.chunks(numel) // within.size) * topk.chunk  # each part: a whole number of chunks
    padded = xp.concat([e, xp.zeros((span * within.size - numel,), dtype=e.dtype,
                                    device=array_api_compat.device(e))])
    real = [min(span, max(0, numel - i * span)) for i in range(within.size)]
    parts = [topk.encode(padded[i * span:(i + 1) * span], real[i]) for i in range(within.size)]
    mine = xp.stack([payload for payload, _ in parts])[within.rank, :]
    received = within.allgather(comm.across.allgather(mine))  # (L, nodes, bytes)
    mean = xp.concat([topk.mean(received[i, ...], span, real[i]) for i in range(within.size)])
    sent = xp.concat([dense for _, dense in parts])
    return mean[:numel], e - sent[:numel]


def SparseLoCo(sync_every: int = 32, fraction: float = 0.02, bits: int = 2, chunk: int = 4096,
               error_decay: float = 0.95, outer_lr: float = 1.0, **diloco):
    """SparseLoCo's settings as a :class:`DiLoCo`: the :class:`~.sparse.TopK` exchange, and a plain outer SGD
    step (no outer momentum: the error-feedback buffer stands in for it).  Further keywords go to DiLoCo
    (``fragments``, ``hierarchical``...)."""
    return DiLoCo(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=diloco.pop("outer_momentum", 0.0),
                  compression=TopK(fraction, bits, chunk, error_decay), **diloco)
