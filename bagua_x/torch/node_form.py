"""``hierarchical=None`` on >= 2 nodes of >= 2 ranks: flat or over nodes, chosen by timing both.

At the first forward (every rank runs it; nothing is in flight), both forms
of the algorithm's ``reduce`` are timed on copies of the real buckets with
throwaway state from ``init``, and every rank takes the form the slowest
rank's times favour (:func:`~bagua_x.core.autotune.choose_form`).  The choice
is switched on the communicator (:meth:`~.communicator.TorchCommunicator.use_nodes`,
the node groups stay), so the engines, QAdam's warmup allreduce included,
follow it.  It is saved in ``algorithm_state_dict()``, and a state that holds
one sets it instead of timing again: a resumed run continues in the form its
algorithm state was built in (LowPrecisionDecentralized's neighbour estimates
are of ranks in one form, of nodes in the other), bitwise.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from ..algorithms.base import Algorithm
from ..core.autotune import choose_form
from ..core.bucket import Bucket, BucketLayout
from ..core.comm import Feature, ReduceOp
from .communicator import TorchCommunicator
from .nodes import declared_setting

__all__ = ["NodeForm", "FORM_KEY"]

log = logging.getLogger(__name__)

FORM_KEY = "hierarchical"  # in algorithm_state_dict(): True over nodes, False flat (absent: not chosen yet)


class NodeForm:
    """The form of a wrapper's algorithm: measured once where ``hierarchical=None`` meets node groups."""

    def __init__(self, algorithm: Algorithm, comm: TorchCommunicator):
        self.algorithm, self.comm = algorithm, comm
        self.measured = declared_setting(algorithm) is None and Feature.HIERARCHICAL in comm.features
        self.two_level: Optional[bool] = None  # chosen (or loaded) form; None: not yet

    @property
    def pending(self) -> bool:
        return self.measured and self.two_level is None

    def choose(self, buckets: Sequence[Bucket]) -> None:
        """Time both forms on copies of ``buckets`` and take the faster (collective: at the first forward)."""
        runs = [_throwaway(self.algorithm, b, self.comm.size) for b in buckets]
        flat_comm = TorchCommunicator(self.comm.group, timeout=self.comm.timeout)
        device = buckets[0].buffer.device if buckets else torch.device("cpu")

        def run(two_level: bool) -> None:
            comm = self.comm if two_level else flat_comm
            with torch.no_grad():
                for flat, layout, state in runs:
                    self.algorithm.reduce(flat.clone(), layout, state, comm)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def slowest(values: Sequence[float]) -> list[float]:
            return flat_comm.allreduce(torch.tensor(values, dtype=torch.float64, device=device), ReduceOp.MAX).tolist()

        self._set(choose_form(run, slowest, type(self.algorithm).__name__).two_level)

    def save(self, state: dict) -> dict:
        return state if self.two_level is None or not self.measured else {**state, FORM_KEY: self.two_level}

    def load(self, saved: dict) -> dict:
        """``saved`` without the form, which is taken where this wrapper measures its form."""
        saved = dict(saved)
        form = saved.pop(FORM_KEY, None)
        if form is not None and self.measured:
            log.info("bagua_x: %s runs %s, as in the loaded algorithm state", type(self.algorithm).__name__,
                     "over nodes" if form else "flat")
            self._set(bool(form))
        elif form is not None:
            log.warning("bagua_x: the loaded algorithm state ran %s by measurement, but here %s runs in the form "
                        "its hierarchical= setting and the node layout give; keeping that",
                        "over nodes" if form else "flat", type(self.algorithm).__name__)
        return saved

    def _set(self, two_level: bool) -> None:
        self.two_level = two_level
        self.comm.use_nodes(two_level)


def _throwaway(algorithm: Algorithm, bucket: Bucket, world_size: int):
    """A copy of ``bucket``'s values laid out as the algorithm needs them, its layout, and fresh state."""
    source = bucket.layout
    layout = BucketLayout(source.names, [s.shape for s in source.slots], source.dtype, algorithm.alignment(world_size))
    flat = torch.zeros(layout.padded_numel, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
    flat[:layout.numel].copy_(bucket.buffer.reshape(-1)[:layout.numel])
    return flat, layout, algorithm.init(flat, layout, world_size)
